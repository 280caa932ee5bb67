"""torchrun --nproc_per_node=3 lessons/12_slow_rank.py

A slow rank that is not a bug: rank 0 evaluates or saves for longer than the timeout the others wait with.

Options: --short S (the job's bound on a collective after start-up, default 2), --long S (the bound for
a slow phase, default 10), --work S (rank 0's evaluation of every batch, default 3) and --save S (rank 0's
save, default 2.5), both between --short and --long; --steps N (training steps during the save, default
20); --pg-timeout S (setup's bound, start-up included, default 30).

The model is lessonlib.training's float64 MLP; the evaluation set is 12 batches, each taking --work/12 s
(a sleep standing for a model far bigger than this one). Asserted:
  tries: rank 0 evaluates every batch and broadcasts the metric; the other ranks wait for it, six ways at
    once, each in a group of its own made with timeout=--short (side group: --long), so that one failure
    does not end the others (each error is caught and reported). plain, monitored_barrier(timeout=long)
    and broadcast(async_op=True).wait(timeout=long) fail after --short with gloo's timeout error, though
    nothing is wrong; rank 0, arriving later, finds its peers gone ("Connection closed by peer").
    barrier(timeout=long) before the broadcast, set_timeout(long) around it, and a side group made with
    new_group(timeout=long) wait as long as rank 0 needs, and get its metric.
  sharded: every rank evaluates batches[rank::W] and all-reduces (sum, count): the same metric as rank
    0's full evaluation (1e-12), in about 1/W of its time; no rank waits more than 1 s.
  save: rank 0 snapshots the weights, then writes them in a thread at a throttled pace (--save seconds,
    longer than --short) while every rank trains on: no step is slowed by more than 1 s, the file holds
    the snapshot, whole (not the weights trained since; the state dict's tensors are the parameters'
    memory), and the others wait for the end of the write in a group with the --long bound.
  Also: dist.set_timeout is public in torch 2.14.1; distributed_c10d._set_pg_timeout, its old private
    name, still works, with a FutureWarning.
"""

import argparse
import contextlib
import io
import os
import re
import tempfile
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import global_batch, mlp

BATCHES, ROWS = 12, 16  # the evaluation set: 12 batches of 16 rows, divisible by 1 to 4 ranks
STEP_TIME = 0.15  # seconds each training step sleeps, standing for a real model's forward and backward
TRIES = ("plain", "monitored_barrier(timeout)", "wait(timeout)", "barrier(timeout)", "set_timeout", "side group")
MUST_FAIL = TRIES[:3]


# [start: evaluate]
def evaluate(model, batches, seconds_per_batch):
    """(sum of squared errors, count) over `batches`: a metric that adds up across ranks."""
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in batches:
            x, y = global_batch(1000 + i, ROWS)  # evaluation rows, not training's
            total += torch.stack([((model(x) - y) ** 2).sum(), torch.tensor(float(y.numel()))])
            time.sleep(seconds_per_batch)  # a model far bigger than this one
    return total


# [end: evaluate]


# [start: wait_for_rank0]
def wait_for_rank0(how, group, metric, short, long):
    """Every rank, after rank 0's evaluation: rank 0's metric broadcast to all, waited for one way."""
    if how == "monitored_barrier(timeout)":
        dist.monitored_barrier(group=group, timeout=long)  # bounds rank 0's wait for the others only
    elif how == "barrier(timeout)":
        dist.barrier(group=group, timeout=long)  # a bound for this call alone
    if how == "set_timeout":
        dist.set_timeout(long, group=group)  # the group's bound, for this phase...
        dist.broadcast(metric, src=0, group=group)
        dist.set_timeout(short, group=group)  # ...and back
    elif how == "wait(timeout)":
        dist.broadcast(metric, src=0, group=group, async_op=True).wait(timeout=long)
    else:  # plain, side group (made with new_group(timeout=long)), and after either barrier
        dist.broadcast(metric, src=0, group=group)


# [end: wait_for_rank0]


def attempt(how, group, metric, short, long, out):
    start = time.perf_counter()
    try:
        wait_for_rank0(how, group, metric, short, long)
        out[how] = {"ok": True, "metric": metric.tolist()}
    except RuntimeError as e:  # gloo's errors (DistBackendError is one)
        out[how] = {"ok": False, "error": str(e).strip().splitlines()[0]}
    out[how]["waited"] = time.perf_counter() - start


