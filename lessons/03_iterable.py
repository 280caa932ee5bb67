"""torchrun --nproc_per_node=2 lessons/03_iterable.py

A stream under DDP: an IterableDataset sharded by rank and worker; uneven ends, shuffling, resuming.

Options: --size N (default 65 samples), --batch-size B (default 2), --stop C (default 3: batches taken
before the restart).

The stream yields sample ids 0..N-1 in order, as lines read from a file would come. Every rank reads it
through a DataLoader with 2 workers (prefetch_factor 2, workers forked afresh for each pass), and the ranks
gather what they took. Asserted on every rank:
  copied: not sharded, every sample reaches the training loops world_size x 2 times.
  sharded: stream position i goes to shard i % (world_size x 2), shard = rank x 2 + worker: every sample
    exactly once. The loader takes batches from its workers in turn, worker 0, 1, 0, 1, ..., until one is
    out (the order computed from N alone).
  uneven: each rank's number of batches is what the rule gives. A tiny DDP model trains on them three ways,
    every rank making the same number of steps: drop (an all_reduce MIN per step: every rank stops with the
    shortest; the samples left out are counted), pad (MAX: a rank out of data takes its own batches again;
    the duplicates are counted), Join (every sample once; a comm hook counts the gradient all-reduces: every
    rank makes as many as the longest rank has batches, those of a joined rank with zeros).
  shuffle: a shuffle buffer before sharding, seeded per shard: samples seen twice and samples never seen
    (both counted, both > 0). Sharding first, then a buffer seeded per shard and epoch, or one seed for
    every shard before sharding: every sample once, in a new order in epoch 1; only the second moves
    samples to other shards from one epoch to the next.
  resume: C batches taken, then a new loader from a saved position. Nothing saved: the C batches come again.
    The loop's count of batches, split back over the workers in turn: exactly the rest of the epoch, in the
    uninterrupted order when C is a multiple of 2. The workers' own counters: they ran prefetch_factor x 2
    batches ahead of the loop, and the restart skips those.
"""

import argparse
import itertools
import math
import mmap
import random
import time
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import lessonlib

WORKERS, PREFETCH, BUFFER = 2, 2, 8  # DataLoader workers per rank, its prefetch_factor, shuffle buffer size


# [start: buffer]
def shuffled(ids, seed):
    """A shuffle buffer: hold BUFFER items, let out a random one as each new one comes in."""
    rng, held = random.Random(seed), []
    for i in ids:
        held.append(i)
        if len(held) == BUFFER:
            yield held.pop(rng.randrange(BUFFER))
    rng.shuffle(held)
    yield from held


# [end: buffer]


# [start: stream]
class Stream(IterableDataset):
    """Sample ids 0..n-1, read in order. Every DataLoader worker runs __iter__ on its own copy."""

    def __init__(self, n, rank, world_size, shard=True, shuffle=None, epoch=0, skip=(0,) * WORKERS, made=None):
        self.n, self.rank, self.world_size, self.shard, self.shuffle = n, rank, world_size, shard, shuffle
        self.epoch, self.skip, self.made = epoch, skip, made

    def __iter__(self):
        worker = get_worker_info().id  # 0 or 1 here; get_worker_info() is None without workers
        shards, me = self.world_size * WORKERS, self.rank * WORKERS + worker
        ids = iter(range(self.n))  # every worker of every rank reads the whole stream...
        if self.shuffle == "before, seed per shard":  # the mistake: each shard filters another order
            ids = shuffled(ids, seed=1000 * self.epoch + me)
        if self.shuffle == "before, same seed":
            ids = shuffled(ids, seed=1000 * self.epoch)
        if self.shard:  # ...and keeps every (world_size x workers)-th item
            ids = (i for position, i in enumerate(ids) if position % shards == me)
        if self.shuffle == "after, seed per shard":
            ids = shuffled(ids, seed=1000 * self.epoch + me)
        for i in itertools.islice(ids, self.skip[worker], None):  # a restart skips what was consumed
            if self.made is not None:
                self.made[worker] += 1  # counted in the worker, in memory shared with the rank
            yield {"id": i, "worker": worker}


# [end: stream]


def loader(dataset, batch_size):
    # fork: the workers' counters live in memory the rank shares with them (Python 3.14 defaults otherwise)
    return DataLoader(
        dataset, batch_size, num_workers=WORKERS, prefetch_factor=PREFETCH, timeout=30, multiprocessing_context="fork"
    )


def take(dataset, batch_size):
    """[(ids, worker)] for each batch the loop receives."""
    return [(b["id"].tolist(), int(b["worker"][0])) for b in loader(dataset, batch_size)]


def in_turn(counts):
    """The worker of each batch when a loader takes one from each worker in turn, skipping those that are out."""
    left, order = list(counts), []
    while any(left):
        order += [w for w in range(len(left)) if left[w]]
        left = [max(k - 1, 0) for k in left]
    return order


