"""torchrun --nproc_per_node=3 lessons/03_sampler_indices.py

Which samples DistributedSampler gives each rank, epoch by epoch, checked against its recipe.

Options: --size 13, --epochs 2, --seed 0 (the defaults); --no-shuffle and/or --drop-last run only that
sampler setting, for every epoch (default: shuffle=False, then each epoch shuffled, then drop_last=True).

The recipe, for a dataset of n samples and W ranks:
  1. shuffle: torch.randperm(n) from a generator seeded with seed + epoch (identity if shuffle=False);
  2. make the length a multiple of W: wrap around and repeat the first indices (padding),
     or with drop_last=True cut the tail off instead;
  3. rank r takes every W-th index starting at r: indices[r::W]. Strided, not a contiguous block.
Every rank computes its share alone from (n, W, seed, epoch): no messages are needed. The lesson
gathers all shares, rebuilds the padded list from them, and asserts each step of the recipe and the
coverage: every sample exactly once per epoch, plus exactly the counted padding duplicates.
"""

import argparse
import math
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import lessonlib


# [start: shard]
def my_shard(n, ctx, seed, epoch, shuffle=True, drop_last=False):
    """This rank's indices for one epoch, straight from DistributedSampler."""
    sampler = DistributedSampler(
        range(n), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    sampler.set_epoch(epoch)  # forgetting this repeats epoch 0's order: lessons/03_set_epoch.py
    return list(sampler)


# [end: shard]


def check(shards, n, seed, epoch, shuffle, drop_last):
    """Assert the recipe on everyone's shards; returns the padded list and the padding count."""
    w = len(shards)
    lengths = {len(s) for s in shards}
    assert len(lengths) == 1, f"n={n}: ranks got different lengths {[len(s) for s in shards]}"
    per_rank = lengths.pop()
    total = per_rank * w
    joined = [shards[pos % w][pos // w] for pos in range(total)]  # undo indices[r::W]
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(n))
    if drop_last:
        assert total == n // w * w, f"n={n}, W={w}: drop_last kept {total}, expected {n // w * w}"
        assert joined == order[:total], f"n={n}: drop_last should keep the first {total} of the order"
        counts = Counter(joined)
        assert max(counts.values(), default=1) == 1, f"n={n}: a sample appears twice under drop_last"
        return joined, 0
    assert total == math.ceil(n / w) * w, f"n={n}, W={w}: {total} indices, expected ceil(n/W)*W"
    wrapped = (order * math.ceil(total / n))[:total]  # repeat the order from its start as needed
    assert joined == wrapped, f"n={n}, epoch {epoch}: padded list {joined} != {wrapped}"
    counts = Counter(joined)
    assert set(counts) == set(range(n)), f"n={n}: samples never seen: {set(range(n)) - set(counts)}"
    padding = sum(c - 1 for c in counts.values())
    assert padding == total - n, f"n={n}: {padding} duplicates, expected {total - n}"
    return joined, padding


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--size", type=int, default=13, help="samples in the dataset (default 13: divisible by none of 2, 3, 4)"
    )
    parser.add_argument("--epochs", type=int, default=2, choices=range(1, 11), metavar="1..10")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-shuffle",
        action="store_true",
        help="run only shuffle=False, every epoch (without "
        "either flag, the tour: shuffle=False, the shuffled epochs, drop_last=True)",
    )
    parser.add_argument(
        "--drop-last",
        action="store_true",
        help="run only drop_last=True, every epoch (with --no-shuffle: unshuffled and cut)",
    )
    args = parser.parse_args()
    if args.size < 1:
        parser.error(f"--size must be at least 1, got {args.size}")
    ctx = lessonlib.setup()
    w = ctx.world_size

    restricted = args.no_shuffle or args.drop_last
    setting = ", ".join(
        name for name, on in [("shuffle=False", args.no_shuffle), ("drop_last=True", args.drop_last)] if on
    )
    if restricted:  # one setting, every epoch: what changes from one epoch to the next?
        cases = [(f"{setting}, epoch {e}", not args.no_shuffle, args.drop_last, e) for e in range(args.epochs)]
    else:  # the tour: unshuffled, then shuffled epochs, then drop_last
        cases = [("shuffle=False", False, False, 0)]
        cases += [(f"epoch {e}", True, False, e) for e in range(args.epochs)]
        cases += [("drop_last=True", True, True, 0)]
    orders, joins = [], []
    for name, shuffle, drop_last, epoch in cases:
        mine = my_shard(args.size, ctx, args.seed, epoch, shuffle, drop_last)
        shards = [None] * w
        dist.all_gather_object(shards, mine)
        joined, padding = check(shards, args.size, args.seed, epoch, shuffle, drop_last)
        if shuffle and not drop_last:
            orders.append(joined)
        joins.append(joined)
        # A position in the padded list at or beyond n holds a padding duplicate.
        is_padding = [j * w + ctx.rank >= args.size for j in range(len(mine))]
        lessonlib.report(
            "shard",
            {
                "case": name,
                "indices": mine,
                "padding": is_padding,
                "dropped": sorted(set(range(args.size)) - set(joined)) if drop_last else [],
            },
        )
        print(f"rank {ctx.rank} {name:>14}: {mine}" + (f"  ({sum(is_padding)} padding)" if any(is_padding) else ""))

    # A new epoch must bring a new order (set_epoch at work); with 8+ samples a repeat means a bug.
    if args.size >= 8 and len(orders) > 1:
        assert all(a != b for a, b in zip(orders, orders[1:])), "two consecutive epochs have the same order"
    if args.no_shuffle:  # set_epoch changes nothing without shuffling
        assert all(j == joins[0] for j in joins), "shuffle=False, yet the order changed from one epoch to another"
    never_seen = sorted(set(range(args.size)).difference(*joins))
    if args.no_shuffle and args.drop_last:  # the same tail is cut every epoch: those samples are never used
        assert never_seen == list(range(args.size // w * w, args.size)), f"never seen: {never_seen}"

    # The edge cases the picture does not show: fewer samples than ranks (padding wraps more than
    # once), exactly W, and W + 1. Checked with the same recipe, not printed.
    for n in sorted({1, 2, w, w + 1, 2 * w + 1}):
        for drop_last in (False, True):
            mine = my_shard(n, ctx, args.seed, 0, True, drop_last)
            shards = [None] * w
            dist.all_gather_object(shards, mine)
            check(shards, n, args.seed, 0, True, drop_last)
    if ctx.is_main and restricted:
        per_rank = args.size // w if args.drop_last else math.ceil(args.size / w)
        pad, cut = (0, args.size - per_rank * w) if args.drop_last else (per_rank * w - args.size, 0)
        print(
            f"n={args.size}, W={w}, {setting}: {per_rank} indices per rank, {pad} padding duplicate(s), "
            f"{cut} sample(s) skipped per epoch; never seen in {args.epochs} epoch(s): {never_seen}"
        )
    elif ctx.is_main:
        pad = math.ceil(args.size / w) * w - args.size
        print(
            f"n={args.size}, W={w}: {math.ceil(args.size / w)} indices per rank, {pad} padding "
            f"duplicate(s) per epoch; recipe and coverage checked for n in 1, 2, W, W+1, 2W+1 too"
        )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
