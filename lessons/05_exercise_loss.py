"""torchrun --nproc_per_node=3 lessons/05_exercise_loss.py

Checker for the chapter 5 exercise: the loss that keeps DDP exact when ranks hold unequal batches.

Options: --solution FILE checks your answer, the function named by --function NAME (default: ddp_loss) in
FILE.

A solution is a function `ddp_loss(pred, target)` returning the scalar that this rank calls
backward() on, under DistributedDataParallel, when the ranks hold different numbers of rows. It must
make the gradient every rank ends up with equal the gradient of one process on all the rows with a
mean squared error. It may call collectives (every rank calls it once per case). Each rank compares
its DDP gradient with that reference on several cases, including a rank with a single row; the
ranks agree on the verdict before anyone reports it.

Without --solution the checker tests itself: the reference solution (the `solution` region, which the
chapter shows) must pass, and two plausible wrong answers must fail (at world size 1 both are right):
the plain per-rank mean, and the summed loss divided by the global row count (which forgets that DDP
divides by the world size once more).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lessonlib.exercises import run_checker
from lessonlib.training import flat_grads, global_batch, mlp, my_rows

TOL = 1e-10


def cases(world_size):
    yield [4] * world_size  # equal rows: the plain mean is right here
    yield [2 + 3 * r for r in range(world_size)]
    yield [1 + (r % 2) * 6 for r in range(world_size)]  # a rank with a single row


def verdict(fn, ctx):
    """None if fn gives the all-rows gradient on every case for this rank, else the first difference."""
    for i, sizes in enumerate(cases(ctx.world_size)):
        x, y = global_batch(i, sum(sizes))
        reference = mlp(seed=i)
        F.mse_loss(reference(x), y).backward()
        model = DDP(mlp(seed=i))
        mine = my_rows(sizes, ctx.rank)
        try:
            fn(model(x[mine]), y[mine]).backward()
        except Exception as e:  # a crash is a wrong answer too, with its message
            return f"rows per rank {sizes}: ddp_loss raised {type(e).__name__}: {e}"
        got, want = flat_grads(model.module), flat_grads(reference)
        gap = (got - want).abs().max().item()
        if gap > TOL:
            ratio = (got @ want / (want @ want)).item()
            return (
                f"rows per rank {sizes}: the gradient is {gap:.2e} from one process on all rows "
                f"(about {ratio:.3f} x the right one)"
            )
    return None


# [start: solution]
def ddp_loss(pred, target):
    rows = torch.tensor([float(pred.shape[0])], dtype=pred.dtype)
    dist.all_reduce(rows)  # rows on all ranks together
    # DDP divides by the world size; multiplying by it leaves (sum over all rows) / (all rows).
    return torch.nn.functional.mse_loss(pred, target, reduction="sum") * dist.get_world_size() / rows


# [end: solution]


def per_rank_mean(pred, target):
    """Wrong: every rank's mean counts the same, whatever its number of rows."""
    return torch.nn.functional.mse_loss(pred, target)


def sum_over_all_rows(pred, target):
    """Wrong: right for an all_reduce SUM, but DDP averages, so this is N times too small."""
    rows = torch.tensor([float(pred.shape[0])], dtype=pred.dtype)
    dist.all_reduce(rows)
    return torch.nn.functional.mse_loss(pred, target, reduction="sum") / rows


def main():
    wrong = [per_rank_mean, sum_over_all_rows]  # one rank holds all rows: both are right there
    run_checker(
        __doc__, verdict, ddp_loss, wrong, right_alone=wrong, passed="gives the all-rows gradient on every case"
    )


if __name__ == "__main__":
    main()
