"""torchrun --nproc_per_node=3 lessons/03_exercise_shard.py

Checker for the chapter 3 exercise: compute DistributedSampler's indices without it.

Options: --solution FILE checks your answer, the function named by --function NAME (default: shard) in FILE.

A solution is a function `shard(n, rank, world_size, seed, epoch, shuffle, drop_last)` returning the
list of indices that DistributedSampler(range(n), world_size, rank, shuffle, seed, drop_last), moved
to `epoch` by set_epoch, yields. Every rank checks its own rank's answer on many cases, including
fewer samples than ranks, sizes that divide evenly and sizes that do not, both shuffle settings and
both drop_last settings. The ranks agree on the verdict before anyone reports it.

Without --solution the checker tests itself: the reference solution (the `solution` region, which the
chapter shows) must pass, and two plausible wrong answers must fail: contiguous blocks instead of a
stride, and a stride without the padding (at world size 1 both are right).
"""

import torch
from torch.utils.data import DistributedSampler

from lessonlib.exercises import run_checker


def sampler_shard(n, rank, world_size, seed, epoch, shuffle, drop_last):
    sampler = DistributedSampler(range(n), world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def cases(world_size):
    sizes = sorted({1, 2, max(1, world_size - 1), world_size, world_size + 1, 2 * world_size + 1, 13, 50})
    for n in sizes:
        for shuffle in (True, False):
            for drop_last in (False, True):
                for seed, epoch in ((0, 0), (0, 1), (7, 3)):
                    yield n, seed, epoch, shuffle, drop_last


def verdict(fn, ctx):
    """None if fn matches DistributedSampler on every case for this rank, else the first difference."""
    for n, seed, epoch, shuffle, drop_last in cases(ctx.world_size):
        args = dict(
            n=n, rank=ctx.rank, world_size=ctx.world_size, seed=seed, epoch=epoch, shuffle=shuffle, drop_last=drop_last
        )
        want = sampler_shard(**args)
        try:
            got = fn(**args)
            got = [int(i) for i in got]
        except Exception as e:  # a crash is a wrong answer too, with its message
            return f"shard({args}) raised {type(e).__name__}: {e}"
        if got != want:
            return f"shard({args}) returned {got}, DistributedSampler gives {want}"
    return None


# [start: solution]
def shard(n, rank, world_size, seed, epoch, shuffle, drop_last):
    import math  # self-contained: a solution is sent to the checker alone

    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(n))
    per_rank = n // world_size if drop_last else math.ceil(n / world_size)
    total = per_rank * world_size
    order = (order * math.ceil(total / n))[:total]  # pad by wrapping around, or cut the tail
    return order[rank::world_size]  # a stride, not a block


# [end: solution]


def blocks(n, rank, world_size, seed, epoch, shuffle, drop_last):
    """Wrong: contiguous blocks of the (padded) order instead of every W-th index."""
    import math  # self-contained: the notebook sends this function alone to the checker

    order = (
        torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist() if shuffle else list(range(n))
    )
    per_rank = n // world_size if drop_last else math.ceil(n / world_size)
    order = (order * world_size)[: per_rank * world_size]
    return order[rank * per_rank : (rank + 1) * per_rank]


def no_padding(n, rank, world_size, seed, epoch, shuffle, drop_last):
    """Wrong: the right stride, but no padding (or dropping), so shard lengths differ."""
    order = (
        torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist() if shuffle else list(range(n))
    )
    return order[rank::world_size]


def main():
    wrong = [blocks, no_padding]  # one rank: blocks, strides and padding all coincide, so both are right
    run_checker(__doc__, verdict, shard, wrong, right_alone=wrong, passed="matches DistributedSampler on every case")


if __name__ == "__main__":
    main()
