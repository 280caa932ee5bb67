"""torchrun --nproc_per_node=3 lessons/06_exercise_accumulate.py

Checker for the chapter 6 exercise: one optimizer step of gradient accumulation under DDP.

Options: --solution FILE checks your answer, the function named by --function NAME (default: accumulate_step)
in FILE.

A solution is a function `accumulate_step(ddp, opt, micro_batches)`: `ddp` is a DistributedDataParallel
model, `opt` its optimizer, `micro_batches` a list of k (x, y) pairs for this rank. It must leave the
model where one process would be after one SGD step on every rank's rows at once (mean squared error),
and all-reduce only once per step. Each rank checks two steps for k = 1, 2 and 4 against that
reference (to 1e-10) and counts DDP's all-reduces with a communication hook; the ranks agree on the
verdict before anyone reports it.

Without --solution the checker tests itself: the reference solution (the `solution` region, which the
chapter shows) must pass, and three plausible wrong answers must fail: no 1/k scale, no no_sync (k
all-reduces a step), and every micro-batch inside no_sync (no all-reduce at all, so the ranks drift
apart).
"""

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from lessonlib.exercises import run_checker
from lessonlib.training import flat_params, global_batch, mlp, my_rows

TOL = 1e-10
ROWS = 3  # per micro-batch


def count_all_reduces(counter, bucket):
    counter["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def verdict(fn, ctx):
    """None if fn matches one process and all-reduces once per step, for this rank; else the problem."""
    n = ctx.world_size
    for k in (1, 2, 4):
        reference, ddp, counter = mlp(seed=k), DDP(mlp(seed=k)), {"calls": 0}
        ddp.register_comm_hook(counter, count_all_reduces)
        opt_ref, opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, ddp))
        for step in range(2):
            x, y = global_batch(10 * k + step, n * k * ROWS)
            opt_ref.zero_grad()
            F.mse_loss(reference(x), y).backward()
            opt_ref.step()
            mine = my_rows([k * ROWS] * n, ctx.rank)
            try:
                fn(ddp, opt, list(zip(x[mine].split(ROWS), y[mine].split(ROWS))))
            except Exception as e:  # a crash is a wrong answer too, with its message
                return f"k={k}: accumulate_step raised {type(e).__name__}: {e}"
            gap = (flat_params(ddp.module) - flat_params(reference)).abs().max().item()
            if gap > TOL:
                return f"k={k}, step {step + 1}: the parameters are {gap:.2e} from one process on all rows"
        if counter["calls"] != 2:
            return f"k={k}: {counter['calls']} all-reduces in 2 steps; expected 1 per step"
    return None


# [start: solution]
def accumulate_step(ddp, opt, micro_batches):
    import contextlib  # self-contained: a solution is sent to the checker alone

    k = len(micro_batches)
    opt.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        # No all-reduce until the last micro-batch; its backward sends the accumulated sum.
        with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
            (torch.nn.functional.mse_loss(ddp(x), y) / k).backward()
    opt.step()


# [end: solution]


def no_scale(ddp, opt, micro_batches):
    import contextlib

    opt.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            torch.nn.functional.mse_loss(ddp(x), y).backward()  # k times too big
    opt.step()


def no_no_sync(ddp, opt, micro_batches):
    opt.zero_grad()
    for x, y in micro_batches:  # right update, but an all-reduce per micro-batch
        (torch.nn.functional.mse_loss(ddp(x), y) / len(micro_batches)).backward()
    opt.step()


def all_in_no_sync(ddp, opt, micro_batches):
    opt.zero_grad()
    with ddp.no_sync():  # the gradients are never averaged
        for x, y in micro_batches:
            (torch.nn.functional.mse_loss(ddp(x), y) / len(micro_batches)).backward()
    opt.step()


def main():
    run_checker(
        __doc__,
        verdict,
        accumulate_step,
        wrong=[no_scale, no_no_sync, all_in_no_sync],
        passed="matches one process, with one all-reduce per step",
    )


if __name__ == "__main__":
    main()
