"""torchrun --nproc_per_node=3 lessons/12_uneven.py

Uneven inputs: rank r has BASE + r batches, so rank 0 runs out first. What breaks, and Join.

Options: --mode join (the default), plain (the pitfall), throw or log (a second pitfall); --pg-timeout S
(how long a collective waits; default: 5 in plain mode, 30 otherwise); --base 3 (rank 0's batches).

Every batch holds 4 rows; rank r's rows of step i are its slice of global_batch(i), so one process can
build every rank's data. The model is lessonlib.training's float64 MLP, SGD with momentum.
  plain: the usual loop. Rank 0 runs out and goes on to teardown's barrier; the others' next backward
    waits in DDP's all-reduce for it. A barrier does not answer an all-reduce: every rank fails with
    gloo's "Timed out waiting ...ms" after --pg-timeout seconds (reported: where each rank waited).
  join: the same loop in `with Join([ddp], divide_by_initial_world_size=...)`, run with True (the default)
    and False. Every rank ends with the same weights (the last rank to run out broadcasts them), equal to
    one process that applies, at step i, the sum of the mean-loss gradients of the ranks that still had a
    batch, divided by N (True) or by their number k (False: the mean over that step's rows); the factor
    the divisor leaves (k/N, or 1) is measured at every step against that mean. Join syncs no optimizer
    state: each rank keeps the momentum of the step where it ran out, and one more step on every rank
    after Join leaves their weights apart (all asserted).
  throw: Join([ddp], throw_on_early_termination=True): when rank 0 runs out, every rank raises at the same
    step (asserted: BASE steps each, weights equal to one process on those steps); the lesson catches it
    and finishes cleanly.
  log: Join, and in the loop an all-reduce of the loss for a log line. Join shadows DDP's collectives
    only: rank 0, joined, counts the ranks still running with an all-reduce of a float32, which meets
    rank 1's float64 loss; gloo finds 8 bytes where it expects 4 and aborts rank 0 (SIGABRT).
"""

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import flat_grads, flat_params, gather, global_batch, max_gap, mlp, my_rows

ROWS, LR, MOMENTUM = 4, 0.1, 0.9  # rows per rank and step; SGD's settings
TOL = 1e-12


def my_batches(rank, world_size, base):
    """This rank's base + rank batches: its rows of global_batch(step), step by step."""
    mine = my_rows([ROWS] * world_size, rank)
    return [tuple(t[mine] for t in global_batch(step, ROWS * world_size)) for step in range(base + rank)]


def first_active(step, base):
    """The ranks that still have a batch at `step` are this one and those above it (rank r has base + r)."""
    return max(0, step - base + 1)


def momentum(opt):
    return torch.cat([opt.state[p]["momentum_buffer"].flatten() for p in opt.param_groups[0]["params"]])


def make():
    ddp = DDP(mlp(seed=0))
    return ddp, torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)


def reference(world_size, base, by_initial, steps=None):
    """One process, no DDP: the weights and momentum after each step, computed from the rule directly."""
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params, momenta = [], []
    for step in range(steps if steps is not None else base + world_size - 1):
        x, y = global_batch(step, ROWS * world_size)
        active = range(first_active(step, base), world_size)
        opt.zero_grad()
        if by_initial:  # each remaining rank's mean-loss gradient, summed, over the initial world size
            parts = [my_rows([ROWS] * world_size, r) for r in active]
            loss = sum(F.mse_loss(model(x[p]), y[p]) for p in parts) / world_size
        else:  # one mean over every row the remaining ranks had at this step
            rows = slice(ROWS * active[0], None)
            loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        params.append(flat_params(model))
        momenta.append(momentum(opt))
    return params, momenta


def measure_factor(ddp, opt, world_size, base, factors):
    """Before each opt.step: the gradient DDP left, as a multiple of the mean gradient over that step's rows."""

    def hook(optimizer, args, kwargs):
        step = len(factors)
        x, y = global_batch(step, ROWS * world_size)
        rows = slice(ROWS * first_active(step, base), None)
        alone = copy.deepcopy(ddp.module)  # the same weights, one process, every remaining rank's rows
        F.mse_loss(alone(x[rows]), y[rows]).backward()
        mean, applied = flat_grads(alone), flat_grads(ddp.module)
        factor = (applied @ mean / (mean @ mean)).item()
        assert max_gap(applied, factor * mean) < TOL, f"step {step}: DDP's gradient is not a multiple of the mean"
        factors.append(factor)

    return opt.register_step_pre_hook(hook)