def part_tries(ctx, model, args):
    short, long = timedelta(seconds=args.short), timedelta(seconds=args.long)
    groups = {how: dist.new_group(timeout=long if how == "side group" else short) for how in TRIES}
    dist.barrier()
    start = time.perf_counter()
    metric = torch.zeros(2, dtype=torch.float64)
    if ctx.is_main:
        metric = evaluate(model, range(BATCHES), args.work / BATCHES)
    work = time.perf_counter() - start
    # One wait serves all six: each try waits in a thread, on its own group.
    out = {}
    threads = [threading.Thread(target=attempt, args=(h, groups[h], metric.clone(), short, long, out)) for h in TRIES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.long + 5)
    assert not any(t.is_alive() for t in threads), f"rank {ctx.rank}: a try outlived its bound"
    for group in groups.values():
        dist.destroy_process_group(group)
    mine = {"work": work, "total": time.perf_counter() - start, "tries": {how: out[how] for how in TRIES}}
    lessonlib.report("tries", mine)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    full = everyone[0]["tries"]["side group"]["metric"]  # what rank 0 computed and sent
    for how in TRIES if ctx.world_size > 1 else ():
        got = out[how]
        if how not in MUST_FAIL:  # every rank waited as long as rank 0 needed, and got its metric
            assert got["ok"] and got["metric"] == full, f"rank {ctx.rank}: {how} failed: {got}"
            assert ctx.is_main or got["waited"] > args.short, f"rank {ctx.rank}: {how} did not wait: {got}"
        elif ctx.is_main:  # the others gave up before rank 0 came, and closed their connections
            assert re.search("closed by peer|reset by peer", got.get("error", "")), f"rank 0: {how}: {got}"
        else:  # gave up after --short, before rank 0 came
            assert not got["ok"] and got["waited"] < args.work, f"rank {ctx.rank}: {how} did not time out: {got}"
    if ctx.world_size > 1:
        errors = " ".join(everyone[r]["tries"]["plain"]["error"] for r in range(1, ctx.world_size))
        assert f"Timed out waiting {round(args.short * 1000)}ms" in errors, f"rank {ctx.rank}: {errors}"
    if ctx.is_main:
        for how in TRIES:
            waits = [f"{everyone[r]['tries'][how]['waited']:.2f}" for r in range(1, ctx.world_size)]
            fate = "ok" if all(everyone[r]["tries"][how]["ok"] for r in range(ctx.world_size)) else "failed"
            print(f"{how:28} the others waited {', '.join(waits) or '-'} s: {fate}")
    return torch.tensor(full, dtype=torch.float64), everyone[0]["work"]


def part_sharded(ctx, model, args, full, full_time):
    dist.barrier()
    start = time.perf_counter()
    # [start: sharded]
    mine = evaluate(model, range(ctx.rank, BATCHES, ctx.world_size), args.work / BATCHES)  # 1/W of it
    busy = time.perf_counter() - start
    dist.all_reduce(mine)  # (sum, count) of every rank: the metric of every batch, once
    # [end: sharded]
    total = time.perf_counter() - start
    mse, full_mse = (mine[0] / mine[1]).item(), (full[0] / full[1]).item()
    lessonlib.report("sharded", {"busy": busy, "waited": total - busy, "total": total, "mse": mse})
    assert abs(mse - full_mse) <= 1e-12 * full_mse, f"rank {ctx.rank}: sharded mse {mse} != rank 0's {full_mse}"
    bound = full_time * (1 / ctx.world_size + 0.25)
    assert total < bound, f"rank {ctx.rank}: sharded evaluation took {total:.2f} s, rank 0 alone {full_time:.2f} s"
    assert total - busy < 1.0, f"rank {ctx.rank}: waited {total - busy:.2f} s for the others"
    if ctx.is_main:
        print(f"sharded over {ctx.world_size}: {total:.2f} s (rank 0 alone: {full_time:.2f} s); mse {mse:.6f}")


