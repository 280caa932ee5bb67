"""torchrun --nproc_per_node=3 lessons/11_exercise_metrics.py

Checker for the chapter 11 exercise: an epoch's metrics from every rank's sums and counts.

Options: --solution FILE checks your answer, the function named by --function NAME (default: epoch_metrics) in
FILE.

A solution is a function `epoch_metrics(loss_sum, correct, count)`: this rank's sum of per-sample
losses, number of correct predictions and number of samples (Python numbers). It must return
(mean loss, accuracy) over ALL ranks' samples, the same on every rank, the way 11_torchrun.py's
reduce_sums and the two divisions after it do. Each rank checks two cases against the exact answer
(to a relative 1e-12), which every rank can compute alone since it knows what every rank holds:
  uneven   rank r holds 5 + 7r samples: a mean of the ranks' means weighs a sample on a small shard
           more than one on a big shard, and is wrong
  large    rank r holds 2**24 + 1 + 2r samples, counts no float32 can hold exactly (a torch.tensor
           made from Python numbers is float32 unless told otherwise)
The ranks agree on the verdict before anyone reports it.

Without --solution the checker tests itself: the reference solution (the `solution` region, which the
chapter shows) must pass, and four wrong ones must fail: the mean of means (the widely copied
reduce_mean), float32 totals, no reduction at all, and dist.reduce to rank 0 (on the other ranks the
buffer is not the totals, chapter 9). At world size 1 the mean of means, no reduction and reduce-to-0
are right, so only float32 can be rejected there.
"""

import torch
import torch.distributed as dist

from lessonlib.exercises import run_checker

REL_TOL = 1e-12


def holdings(case, rank):
    """(loss_sum, correct, count) that `rank` holds in `case`: known to every rank without communication."""
    count = 5 + 7 * rank if case == "uneven" else 2**24 + 1 + 2 * rank
    correct = count - 1 - rank if case == "large" else (rank + 1) * 2
    return 0.25 * count + 0.5 * rank, correct, count


def expected(case, world_size):
    sums = [sum(vals) for vals in zip(*(holdings(case, r) for r in range(world_size)))]
    return sums[0] / sums[2], sums[1] / sums[2]


def verdict(fn, ctx):
    """None if fn gives the exact metrics on this rank in every case; else the first thing that went wrong.

    Every case runs on every rank, even after a failure: fn's collectives must pair up across ranks.
    """
    rank, world_size, problems = ctx.rank, ctx.world_size, []
    for case in ("uneven", "large"):
        try:
            got = [float(v) for v in fn(*holdings(case, rank))]
        except Exception as e:  # a crash is a wrong answer too, with its message
            problems.append(f"{case}: epoch_metrics raised {type(e).__name__}: {e}")
            continue
        for name, g, w in zip(("mean loss", "accuracy"), got, expected(case, world_size)):
            if abs(g - w) > REL_TOL * abs(w):
                problems.append(f"{case}: got {name} {g!r}, expected {w!r} (relative error {abs(g - w) / abs(w):.1e})")
    return problems[0] if problems else None


# [start: solution]
def epoch_metrics(loss_sum, correct, count):
    totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64)  # float64: counts stay exact
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every rank calls it, every rank gets the sums
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


# [end: solution]


# [start: wrong]
def mean_of_means(loss_sum, correct, count):
    means = torch.tensor([loss_sum / count, correct / count], dtype=torch.float64)
    dist.all_reduce(means)
    return (means / dist.get_world_size()).tolist()  # every rank weighs the same, whatever it holds


def float32_totals(loss_sum, correct, count):
    totals = torch.tensor([loss_sum, correct, count])  # float32: 2**24 + 1 is 2**24
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def no_reduce(loss_sum, correct, count):
    return loss_sum / count, correct / count  # this rank's shard only


def reduce_to_rank0(loss_sum, correct, count):
    totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64)
    dist.reduce(totals, dst=0)  # only rank 0 holds the sums afterwards; elsewhere the buffer is not them
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


# [end: wrong]


def main():
    run_checker(
        __doc__,
        verdict,
        epoch_metrics,
        wrong=[float32_totals, mean_of_means, no_reduce, reduce_to_rank0],
        right_alone=[mean_of_means, no_reduce, reduce_to_rank0],  # right when one rank holds everything
        passed="gives the exact mean loss and accuracy of all ranks",
    )


if __name__ == "__main__":
    main()