def train(ddp, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()  # DDP's all-reduce: every rank must get here
        opt.step()


def plain(ctx, base):
    """The pitfall: report where this rank waited and what it got, then let the error end the rank."""
    ddp, opt = make()
    batches = my_batches(ctx.rank, ctx.world_size, base)
    where, t0 = "training", time.monotonic()
    try:
        for step, batch in enumerate(batches):
            where, t0 = f"backward of step {step}", time.monotonic()
            train(ddp, opt, [batch])
        print(f"rank {ctx.rank}: out of batches after {len(batches)} steps; on to teardown's barrier")
        where, t0 = "teardown's barrier", time.monotonic()
        lessonlib.teardown()
    except RuntimeError as e:
        waited = round(time.monotonic() - t0, 2)
        row = {"rank": ctx.rank, "batches": len(batches), "waited in": where, "seconds": waited, "error": str(e)}
        lessonlib.report("plain", row)
        print(f"rank {ctx.rank}: failed in {where} after {waited} s")
        raise
    print(f"rank {ctx.rank}: done (no rank ran out early at world size {ctx.world_size})")


def join(ctx, base):
    n, rank = ctx.world_size, ctx.rank
    batches = my_batches(rank, n, base)
    for by_initial in (True, False):
        ddp, opt = make()
        factors = []
        measuring = measure_factor(ddp, opt, n, base, factors)
        # [start: join]
        with Join([ddp], divide_by_initial_world_size=by_initial):
            train(ddp, opt, batches)  # the same loop; a rank that runs out shadows the others' all-reduces
        # [end: join]
        params, momenta = reference(n, base, by_initial)
        got = flat_params(ddp.module)
        every = gather(got)
        assert all(torch.equal(p, every[-1]) for p in every), f"rank {rank}: Join left the ranks' weights apart"
        gap = max_gap(got, params[-1])
        assert gap < TOL, f"rank {rank}: divide_by_initial_world_size={by_initial}: {gap:.1e} from one process"
        for step, factor in enumerate(factors):
            k = n - first_active(step, base)
            want = k / n if by_initial else 1.0
            assert abs(factor - want) < TOL, f"rank {rank}: step {step}: factor {factor}, expected {want}"
        # Join broadcasts the weights, not the optimizer: the momentum is that of this rank's last step.
        mom_own, mom_last = max_gap(momentum(opt), momenta[len(batches) - 1]), max_gap(momentum(opt), momenta[-1])
        assert mom_own < TOL, f"rank {rank}: momentum {mom_own:.1e} from its own last step's"
        assert (mom_last > 1e-6) == (rank < n - 1), f"rank {rank}: momentum {mom_last:.1e} from the last step's"
        # So one more step, every rank with a batch, sets the ranks' weights apart again.
        measuring.remove()
        x, y = global_batch(99, ROWS * n)
        mine = my_rows([ROWS] * n, rank)
        train(ddp, opt, [(x[mine], y[mine])])
        after = max_gap(flat_params(ddp.module), gather(flat_params(ddp.module))[-1])
        assert (after > 1e-6) == (rank < n - 1), f"rank {rank}: {after:.1e} from the last rank after one more step"
        row = {
            "divide_by_initial_world_size": by_initial,
            "rank": rank,
            "batches": len(batches),
            "weight gap to one process": gap,
            "momentum gap to the last rank": mom_last,
            "weight gap to the last rank after one more step": after,
            "factor per step": factors,
        }
        lessonlib.report("join", row)
        print(f"rank {rank}: {len(batches)} batches, divide_by_initial_world_size={by_initial}: {gap:.0e} off")
        by_rank = [None] * n
        dist.all_gather_object(by_rank, factors)
        if ctx.is_main:  # the last rank ran every step
            print(f"  the factor DDP's average left at each step: {[round(f, 12) for f in by_rank[-1]]}")


def throw(ctx, base):
    ddp, opt = make()
    batches = my_batches(ctx.rank, ctx.world_size, base)
    # [start: throw]
    steps, stopped = 0, None
    try:
        with Join([ddp], throw_on_early_termination=True):
            for x, y in batches:
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()
                steps += 1
    except RuntimeError as e:  # on every rank, at the same step, once one rank has run out
        stopped = str(e)
    # [end: throw]
    every = [None] * ctx.world_size
    dist.all_gather_object(every, steps)
    assert every == [base] * ctx.world_size, f"rank {ctx.rank}: the ranks stopped after {every} steps"
    assert (stopped is None) == (ctx.world_size == 1), f"rank {ctx.rank}: raised {stopped!r}"
    gap = max_gap(flat_params(ddp.module), reference(ctx.world_size, base, False, steps=base)[0][-1])
    assert gap < TOL, f"rank {ctx.rank}: weights {gap:.1e} from one process on the first {base} steps"
    row = {"rank": ctx.rank, "batches": len(batches), "steps done": steps, "error": stopped, "weights": gap}
    lessonlib.report("throw", row)
    print(f"rank {ctx.rank}: {len(batches)} batches, stopped after {steps} steps: {stopped}")


def log(ctx, base):
    """Join shadows DDP's collectives only: an all-reduce of our own in the loop meets Join's, on rank 0."""
    ddp, opt = make()
    batches = my_batches(ctx.rank, ctx.world_size, base)
    # [start: log]
    with Join([ddp]):
        for x, y in batches:
            opt.zero_grad()
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            total = loss.detach()
            dist.all_reduce(total)  # the ranks' losses, for a log line: a collective Join does not know
    # [end: log]
    print(f"rank {ctx.rank}: done (no rank ran out early at world size {ctx.world_size})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--mode", choices=["join", "plain", "throw", "log"], default="join")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective waits (default: 5 plain, 30 else)")
    parser.add_argument("--base", type=int, default=3, choices=range(1, 21), metavar="1..20", help="rank 0's batches")
    args = parser.parse_args()
    timeout = args.pg_timeout if args.pg_timeout is not None else 5 if args.mode == "plain" else 30
    ctx = lessonlib.setup(device="cpu", timeout=timeout)
    if args.mode == "plain":
        plain(ctx, args.base)  # tears down itself: its barrier is where rank 0 waits
        return
    {"join": join, "throw": throw, "log": log}[args.mode](ctx, args.base)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