def gather(obj, n):
    everyone = [None] * n
    dist.all_gather_object(everyone, obj)
    return everyone


def flat(batches):
    return [i for ids, _ in batches for i in ids]


# [start: uneven]
def agreed(batches, op):
    """Steps while every rank (MIN: drop the rest) or some rank (MAX: pad) still has a batch."""
    it, seen, again = iter(batches), [], 0
    while True:
        ids = next(it, None)
        more = torch.tensor(int(ids is not None))
        dist.all_reduce(more, op=op)  # one small all-reduce per step: a stream does not know its length
        if not more:
            return
        if ids is None:  # pad: this rank is out and another is not, so it takes its first batches again
            ids, again = seen[again % len(seen)], again + 1
        else:
            seen.append(ids)
        yield ids


def train(batches, way, n_samples):
    """A tiny DDP model trained on this rank's batches; the ids it trained on, its gradient all-reduces."""
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(1, 1))
    calls = []

    def counted(state, bucket):  # DDP runs its hook for the all-reduces a joined rank shadows, too
        calls.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counted)
    opt, trained = torch.optim.SGD(ddp.parameters(), lr=0.1), []
    steps = batches if way == "join" else agreed(batches, dist.ReduceOp.MIN if way == "drop" else dist.ReduceOp.MAX)
    with Join([ddp], enable=way == "join"):  # a rank out of batches answers the others' all-reduces
        for ids in steps:
            opt.zero_grad()
            ddp(torch.tensor(ids, dtype=torch.float32)[:, None] / n_samples).square().mean().backward()
            opt.step()
            trained += ids
    return trained, len(calls), ddp.module.weight.item()


# [end: uneven]


# [start: resume]
def split_back(batches_taken, batch_size):
    """The loop took batches from the workers in turn: worker w made batches w, w + 2, w + 4, ..."""
    return tuple(batch_size * len(range(w, batches_taken, WORKERS)) for w in range(WORKERS))


def interrupted(size, rank, world_size, batch_size, stop):
    """Take `stop` batches, then save three positions: none, the loop's count, the workers' own counts."""
    made = np.frombuffer(mmap.mmap(-1, 8 * WORKERS), dtype=np.int64)  # shared with the forked workers
    batches = iter(loader(Stream(size, rank, world_size, made=made), batch_size))
    taken = [i for b in itertools.islice(batches, stop) for i in b["id"].tolist()]
    requested = (stop + PREFETCH * WORKERS) * batch_size  # the loader keeps this many batches asked for
    deadline = time.monotonic() + 20
    while made.sum() < requested and time.monotonic() < deadline:  # as a training step longer than a batch
        time.sleep(0.01)
    time.sleep(0.1)  # time for a worker that could run further ahead to do so
    saved = {"nothing": (0,) * WORKERS, "the loop's batches": split_back(stop, batch_size)}
    saved["the workers' counts"] = tuple(int(k) for k in made)
    del batches  # ends this loader's workers
    return taken, saved


# [end: resume]


def copied_and_sharded(size, r, n, batch, items):
    """Every rank and worker reading the whole stream, then each its own shard."""
    copied = take(Stream(size, r, n, shard=False), batch)
    seen = Counter(flat(sum(gather(copied, n), [])))
    assert seen == {i: n * WORKERS for i in range(size)}, f"rank {r}: unsharded, seen {set(seen.values())} times"
    lessonlib.report("copied", {"rank": r, "first batches": copied[:4], "times seen": sorted(set(seen.values()))})
    epoch = take(Stream(size, r, n), batch)
    mine = [math.ceil(k / batch) for k in items[r * WORKERS : (r + 1) * WORKERS]]  # from the rule alone
    assert [w for _, w in epoch] == in_turn(mine), f"rank {r}: the workers' batches were not taken in turn"
    seen = Counter(flat(sum(gather(epoch, n), [])))
    assert seen == {i: 1 for i in range(size)}, f"rank {r}: sharded, seen {set(seen.values())} times"
    lessonlib.report("sharded", {"rank": r, "first batches": epoch[:4], "samples": len(flat(epoch))})
    return epoch


