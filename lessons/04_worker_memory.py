"""torchrun --nproc_per_node=2 lessons/04_worker_memory.py

DataLoader workers' memory, times the ranks: a list of Python ints against one numpy array of the same ints.

Options: --items N (default 1,000,000), --workers W (default 4, or 2 from 3 ranks on), --batch-size B.

Linux only: it reads /proc/PID/smaps_rollup (elsewhere it reports why it measured nothing and checks
nothing). A process's unique memory (USS) is Private_Clean + Private_Dirty: the pages no other process
maps. Each rank reads its shard (DistributedSampler, shuffled) for two epochs with W workers forked from
it, once from a list of Python ints, once from one int64 numpy array of the same values (the sums are
checked equal). A worker measures itself at its first batch, before it reads a sample; the rank measures
every worker again at the epoch's last batch, while they are all alive. Asserted on every rank:
  list: in one epoch every worker's USS grew by at least 40% of the list's size (its pointers and its
    int objects), though it read only 1/(ranks x W) of the items: reading an int writes its reference
    count, and fork's copy-on-write then copies the int's whole page into the worker.
  array: every worker grew by less than a tenth of the smallest growth in the list case.
  the rank's child processes are exactly its W workers; all ranks together are ranks x (W + 1) processes.
  persistent_workers=True (the list case): epoch 2 has the same worker pids, which keep their copies
    (epoch 2 adds less than a quarter of epoch 1's growth); False (the array case): epoch 2's pids are new.
  prefetch_factor=2: before the rank takes a batch, its workers produce exactly 2 x W batches (counted in
    shared memory), and no more in the 0.2 s the rank waits.
  pin_memory=True: without an accelerator torch 2.14.1 warns that it found none and pins nothing; with
    one, the batch comes back page-locked.
"""

import argparse
import mmap
import os
import sys
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset, get_worker_info

import lessonlib

ROLLUP = "/proc/self/smaps_rollup"
PREFETCH = 2  # the loader's prefetch_factor (torch's default when there are workers)
MIB = 2**20


# [start: memory]
def memory(pid="self"):
    """A process's unique memory (USS) and its proportional share (Pss), in bytes, as the kernel counts them."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":") for line in f if line.count(":") == 1)}
    return {"uss": 1024 * (kb["Private_Clean"] + kb["Private_Dirty"]), "pss": 1024 * kb["Pss"]}


# [end: memory]


def children(pid):
    """The pids whose parent is pid, from every process's /proc/PID/stat."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # it ended while we looked
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state; a name may hold ')'
            found.append(int(name))
    return sorted(found)


# [start: dataset]
class Samples(Dataset):
    def __init__(self, data, produced):
        self.data, self.produced, self.start = data, produced, None

    def __len__(self):
        return len(self.data)

    def __getitems__(self, indices):  # if a dataset has it, the loader calls it once per batch
        if self.start is None:  # this worker's first batch: measure before it reads a sample
            self.start = memory()
        if isinstance(self.data, list):
            values = np.array([self.data[i] for i in indices])  # each read writes an int's refcount
        else:
            values = self.data[indices]  # copies the values out; writes no page of the array
        worker = get_worker_info().id
        self.produced[worker] += 1
        return {"x": values, "worker": worker, "pid": os.getpid(), "start": self.start}


# [end: dataset]


# [start: loader]
def make_loader(data, produced, ctx, args, persistent):
    return DataLoader(
        Samples(data, produced),
        batch_size=args.batch_size,
        sampler=DistributedSampler(data, ctx.world_size, ctx.rank, shuffle=True, seed=0),
        num_workers=args.workers,
        multiprocessing_context="fork",  # what this measures: pages shared by fork (Python 3.14 defaults otherwise)
        collate_fn=lambda batch: batch,  # __getitems__ returned the batch already
        persistent_workers=persistent,  # keep the workers, and what they copied, from epoch to epoch
        prefetch_factor=PREFETCH,  # batches each worker may have ready for this rank
        timeout=30,  # a stuck worker: an error, not a hang
    )


# [end: loader]


def run_epoch(loader, epoch, produced, ctx, case):
    """One epoch: a row per worker (USS at its first batch, at the epoch's last) and one for the rank."""
    loader.sampler.set_epoch(epoch)
    produced[:] = 0
    batches = iter(loader)  # starts the workers (or wakes persistent ones), PREFETCH batches for each
    ahead = None
    if epoch == 0:  # let them run ahead: how far do they go?
        cap, deadline = min(PREFETCH * loader.num_workers, len(loader)), time.monotonic() + 20
        while produced.sum() < cap and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        ahead = int(produced.sum())
        assert ahead == cap, f"rank {ctx.rank}: {case}: {ahead} batches made before the first was taken, not {cap}"
    first, total = {}, 0
    for i, batch in enumerate(batches):
        first.setdefault(batch["pid"], batch)
        total += int(batch["x"].sum())
        if i == len(loader) - 1:  # the last batch: every worker is done, and alive until the next next()
            ends = {pid: memory(pid) for pid in first}
            kids, mine = children(os.getpid()), memory()
    rows = [
        {"process": f"worker {b['worker']}", "pid": pid, "uss start": b["start"]["uss"], "uss end": ends[pid]["uss"]}
        | {"pss start": b["start"]["pss"], "pss end": ends[pid]["pss"]}
        for pid, b in sorted(first.items(), key=lambda item: item[1]["worker"])
    ]
    rows.append({"process": "rank", "pid": os.getpid(), "uss end": mine["uss"], "pss end": mine["pss"]})
    where = f"rank {ctx.rank}: {case}, epoch {epoch}"
    assert len(first) == min(loader.num_workers, len(loader)), f"{where}: only {len(first)} workers served"
    assert kids == sorted(first), f"{where}: the rank's children {kids} are not its workers {sorted(first)}"
    return rows, total, {"ahead": ahead, "batch bytes": next(iter(first.values()))["x"].nbytes}  # a full batch


