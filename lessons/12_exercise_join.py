"""torchrun --nproc_per_node=3 lessons/12_exercise_join.py

Checker for the chapter 12 exercise: train(ddp, opt, batches) with a different number of batches on each rank.

Options: --solution FILE checks your answer, the function named by --function NAME (default: train) in FILE.

train is called on every rank with the DDP model (lessonlib.training's float64 MLP), a plain SGD optimizer
and this rank's list of (x, y) batches, 4 rows each; rank r has 2 + (r + 1) % N of them, so the last rank
runs out first. It must train with the mean squared error (F.mse_loss), return on every rank, and leave
every rank with the weights of one process that, at each step, averages the loss over all the rows that
step had on all ranks. The model trains in a process group of its own (ddp.process_group) whose
collectives give up after 5 s, so a loop that hangs fails here in seconds and the checker goes on.
Without --solution the checker tests itself: it accepts the reference solution (the `solution` region,
which the chapter shows) and rejects a plain loop (it hangs), Join with its default divisor (the steps
that fewer ranks had batches for move the weights too little), and every rank stopping at the shortest
list (data dropped). At world size 1 there is nothing uneven and all three are right.
"""

import datetime
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lessonlib.exercises import run_checker, shared_verdict
from lessonlib.training import flat_params, global_batch, max_gap, mlp

ROWS, LR, SEED = 4, 0.1, 12
HANG_S = 5  # how long the candidate's process group waits in a collective before it gives up
TOL = 1e-12
JOIN = "wrap the loop in `with Join([ddp], divide_by_initial_world_size=False):`"


def counts(world_size):
    """Batches per rank: uneven from 2 ranks on, and the rank that runs out first is the last one."""
    return [2 + (r + 1) % world_size for r in range(world_size)]


def rows_of(ranks):
    return torch.cat([torch.arange(ROWS * r, ROWS * (r + 1)) for r in ranks])


def batches_of(rank, world_size):
    mine = rows_of([rank])
    return [
        tuple(t[mine] for t in global_batch(step, ROWS * world_size, SEED)) for step in range(counts(world_size)[rank])
    ]


def one_process(world_size, rule):
    """One process on every rank's rows: 'mean' (each step's mean over its rows: the goal), 'over N' (the
    remaining ranks' mean losses summed over the world size: Join's default) or 'shortest' (stop early)."""
    model, c = mlp(seed=2), counts(world_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(min(c) if rule == "shortest" else max(c)):
        x, y = global_batch(step, ROWS * world_size, SEED)
        active = [r for r in range(world_size) if c[r] > step]
        rows = rows_of(active)
        opt.zero_grad()
        loss = F.mse_loss(model(x[rows]), y[rows])
        (loss * len(active) / world_size if rule == "over N" else loss).backward()
        opt.step()
    return flat_params(model)


def attempt(fn, ctx, group):
    """None, or what went wrong on this rank when fn trained a model in `group`."""
    ddp = DDP(mlp(seed=2), process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    batches, t0 = batches_of(ctx.rank, ctx.world_size), time.monotonic()
    try:
        fn(ddp, opt, batches)
    except Exception as e:
        if waited := re.search(r"(Timed out|Connection (closed|reset))[^\n]*", str(e)):
            return (
                f"{fn.__name__} waited {time.monotonic() - t0:.0f} s for another rank and gave up ({waited.group(0)}). "
                "A rank whose batches ran out left its loop while this one waited for it in DDP's all-reduce: " + JOIN
            )
        return f"{fn.__name__} raised {type(e).__name__}: {str(e)[:300]}"
    got = flat_params(ddp.module)
    if max_gap(got, one_process(ctx.world_size, "mean")) < TOL:
        return None
    if max_gap(got, one_process(ctx.world_size, "over N")) < TOL:
        return (
            "the steps that only some ranks had batches for moved the weights too little: Join's DDP hook divides "
            "their gradient by the initial world size by default; pass divide_by_initial_world_size=False"
        )
    if max_gap(got, one_process(ctx.world_size, "shortest")) < TOL:
        return (
            f"the weights are those of one process that stopped after {min(counts(ctx.world_size))} steps, the "
            f"shortest rank's: the other ranks' last batches were dropped. Train on every batch: {JOIN}"
        )
    gap = max_gap(got, one_process(ctx.world_size, "mean"))
    return f"the final weights are {gap:.1e} from one process that averages each step's loss over all its rows"


def verdict(fn, ctx):
    # A group of its own, with a short timeout: a candidate that hangs there fails in HANG_S seconds and
    # leaves the default group (which the verdicts travel on) as it was.
    group = dist.new_group(timeout=datetime.timedelta(seconds=HANG_S))
    problem = shared_verdict(ctx, attempt(fn, ctx, group))  # every rank is done with the group now
    dist.destroy_process_group(group)
    return problem


# [start: solution]
def train(ddp, opt, batches):
    from torch.distributed.algorithms.join import Join  # self-contained: the checker receives this function alone

    # A rank that runs out keeps answering the others' all-reduces (with zeros) until every rank is done,
    # and each step's gradient is divided by the ranks that still had a batch: the mean over its rows.
    with Join([ddp], divide_by_initial_world_size=False):
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()


# [end: solution]


def plain_loop(ddp, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()


def join_default_divisor(ddp, opt, batches):
    from torch.distributed.algorithms.join import Join

    with Join([ddp]):
        plain_loop(ddp, opt, batches)


def shortest_list(ddp, opt, batches):
    n = torch.tensor([len(batches)])
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=ddp.process_group)
    plain_loop(ddp, opt, batches[: n.item()])


WRONG = [plain_loop, join_default_divisor, shortest_list]


def main():
    run_checker(__doc__, verdict, train, WRONG, right_alone=WRONG, passed="trains on uneven inputs like one process")


if __name__ == "__main__":
    main()
