"""torchrun --nproc_per_node=4 lessons/03_partitioner.py

A hand-written data partitioner, as the original PyTorch distributed tutorial has it, next to DistributedSampler.

That partitioner shuffles the indices once with a fixed seed, cuts them into W blocks of
int(n / W) samples, and gives block r to rank r; each rank's DataLoader then shuffles its block.
Run for real, that recipe has three faults, each measured and asserted here:
  1. int() rounds down, so n % W samples are never used, and always the same ones;
  2. the blocks are cut once: every epoch a rank sees the same samples, only reordered;
  3. its batch size, 128 / float(W), is a float, which DataLoader refuses.
A corrected partitioner reshuffles every epoch (seed + epoch) and pads to a multiple of W, which is
DistributedSampler's recipe with contiguous blocks in place of its stride.
"""

import argparse
import math
from random import Random

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lessonlib


# [start: note]
class DataPartitioner:
    """That tutorial's partitioner (its fractions made exact: sizes=[1/W] * W)."""

    def __init__(self, n, sizes, seed=1234):
        indices = list(range(n))
        Random(seed).shuffle(indices)  # once, at construction: the same cut every epoch
        self.partitions = []
        for frac in sizes:
            part_len = int(frac * n)  # rounds down: the remainder is never handed out
            self.partitions.append(indices[:part_len])
            indices = indices[part_len:]


# [end: note]


# [start: fixed]
def partition(n, rank, world_size, seed, epoch):
    """This rank's block of a fresh shuffle, padded so every rank gets ceil(n / W) samples."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    per_rank = math.ceil(n / world_size)
    order = (order * math.ceil(per_rank * world_size / n))[: per_rank * world_size]  # wrap to pad
    return order[rank * per_rank : (rank + 1) * per_rank]  # a contiguous block


# [end: fixed]


def gather(ctx, mine):
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--size", type=int, default=23, choices=range(1, 10001), metavar="1..10000")
    parser.add_argument("--epochs", type=int, default=3, choices=range(2, 11), metavar="2..10")
    args = parser.parse_args()
    ctx = lessonlib.setup()
    n, w = args.size, ctx.world_size

    note = DataPartitioner(n, [1 / w] * w)
    note_sets, sampler_sets = [], []
    for epoch in range(args.epochs):
        # The tutorial's rank shuffles its fixed block in its own DataLoader (shuffle=True).
        block = note.partitions[ctx.rank]
        seen = [i for b in DataLoader(block, batch_size=4, shuffle=True) for i in b.tolist()]
        note_sets.append(gather(ctx, sorted(seen)))
        sampler = DistributedSampler(range(n), shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        sampler_sets.append(gather(ctx, sorted(sampler)))
        fixed = gather(ctx, partition(n, ctx.rank, w, seed=0, epoch=epoch))
        used = [i for shard in fixed for i in shard]
        assert set(used) == set(range(n)) and len(used) - n == math.ceil(n / w) * w - n, fixed
        assert len({len(s) for s in fixed}) == 1, "the corrected partitioner must give equal shares"

    unused = sorted(set(range(n)) - {i for shard in note_sets[0] for i in shard})
    assert len(unused) >= n % w, f"expected at least n % W = {n % w} unused samples, got {unused}"
    assert all(sets == note_sets[0] for sets in note_sets), "the tutorial's blocks changed between epochs"
    moved = any(sets != sampler_sets[0] for sets in sampler_sets)
    if w > 1 and n >= 8:
        assert moved, "with set_epoch, DistributedSampler's shards should change between epochs"

    # [start: float_batch]
    bsz = 128 / float(w)  # the tutorial's per-rank batch size
    try:
        DataLoader(range(n), batch_size=bsz)
    except ValueError as e:
        error = str(e)
    # [end: float_batch]
    assert "batch_size should be a positive integer" in error, error
    lessonlib.report(
        "partitioner",
        {
            "unused": unused,
            "note_block": note_sets[0][ctx.rank],
            "sampler_sets": [s[ctx.rank] for s in sampler_sets],
            "float_batch_error": error,
        },
    )
    if ctx.is_main:
        print(
            f"tutorial's partitioner: {len(unused)} sample(s) never used {unused}; every epoch rank 0 sees "
            f"{note_sets[0][0]}"
        )
        print(f"DistributedSampler + set_epoch, rank 0, epoch by epoch: {[s[0][:6] for s in sampler_sets]}...")
        print(f"batch_size={bsz}: {error}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
