"""torchrun --nproc_per_node=3 lessons/04_exercise_loader.py

Checker for the chapter 4 exercise: a DataLoader whose random draws never repeat, yet repeat on demand.

Options: --solution FILE checks your answer, the function named by --function NAME (default: make_loader) in
FILE.

A solution is `make_loader(dataset, batch_size, seed, rank, world_size) -> DataLoader`. The dataset is
like lesson 04_workers.py's: each sample draws from torch, `random`, numpy's global RNG and a numpy
Generator the dataset holds as `dataset.rng`. Every rank first seeds all three global RNGs with the
same seed, as training scripts do. Checked on every rank, for two epochs (loader.sampler.set_epoch):
  1. the ranks' loaders together deliver every sample once per epoch (padding aside), from two or
     more worker processes, in an order that changes from one epoch to the next;
  2. no draw repeats, from any of the four sources, across workers, ranks or epochs;
  3. a second loader built with the same arguments, after the global RNGs have moved on, delivers
     exactly the same draws.
The ranks agree on the verdict before anyone reports it. Without --solution the checker tests
itself: the reference solution (the `solution` region, which the chapter shows) must pass, and
DistributedSampler + two workers without a generator or a worker_init_fn must fail (at every world
size: with one rank its held Generator still repeats). Loaders and draws stay on the CPU.
"""

import collections
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import get_worker_info

from lessonlib.exercises import run_checker

SEED, SAMPLES, BATCH = 0, 24, 2
SOURCES = ["torch", "random", "numpy", "held"]


class Draws(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n, self.rng = n, np.random.default_rng(0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return {
            "index": i,
            "worker": -1 if info is None else info.id,
            "torch": torch.randint(2**62, ()).item(),
            "random": random.getrandbits(62),
            "numpy": int(np.random.randint(2**62, dtype=np.int64)),
            "held": int(self.rng.integers(2**62)),
        }


def epochs(fn, ctx, which):
    """Build a loader with fn; per epoch in `which`, its samples as dicts, in delivery order."""
    loader = fn(Draws(SAMPLES), BATCH, SEED, ctx.rank, ctx.world_size)
    if not hasattr(loader.sampler, "set_epoch"):
        raise TypeError(
            f"loader.sampler is a {type(loader.sampler).__name__}, without set_epoch: use a DistributedSampler"
        )
    out = []
    for e in which:
        loader.sampler.set_epoch(e)
        out.append([dict(zip(b, v)) for b in loader for v in zip(*(b[k].tolist() for k in b))])
    return loader, out


def run_loaders(fn, ctx):
    """(this rank's problem or None, [epoch 0 samples, epoch 1 samples], epoch 0 of a second loader)."""
    for seed_one in (torch.manual_seed, random.seed, np.random.seed):
        seed_one(SEED)  # the same on every rank, as in a training script
    try:
        loader, (e0, e1) = epochs(fn, ctx, [0, 1])
        torch.rand(1)  # training moves the global RNGs on before anyone builds a loader again
        random.random()
        np.random.rand()
        _, (again,) = epochs(fn, ctx, [0])
    except Exception as e:  # a crash is a wrong answer too, with its message
        return f"make_loader or its loader raised {type(e).__name__}: {e}", None, None
    workers = {s["worker"] for s in e0 + e1}
    if loader.num_workers < 2 or len(workers) < 2:
        return f"num_workers={loader.num_workers}, worker ids seen {sorted(workers)}: use two workers", None, None
    if [s["index"] for s in e0] == [s["index"] for s in e1]:
        return "epochs 0 and 1 came in the same order: shuffle, and let set_epoch reach the sampler", None, None
    return None, [e0, e1], again


def first_repeat(everyone):
    """A description of the first draw that appears twice anywhere, or None."""
    for source in SOURCES:
        seen = {}
        for k, per_epoch in enumerate(everyone):
            for e, samples in enumerate(per_epoch):
                for s in samples:
                    here = f"rank {k} worker {s['worker']} epoch {e}"
                    if s[source] in seen:
                        return f"the `{source}` draw of {seen[s[source]]} repeats on {here}"
                    seen[s[source]] = here
    return None


def verdict(fn, ctx):
    """None if fn's loaders pass every check, else the first problem this rank saw."""
    problem, mine, again = run_loaders(fn, ctx)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)  # every rank calls this, whatever it found
    if problem or any(x is None for x in everyone):
        return problem or "another rank's loader failed"
    padded = -(-SAMPLES // ctx.world_size) * ctx.world_size  # DistributedSampler pads to a multiple
    for e in (0, 1):
        counts = collections.Counter(s["index"] for per_epoch in everyone for s in per_epoch[e])
        if set(counts) != set(range(SAMPLES)) or sum(counts.values()) != padded:
            return f"epoch {e}: the ranks delivered {dict(sorted(counts.items()))}, not 0..{SAMPLES - 1} once each"
    repeat = first_repeat(everyone)
    if repeat:
        return repeat
    if again != mine[0]:
        return "a second loader built with the same arguments drew other numbers: give it a seeded generator"
    return None


# [start: solution]
def make_loader(dataset, batch_size, seed, rank, world_size):
    import numpy as np  # self-contained: a solution is sent to the checker alone
    from torch.utils.data import DataLoader, DistributedSampler, get_worker_info

    def reseed_held(worker_id):  # the dataset's own Generator was copied into this worker as it was
        info = get_worker_info()
        info.dataset.rng = np.random.default_rng(info.seed)

    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed)
    return DataLoader(
        dataset,
        batch_size,
        sampler=sampler,
        num_workers=2,
        worker_init_fn=reseed_held,
        generator=torch.Generator().manual_seed(seed + rank),
    )  # per rank, and reproducible


# [end: solution]


def shared_seeds_make_loader(dataset, batch_size, seed, rank, world_size):
    """Wrong: worker k of every rank gets the same seeds, and the held Generator is copied as it is."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size, sampler=sampler, num_workers=2)


def main():
    run_checker(
        __doc__,
        verdict,
        make_loader,
        wrong=[shared_seeds_make_loader],
        timeout=30,
        passed="delivers every sample, every draw unique, reproducible",
    )


if __name__ == "__main__":
    main()