def uneven(size, r, n, epoch):
    """Three ways to give every rank the same number of steps, each trained with DDP."""
    batches = [ids for ids, _ in epoch]
    per_rank = gather(len(batches), n)
    short, long = min(per_rank), max(per_rank)
    expected = {  # the ids each way trains on, in order, from this rank's batches alone
        "drop": batches[:short],
        "pad": batches + [batches[j % len(batches)] for j in range(long - len(batches))],
        "join": batches,
    }
    for way, steps in expected.items():
        trained, calls, weight = train(batches, way, size)
        got = gather({"ids": trained, "weight": weight}, n)
        seen = Counter(i for g in got for i in g["ids"])
        assert trained == [i for ids in steps for i in ids], f"rank {r}: {way}: trained on other samples"
        assert calls == (long if way == "join" else len(steps)), f"rank {r}: {way}: {calls} gradient all-reduces"
        assert way == "drop" or set(seen) == set(range(size)), f"rank {r}: {way}: samples never trained on"
        assert way == "pad" or max(seen.values()) == 1, f"rank {r}: {way}: a sample trained on twice"
        assert way != "join" or len({g["weight"] for g in got}) == 1, f"rank {r}: join left the weights apart"
        mean = sum(i * c for i, c in seen.items()) / sum(seen.values())
        row = {"rank": r, "way": way, "batches": len(batches), "steps": len(steps), "all-reduces": calls}
        row |= {"lost": size - len(seen), "duplicates": sum(seen.values()) - len(seen), "mean id": mean}
        lessonlib.report("uneven", row)


def shuffling(size, r, n, batch):
    """A shuffle buffer before or after sharding, seeded per shard or alike, over one or two epochs."""
    for way in ("before, seed per shard", "after, seed per shard", "before, same seed"):
        orders, shards, seen = [], [], []
        for epoch in (0,) if way == "before, seed per shard" else (0, 1):
            got = gather(take(Stream(size, r, n, shuffle=way, epoch=epoch), batch), n)
            orders.append(flat(got[r]))
            shards.append({i: k * WORKERS + w for k, batches in enumerate(got) for ids, w in batches for i in ids})
            seen.append(Counter(flat(sum(got, []))))
        row = {"rank": r, "shuffle": way, "extra copies": sum(c - 1 for c in seen[0].values())}
        row["never seen"] = size - len(seen[0])
        if len(orders) == 1:
            assert row["extra copies"] > 0 and row["never seen"] > 0, f"rank {r}: {way}: {row}"
        else:
            assert seen[0] == seen[1] == {i: 1 for i in range(size)}, f"rank {r}: {way}: not every sample once"
            assert orders[0] != orders[1], f"rank {r}: {way}: epoch 1 repeats epoch 0's order"
            row["moved to another shard"] = sum(shards[0][i] != shards[1][i] for i in range(size))
            assert (row["moved to another shard"] > 0) == (way == "before, same seed"), f"rank {r}: {way}: {row}"
        lessonlib.report("shuffle", row)


def resuming(size, r, n, batch, stop, epoch):
    """A restart from each saved position, against one uninterrupted epoch."""
    taken, saved = interrupted(size, r, n, batch, stop)
    whole = flat(epoch)
    assert taken == whole[: stop * batch], f"rank {r}: the interrupted pass began differently"
    rows = []
    for kind, skip in saved.items():
        after = flat(take(Stream(size, r, n, skip=skip), batch))
        both = Counter(taken + after)
        repeated, skipped = sum((both - Counter(whole)).values()), sum((Counter(whole) - both).values())
        rows.append({"rank": r, "saved": kind, "skip per worker": skip, "repeated": repeated, "skipped": skipped})
        rows[-1]["same order"] = taken + after == whole
        lessonlib.report("resume", rows[-1])
    nothing, loop, workers = rows
    assert (nothing["repeated"], nothing["skipped"]) == (stop * batch, 0), f"rank {r}: from nothing: {nothing}"
    assert (loop["repeated"], loop["skipped"]) == (0, 0), f"rank {r}: from the loop's count: {loop}"
    assert loop["same order"] == (stop % WORKERS == 0), f"rank {r}: from the loop's count: the order {loop}"
    ahead = PREFETCH * WORKERS * batch
    assert (workers["repeated"], workers["skipped"]) == (0, ahead), f"rank {r}: from the workers' counts: {workers}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--size", type=int, default=65, choices=range(40, 1001), metavar="40..1000")
    parser.add_argument("--batch-size", type=int, default=2, choices=range(1, 5), metavar="1..4")
    parser.add_argument("--stop", type=int, default=3, choices=range(1, 101), metavar="1..100")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    n, r, size, batch = ctx.world_size, ctx.rank, args.size, args.batch_size
    items = [len(range(s, size, n * WORKERS)) for s in range(n * WORKERS)]  # each shard's samples
    needed = split_back(args.stop + PREFETCH * WORKERS, 1)  # each worker's batches by the restart
    if any(k // batch < needed[s % WORKERS] for s, k in enumerate(items)):
        lessonlib.teardown()
        parser.error(f"--stop {args.stop}: a worker runs out of full batches before the restart at {n} ranks")
    epoch = copied_and_sharded(size, r, n, batch, items)
    uneven(size, r, n, epoch)
    shuffling(size, r, n, batch)
    resuming(size, r, n, batch, args.stop, epoch)
    print(f"rank {r}: {len(epoch)} batches of its shard; every case as asserted")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
