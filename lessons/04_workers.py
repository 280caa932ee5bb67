"""torchrun --nproc_per_node=2 lessons/04_workers.py

Which random draws repeat across DataLoader workers and across ranks, per source of randomness.

Options: --setups a,b,c (the default: all three).

Each sample draws one number from torch, from `random`, from numpy's global RNG, and from a numpy
Generator the dataset made in __init__ (`held`). Each rank reads its DistributedSampler shard with
two workers; all draws are gathered and counted. DataLoader seeds worker k with base_seed + k for
torch and `random`, and derives numpy's global seed from the same pair; base_seed is drawn at every
iter(loader) from the loader's generator, or else from the global torch RNG. Setups:
  a  same torch.manual_seed on every rank, no generator: workers differ, but worker k of every rank
     repeats worker k of the others; the held Generator was copied into each worker and repeats everywhere
  b  loader generator seeded seed + rank: no repeats across ranks, but the held Generator still repeats
  c  b, plus a worker_init_fn that reseeds the held Generator from the worker's seed: no repeats at all
Across-rank claims are asserted for world size > 1.
"""

import argparse
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, get_worker_info

import lessonlib

SOURCES = ["torch", "random", "numpy", "held"]
SETUPS = ["a", "b", "c"]
TOP = 2**62  # draws are integers this wide: a repeat is never a coincidence


# [start: dataset]
class Draws(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n
        self.rng = np.random.default_rng(0)  # copied as-is into every worker process

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {
            "index": i,
            "worker": get_worker_info().id,
            "torch": torch.randint(TOP, ()).item(),
            "random": random.getrandbits(62),
            "numpy": int(np.random.randint(TOP, dtype=np.int64)),
            "held": int(self.rng.integers(TOP)),
        }


# [end: dataset]


# [start: worker_init_fn]
def reseed_held(worker_id):
    info = get_worker_info()  # info.dataset is this worker's own copy; info.seed = base_seed + worker_id
    info.dataset.rng = np.random.default_rng(info.seed)


# [end: worker_init_fn]


def draws(setup, seed, ctx, per_rank, batch_size):
    torch.manual_seed(seed)  # the same on every rank, as a script that seeds "everything" does
    dataset = Draws(per_rank * ctx.world_size)
    sampler = DistributedSampler(dataset, ctx.world_size, ctx.rank, shuffle=False)
    # [start: loader]
    generator = torch.Generator().manual_seed(seed + ctx.rank) if setup in "bc" else None
    loader = DataLoader(
        dataset,
        batch_size,
        sampler=sampler,
        num_workers=2,
        generator=generator,
        worker_init_fn=reseed_held if setup == "c" else None,
        collate_fn=lambda batch: batch,
        timeout=20,
    )  # a stuck worker: an error, not a hang
    # [end: loader]
    return [sample for batch in loader for sample in batch]


def repeats(mine, everyone, rank, source):
    """Fractions of this rank's draws that another worker of this rank, or another rank, also drew."""
    within = sum(any(s[source] == t[source] and s["worker"] != t["worker"] for t in mine) for s in mine)
    elsewhere = {t[source] for k, theirs in enumerate(everyone) if k != rank for t in theirs}
    across = sum(s[source] in elsewhere for s in mine)
    return within / len(mine), across / len(mine)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--setups", type=lessonlib.comma_list(choices=SETUPS), default=",".join(SETUPS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-rank", type=int, default=8, choices=range(4, 65), metavar="4..64")
    parser.add_argument("--batch-size", type=int, default=2, choices=range(1, 9), metavar="1..8")
    args = parser.parse_args()
    if args.per_rank % (2 * args.batch_size):  # so both workers serve the same number of batches
        parser.error(f"--per-rank must be a multiple of 2 x --batch-size = {2 * args.batch_size}")
    ctx = lessonlib.setup()
    n, r = ctx.world_size, ctx.rank

    for setup in args.setups:
        mine = draws(setup, args.seed, ctx, args.per_rank, args.batch_size)
        everyone = [None] * n
        dist.all_gather_object(everyone, mine)
        assert len({s["worker"] for s in mine}) == 2, f"rank {r}: expected both workers to serve samples"
        table = {source: repeats(mine, everyone, r, source) for source in SOURCES}
        for source, (within, across) in table.items():
            where = f"rank {r}: setup {setup}, {source}"
            if setup == "c" or (setup == "b" and source != "held"):
                assert within == 0 and across == 0, f"{where}: draws repeat ({within:.0%} / {across:.0%})"
            else:  # a (all sources) and b (held): repeats where the seeds were copied
                assert within == (1.0 if source == "held" else 0.0), f"{where}: {within:.0%} repeat across workers"
                assert n == 1 or across == 1.0, f"{where}: only {across:.0%} repeat across ranks"
            lessonlib.report(
                "repeats",
                {
                    "setup": setup,
                    "source": source,
                    "across workers": within,
                    "across ranks": across if n > 1 else None,
                    "draws": len(mine),
                },
            )
        if ctx.is_main:
            cells = "  ".join(f"{s} {w:4.0%} {'  n/a' if n == 1 else f'{a:4.0%}'}" for s, (w, a) in table.items())
            print(f"setup {setup}: repeated across workers / across ranks:  {cells}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