def pinning(ctx):
    """What pin_memory=True does here: without an accelerator, a warning and nothing pinned."""
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=4, pin_memory=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (x,) = next(iter(loader))
    said = [str(w.message) for w in caught if "pin_memory" in str(w.message)]
    if torch.accelerator.is_available():  # the DataLoader's own test (False on a CUDA build with no GPU)
        assert x.is_pinned(), f"rank {ctx.rank}: pin_memory=True with an accelerator returned unpinned memory"
    else:
        assert said and "no accelerator is found" in said[0], f"rank {ctx.rank}: pin_memory=True did not warn"
        assert not x.is_pinned(), f"rank {ctx.rank}: a batch was pinned without an accelerator"
    return {"rank": ctx.rank, "accelerator": torch.accelerator.is_available(), "pinned": x.is_pinned(), "said": said}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--items", type=int, default=1_000_000, choices=range(10_000, 10_000_001), metavar="N")
    parser.add_argument("--workers", type=int, default=None, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--batch-size", type=int, default=16384, choices=range(1, 1_000_001), metavar="B")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    n, r = ctx.world_size, ctx.rank
    if not os.path.exists(ROLLUP):
        reason = f"{ROLLUP} does not exist on this system ({sys.platform}): nothing measured, nothing checked"
        lessonlib.report("skipped", reason)
        print(f"rank {r}: skipped: {reason}")
        lessonlib.teardown()
        return
    args.workers = args.workers or (4 if n <= 2 else 2)  # at most 8 workers in all, on a 2-core machine
    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)  # more workers than cores
    # An anonymous shared mapping: the forked workers write to this very page, not to copies of it.
    produced = np.frombuffer(mmap.mmap(-1, 8 * args.workers), dtype=np.int64)
    growth, totals, pids = {}, {}, {}
    for case, persistent in (("list", True), ("array", False)):
        ints = range(1000, 1000 + args.items)  # ints above 256 are objects of their own, 28 bytes each
        data = list(ints) if case == "list" else np.arange(ints.start, ints.stop, dtype=np.int64)
        size = sys.getsizeof(data) + (len(data) * sys.getsizeof(ints[-1]) if case == "list" else 0)
        loader = make_loader(data, produced, ctx, args, persistent)
        for epoch in (0, 1):
            rows, total, prefetch = run_epoch(loader, epoch, produced, ctx, case)
            lessonlib.report("memory", [row | {"case": case, "epoch": epoch, "rank": r, "size": size} for row in rows])
            if epoch == 0:
                lessonlib.report("prefetch", prefetch | {"case": case, "rank": r, "workers": args.workers})
            growth[case, epoch] = [row["uss end"] - row["uss start"] for row in rows[:-1]]
            pids[case, epoch] = [row["pid"] for row in rows[:-1]]
            totals[case] = totals.get(case, 0) + total
        del data, loader  # the workers of a persistent loader end with it
        if persistent:
            assert pids[case, 0] == pids[case, 1], f"rank {r}: {case}: persistent workers, yet new pids"
            later = [g1 - g0 for g0, g1 in zip(growth[case, 0], growth[case, 1])]  # a worker's start is its first
            assert max(later) < 0.25 * min(growth[case, 0]), f"rank {r}: {case}: epoch 2 grew by {later} bytes"
        else:
            assert not set(pids[case, 0]) & set(pids[case, 1]), f"rank {r}: {case}: epoch 2 kept a worker"
        if case == "list":
            low = min(growth[case, 0])
            assert low > 0.4 * size, f"rank {r}: a worker grew by {low / MIB:.1f} MiB, the list is {size / MIB:.1f}"
    assert totals["list"] == totals["array"], f"rank {r}: the list and the array gave different values"
    high = max(growth["array", 0])
    assert high < 0.1 * low, f"rank {r}: the array case grew by {high / MIB:.2f} MiB, the list by {low / MIB:.1f}"
    lessonlib.report("pin_memory", pinning(ctx))
    print(
        f"rank {r}: {args.workers} workers, each grew by at least {low / MIB:.1f} MiB (list), "
        f"at most {high / MIB:.2f} MiB (array); this rank and its {len(pids['list', 0])} workers"
    )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
