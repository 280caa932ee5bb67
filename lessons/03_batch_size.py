"""torchrun --nproc_per_node=4 lessons/03_batch_size.py

What `batch_size` means once there are W ranks, with a DistributedSampler and without one.

`batch_size` in the DataLoader is always per rank. One optimizer step consumes one batch on every
rank, so the global batch is W * batch_size.
  With a DistributedSampler, each rank walks its own ceil(n/W) samples: one epoch is one pass over
  the data in ceil(n/W)/batch_size steps. To keep the global batch B you used on one process, give
  each rank B/W.
  Without one, every rank walks the whole dataset: an epoch is W passes. If the ranks seeded their
  shuffles alike, every rank draws the very same batches, so the averaged gradient is the gradient
  of one batch and W-1 ranks compute for nothing. Seeded apart, they draw overlapping batches.
The lesson counts, per step, how many distinct samples the W ranks processed together.
"""

import argparse
import math

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lessonlib


def loaders(n, batch_size, ctx, seed):
    """The three ways to build the training DataLoader on each rank."""
    data = range(n)
    # [start: loaders]
    with_sampler = DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, shuffle=True, seed=seed))
    # No sampler, shuffle seeded alike on every rank (torch.manual_seed(seed) everywhere):
    same_seed = DataLoader(data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    # No sampler, shuffle seeded per rank:
    rank_seed = DataLoader(
        data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed + ctx.rank)
    )
    # [end: loaders]
    return {
        "DistributedSampler": with_sampler,
        "no sampler, same seed": same_seed,
        "no sampler, seed + rank": rank_seed,
    }


def measure(loader, ctx):
    """Per step: the batch of every rank; then counts over the epoch."""
    mine = [batch.tolist() for batch in loader]
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    steps = len(mine)
    assert all(len(b) == steps for b in everyone), "ranks took different numbers of steps"
    global_batches = [[i for rank in everyone for i in rank[s]] for s in range(steps)]
    visits = [i for batch in global_batches for i in batch]
    return {
        "per-rank batch": len(mine[0]),
        "steps per epoch": steps,
        "global batch": len(global_batches[0]),
        "sample visits per epoch": len(visits),
        "distinct samples per epoch": len(set(visits)),
        "distinct fraction of a global batch": sum(len(set(b)) for b in global_batches) / len(visits),
        "identical on every rank": all(rank == everyone[0] for rank in everyone),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--size", type=int, default=48, choices=range(1, 10001), metavar="1..10000")
    parser.add_argument("--batch-size", type=int, default=4, choices=range(1, 1001), metavar="1..1000")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ctx = lessonlib.setup()
    n, b, w = args.size, args.batch_size, ctx.world_size

    results = {}
    for name, loader in loaders(n, b, ctx, args.seed).items():
        results[name] = measure(loader, ctx)
        lessonlib.report("batch_size", {"loader": name, **results[name]})

    shard = math.ceil(n / w)
    s = results["DistributedSampler"]
    assert s["steps per epoch"] == math.ceil(shard / b), s
    assert s["sample visits per epoch"] == shard * w and s["distinct samples per epoch"] == n, s
    same = results["no sampler, same seed"]
    assert same["steps per epoch"] == math.ceil(n / b) and same["sample visits per epoch"] == w * n, same
    assert same["identical on every rank"], "same seed, no sampler: the ranks' batches should be identical"
    # Each global batch holds one batch W times over (the last batch of an epoch may be shorter).
    assert math.isclose(same["distinct fraction of a global batch"], 1 / w), same
    apart = results["no sampler, seed + rank"]
    assert apart["sample visits per epoch"] == w * n, apart
    if w > 1 and n >= 8:
        assert not apart["identical on every rank"], "seeded apart, the ranks' orders should differ"
    if ctx.is_main:
        for name, r in results.items():
            print(
                f"{name:>24}: {r['steps per epoch']} steps of {w} x {r['per-rank batch']}; "
                f"{r['sample visits per epoch']} visits, {r['distinct samples per epoch']} distinct samples, "
                f"{r['distinct fraction of a global batch']:.0%} of a global batch distinct"
            )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
