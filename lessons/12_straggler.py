"""torchrun --nproc_per_node=3 lessons/12_straggler.py

Two jobs that run but misbehave: one where a rank is slow, one where the ranks no longer hold the same model.

Options: --part straggler, drift or both (default); --slow-rank R (default: the last rank); --delay S
(seconds rank R sleeps in each forward; default 0.3); --steps N (default 5); --pg-timeout S (default 30).

straggler: every rank trains lessonlib.training's MLP under DDP, and rank R sleeps --delay in its forward
  each step (a slow GPU, a throttled CPU or a starved data loader look the same from here). Each rank
  times its forward, its backward (which ends waiting for DDP's all-reduce) and the whole step, and the
  times are all-gathered. The whole step takes as long on every rank, so it names nobody; the straggler
  is the rank with the longest forward and the shortest backward (it never waits: the others wait for
  it). Asserted from the medians over the steps after the first.
drift: a common mistake, a checkpoint loaded on rank 0 only after the model was wrapped in DDP. DDP
  broadcast rank 0's weights when it was built, not since, so rank 0 trains from the checkpoint and the
  others from the initial weights DDP gave them, with the same averaged gradients: nothing fails, and the
  replicas stay apart for good. A checksum of each rank's parameters (sha256 of their bytes),
  all-gathered, names the ranks that differ from rank 0 (asserted: every other rank, which agree with
  each other; the one odd rank out holds the checkpoint). The fix, loading on every rank before
  wrapping, gives one checksum on every rank (asserted).
"""

import argparse
import hashlib
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import global_batch, mlp, my_rows

ROWS, LR = 4, 0.1  # rows per rank and step; SGD's rate


class Slow(torch.nn.Module):
    """The model, with `delay` seconds of sleep in every forward: what a straggler rank does."""

    def __init__(self, model, delay):
        super().__init__()
        self.model, self.delay = model, delay

    def forward(self, x):
        time.sleep(self.delay)
        return self.model(x)


def batch(ctx, step):
    x, y = global_batch(step, ROWS * ctx.world_size)
    mine = my_rows([ROWS] * ctx.world_size, ctx.rank)
    return x[mine], y[mine]


# [start: step_times]
def step_times(ddp, opt, ctx, steps):
    """[(forward, backward, step)] seconds of each step on this rank."""
    times = []
    for step in range(steps):
        x, y = batch(ctx, step)
        t0 = time.perf_counter()
        loss = F.mse_loss(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()  # ends when DDP's all-reduce of the last bucket is done: waiting for peers included
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t0))
    return times


def all_ranks(values):
    """Every rank's list of floats, indexed by rank (an all_gather of one float64 tensor)."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


# [end: step_times]


def part_straggler(ctx, slow_rank, delay, steps):
    model = mlp(seed=0)
    ddp = DDP(Slow(model, delay if ctx.rank == slow_rank else 0.0))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    times = step_times(ddp, opt, ctx, steps)
    medians = [statistics.median(t[k] for t in times[1:] or times) for k in range(3)]  # step 0 builds buckets
    rows = all_ranks(medians)
    forward, backward, whole = ([row[k] for row in rows] for k in range(3))
    if ctx.rank == 0:
        for r, (f, b, s) in enumerate(rows):
            print(f"rank {r}: forward {f * 1e3:7.1f} ms   backward {b * 1e3:7.1f} ms   step {s * 1e3:7.1f} ms")
    found = max(range(ctx.world_size), key=forward.__getitem__)
    lessonlib.report("straggler", {"rank": ctx.rank, "forward": forward, "backward": backward, "step": whole})
    if ctx.world_size > 1:
        assert found == slow_rank, f"rank {ctx.rank}: longest forward on rank {found}, expected {slow_rank}: {rows}"
        least_wait = min(range(ctx.world_size), key=backward.__getitem__)
        assert least_wait == slow_rank, f"rank {ctx.rank}: shortest backward on rank {least_wait}: {rows}"
        # Everyone's step lasts about as long as the straggler's: the others waited in backward.
        assert max(whole) - min(whole) < delay / 2, f"rank {ctx.rank}: steps differ by more than delay/2: {whole}"
        if ctx.rank == 0:
            print(f"straggler: rank {found} (longest forward, shortest backward); every step lasts ~{min(whole):.2f} s")


# [start: checksum]
def checksum(module):
    """sha256 of the bytes of every parameter, in order: equal replicas give equal checksums."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def differing_ranks(module):
    """The ranks whose parameters differ from rank 0's, found by all-gathering each rank's checksum."""
    sums = [None] * dist.get_world_size()
    dist.all_gather_object(sums, checksum(module))
    return [r for r, s in enumerate(sums) if s != sums[0]], sums


# [end: checksum]


def train(ddp, ctx, steps):
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(ctx, step)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def part_drift(ctx, steps):
    saved = mlp(seed=1).state_dict()  # stands for a checkpoint file every rank could read
    # [start: late_load]
    ddp = DDP(mlp(seed=ctx.rank + 10))  # DDP broadcasts rank 0's weights here, once
    if ctx.rank == 0:
        ddp.module.load_state_dict(saved)  # the mistake: after DDP, and on rank 0 only
    # [end: late_load]
    train(ddp, ctx, steps)
    late, late_sums = differing_ranks(ddp.module)
    if ctx.rank == 0:
        print(f"loaded on rank 0 after DDP: checksums {late_sums}; ranks that differ from rank 0: {late}")
    assert late == list(range(1, ctx.world_size)), f"rank {ctx.rank}: expected every other rank to differ: {late_sums}"
    assert len(set(late_sums[1:])) <= 1, f"rank {ctx.rank}: the ranks DDP synced should agree: {late_sums}"
    # [start: fixed_load]
    model = mlp(seed=ctx.rank + 10)
    model.load_state_dict(saved)  # every rank, before DDP
    ddp = DDP(model)
    # [end: fixed_load]
    train(ddp, ctx, steps)
    fixed, sums = differing_ranks(ddp.module)
    if ctx.rank == 0:
        print(f"loaded on every rank before DDP: checksums {sums}; ranks that differ: {fixed}")
    assert fixed == [], f"rank {ctx.rank}: replicas differ after the fix: {sums}"
    lessonlib.report("drift", {"late": late, "late_sums": late_sums, "fixed": fixed, "fixed_sums": sums})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--part", choices=["straggler", "drift", "both"], default="both")
    parser.add_argument("--slow-rank", type=int, default=None, help="default: the last rank")
    parser.add_argument("--delay", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    args = parser.parse_args()
    if args.delay < 0 or args.steps < 1:
        parser.error(f"--delay must be >= 0 and --steps >= 1; got {args.delay} and {args.steps}")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    slow = world_size - 1 if args.slow_rank is None else args.slow_rank
    if not 0 <= slow < world_size:
        parser.error(f"--slow-rank must be a rank of this job, 0 to {world_size - 1}; got {slow}")
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    if args.part in ("straggler", "both"):
        part_straggler(ctx, slow, args.delay, args.steps)
    if args.part in ("drift", "both"):
        part_drift(ctx, args.steps)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