# [start: background_save]
def save_in_background(model, path, seconds, outcome):
    """Rank 0's save, off the critical path: the snapshot now, the slow write in a thread."""
    snapshot = io.BytesIO()
    torch.save(model.state_dict(), snapshot)  # a copy: state_dict()'s tensors are the parameters themselves
    data = snapshot.getvalue()

    def write():
        start = time.perf_counter()
        try:
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:  # a slow shared file system: ten pieces, seconds/10 each
                for i in range(10):
                    f.write(data[i * len(data) // 10 : (i + 1) * len(data) // 10])
                    time.sleep(seconds / 10)
            os.replace(tmp, path)  # whole or absent, never half written (chapter 10)
        except Exception as e:  # raised in this thread: handed to the main thread, which joins it
            outcome["error"] = repr(e)
        outcome["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=write, name="save")
    thread.start()
    return thread, data


# [end: background_save]


def part_save(ctx, args, folder):
    ddp = DDP(mlp(seed=0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    wait_group = dist.new_group(timeout=timedelta(seconds=args.long))  # fix B's kind of group, for the end
    dist.barrier()
    start = time.perf_counter()
    # [start: train_on]
    if ctx.is_main:
        outcome, path = {}, Path(folder) / "checkpoint.pt"
        thread, saved = save_in_background(ddp.module, path, args.save, outcome)
    steps = []
    for step in range(args.steps):  # every rank trains on, rank 0 included, while the file is written
        t0 = time.perf_counter()
        x, y = global_batch(step, ROWS)
        F.mse_loss(ddp(x), y).backward()  # DDP's all-reduce, in the default group: --short
        opt.step()
        opt.zero_grad()
        time.sleep(STEP_TIME)
        steps.append(time.perf_counter() - t0)
    if ctx.is_main:
        thread.join(args.long)  # before the next save, or the end; bounded
        assert not thread.is_alive() and "error" not in outcome, f"rank 0: the save did not finish: {outcome}"
    dist.barrier(group=wait_group)  # the others wait for that join in a group with a long bound
    # [end: train_on]
    dist.destroy_process_group(wait_group)
    mine = {"max step": max(steps), "mean step": sum(steps) / len(steps), "total": time.perf_counter() - start}
    assert mine["max step"] < STEP_TIME + 1.0, f"rank {ctx.rank}: a step took {mine['max step']:.2f} s"
    if ctx.is_main:
        loaded = torch.load(path, weights_only=True)
        expected = torch.load(io.BytesIO(saved), weights_only=True)
        assert all(torch.equal(loaded[k], v) for k, v in expected.items()), "rank 0: the file is not the snapshot"
        assert not torch.equal(loaded["0.weight"], ddp.module[0].weight), "rank 0: training changed nothing"
        live = ddp.module.state_dict()["0.weight"]  # what a thread handed the state dict itself would write
        assert live.data_ptr() == ddp.module[0].weight.data_ptr(), "rank 0: state_dict() made a copy"
        assert outcome["seconds"] > args.short, f"rank 0: the save took {outcome['seconds']:.2f} s, not > --short"
        mine.update({"save": outcome["seconds"], "bytes": len(saved)})
        print(f"save in a thread: {outcome['seconds']:.2f} s; {args.steps} steps meanwhile, the longest")
        print(f"  {mine['max step']:.2f} s, all {mine['total']:.2f} s")
    lessonlib.report("save", mine)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--short", type=float, default=2.0, help="the job's bound on a collective, seconds")
    parser.add_argument("--long", type=float, default=10.0, help="the bound for a slow phase, seconds")
    parser.add_argument("--work", type=float, default=3.0, help="rank 0's whole evaluation, seconds")
    parser.add_argument("--save", type=float, default=2.5, help="rank 0's save, seconds (more than --short)")
    parser.add_argument("--steps", type=int, default=20, help="training steps during the save")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="setup's bound, start-up included")
    args = parser.parse_args()
    if not 0 < args.short < args.work < args.long:
        parser.error(f"need 0 < --short < --work < --long; got {args.short}, {args.work}, {args.long}")
    if not args.short < args.save < args.long or args.steps < 1:
        parser.error(f"need --short < --save < --long and --steps >= 1; got {args.save}, {args.steps}")
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    # [start: public]
    dist.set_timeout(timedelta(seconds=args.short))  # public in torch 2.14.1: the job's bound from now on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=args.short))  # the old name: private
    assert "set_timeout" in dist.distributed_c10d.__all__ and not hasattr(dist, "_set_pg_timeout")
    assert any(w.category is FutureWarning and "set_timeout" in str(w.message) for w in caught), caught
    # [end: public]
    model = mlp(seed=0)
    full, full_time = part_tries(ctx, model, args)
    part_sharded(ctx, model, args, full, full_time)
    with tempfile.TemporaryDirectory() if ctx.is_main else contextlib.nullcontext() as folder:
        part_save(ctx, args, folder)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
