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

Every run also tests the checker itself: the reference answer must pass, and four classic wrong answers
must fail wherever there is more than one rank: keeping the padding duplicates, the mean of per-rank
means, removing duplicates on each rank only, and this rank's accuracy alone.
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import lessonlib
from lessonlib.exercises import load_function

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
        yield n, f"unpadded shares indices[r::W], {n} items", torch.arange(n)[ctx.rank::ctx.world_size]


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


def agreed(ctx, problem):
    """True on every rank iff no rank saw a problem (so all ranks reach the same verdict)."""
    ok = torch.tensor([0 if problem else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def global_accuracy(indices, correct):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(zip(indices.tolist(), correct.tolist())))
    unique = dict(pair for share in everyone for pair in share)  # a duplicate has the same answer
    return sum(unique.values()) / len(unique)


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--solution", help="Python file defining the solution")
    parser.add_argument("--function", default="global_accuracy", help="its name")
    args = parser.parse_args()
    fn = load_function(args.solution, args.function) if args.solution else None
    ctx = lessonlib.setup(device="cpu", timeout=20)  # a wrong answer may leave ranks waiting: 20 s, not 30

    if fn is not None:
        problem = verdict(fn, ctx)
        assert agreed(ctx, problem), f"rank {ctx.rank}: {problem or 'another rank saw a problem'}"
        print(f"rank {ctx.rank}: {args.function} gives one process's accuracy on {len(list(cases(ctx)))} cases")
    assert agreed(ctx, verdict(global_accuracy, ctx)), "the checker rejects the reference answer"
    wrong = (keeps_duplicates, mean_of_means, dedupes_locally, local_only)
    rejected = {f.__name__: not agreed(ctx, verdict(f, ctx)) for f in wrong}
    if ctx.world_size > 1:
        assert all(rejected.values()), f"the checker accepted a wrong answer: {rejected}"
        print(f"rank {ctx.rank}: checker self-test: accepts global_accuracy, rejects {sorted(rejected)}")
    else:  # one rank: no padding and nobody to weigh against, so the wrong answers are right here
        print("world size 1: the wrong answers are right here, so only the accepting half is tested")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
