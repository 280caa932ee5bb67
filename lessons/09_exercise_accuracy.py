"""torchrun --nproc_per_node=3 lessons/09_exercise_accuracy.py

Checker for the chapter 9 exercise: the accuracy over a dataset evaluated on many ranks, every item once.

Options: --solution FILE checks your answer, the function named by --function NAME (default: global_accuracy)
in FILE.

A solution is a function `global_accuracy(indices, correct)`: `indices` holds the dataset indices this
rank evaluated (an int64 tensor, possibly empty; across ranks an index may appear twice, as
DistributedSampler's padding does), `correct` a 0/1 int64 tensor of the same length. It must return,
on every rank, the fraction of distinct items answered correctly: what one process computes over the
dataset. Every rank checks it (to 1e-12) on padded DistributedSampler shares (101, 10 and 2 items,
shuffled) and on unpadded uneven shares (101 and 2 items: with 3 or more ranks some rank has none).
The ranks agree on the verdict before anyone reports it.

Without --solution the checker tests itself: the reference solution (the `solution` region, which the
chapter shows) must pass, and four classic wrong answers must fail wherever there is more than one rank:
keeping the padding duplicates, the mean of per-rank means, removing duplicates on each rank only, and
this rank's accuracy alone.
"""

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from lessonlib.exercises import run_checker

TOL = 1e-12


def answers(n, classes=4, seed=0):
    """1 where the chapter's fixed random classifier is right on item i, else 0."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (n,), generator=g)
    logits = torch.randn(n, classes, generator=g, dtype=torch.float64)
    logits[torch.arange(n), labels] += 1.0
    return (logits.argmax(1) == labels).long()


def cases(ctx):
    """(description, this rank's indices) for every case; the truth is over range(n)."""
    for n in (101, 10, 2):
        sampler = DistributedSampler(range(n), shuffle=True, seed=n)
        yield n, f"DistributedSampler, {n} items", torch.tensor(list(sampler), dtype=torch.long)
    for n in (101, 2):
        yield n, f"unpadded shares indices[r::W], {n} items", torch.arange(n)[ctx.rank :: ctx.world_size]


def verdict(fn, ctx):
    """None if fn gives one process's accuracy on every case for this rank; else the first problem."""
    for n, name, idx in cases(ctx):
        correct = answers(n)
        truth = correct.sum().item() / n
        try:
            got = float(fn(idx.clone(), correct[idx].clone()))
        except Exception as e:  # a crash is a wrong answer too, with its message
            return f"{name}: global_accuracy raised {type(e).__name__}: {e}"
        if not abs(got - truth) <= TOL:  # `not <=` also catches nan
            return f"{name}: global_accuracy returned {got}, one process over the {n} items gives {truth}"
    return None


# [start: solution]
def global_accuracy(indices, correct):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(zip(indices.tolist(), correct.tolist())))
    # One entry per index: a padding duplicate carries the same answer as its original.
    unique = dict(pair for share in everyone for pair in share)
    return sum(unique.values()) / len(unique)


# [end: solution]


def keeps_duplicates(indices, correct):
    totals = torch.tensor([correct.sum().item(), len(correct)], dtype=torch.float64)
    dist.all_reduce(totals)  # the padding counts twice
    return (totals[0] / totals[1]).item()


def mean_of_means(indices, correct):
    rt = correct.double().mean()  # nan on an empty share
    dist.all_reduce(rt)
    return (rt / dist.get_world_size()).item()


def dedupes_locally(indices, correct):
    mine = dict(zip(indices.tolist(), correct.tolist()))  # a duplicate usually sits on another rank
    totals = torch.tensor([sum(mine.values()), len(mine)], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def local_only(indices, correct):
    return correct.double().mean().item()


def main():
    wrong = [keeps_duplicates, mean_of_means, dedupes_locally, local_only]  # one rank: no padding, nobody to weigh
    run_checker(
        __doc__, verdict, global_accuracy, wrong, right_alone=wrong, passed="gives one process's accuracy on every case"
    )


if __name__ == "__main__":
    main()
