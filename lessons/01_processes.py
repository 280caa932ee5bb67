"""torchrun --nproc_per_node=2 lessons/01_processes.py

Ranks are processes, not threads: each has its own memory and its own interpreter (and GIL).

1. Rank 0 changes a module-level list; the other ranks do not see the change (gathered and checked).
   Two threads in one process, by contrast, append to one shared list.
2. The GIL: a pure-Python loop run in 2 threads takes about as long as running it twice in a row,
   because only one thread runs Python bytecode at a time. Measured, not asserted: timings depend on
   the machine. Processes (ranks) each have their own GIL, which is why DDP uses one process per device.
Also runs as `python lessons/01_processes.py` (world size 1).
"""

import argparse
import threading
import time

import torch.distributed as dist

import lessonlib

SHARED = ["original"]


# [start: memory_is_private]
def memory_is_private(ctx):
    """Rank 0 mutates SHARED; gather every rank's copy and check only rank 0's changed."""
    if ctx.is_main:
        SHARED.append("changed by rank 0")
    copies = [None] * ctx.world_size
    dist.all_gather_object(copies, SHARED)
    for rank, copy in enumerate(copies):
        expected = ["original", "changed by rank 0"] if rank == 0 else ["original"]
        assert copy == expected, f"rank {rank} sees {copy}, expected {expected}"
    return copies


# [end: memory_is_private]


def threads_share_memory():
    """Two threads append to one list: they share this process's memory."""
    box = []
    workers = [threading.Thread(target=box.append, args=(name,)) for name in ("thread A", "thread B")]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=10)
    assert sorted(box) == ["thread A", "thread B"], f"threads did not share the list: {box}"
    return box


def count(n):
    total = 0
    for i in range(n):
        total += i
    return total


def gil_timing(n):
    """Seconds for count(n) twice in a row versus in two threads at once."""
    t0 = time.perf_counter()
    count(n)
    count(n)
    serial = time.perf_counter() - t0
    threads = [threading.Thread(target=count, args=(n,)) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    threaded = time.perf_counter() - t0
    return serial, threaded


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--loop", type=int, default=2_000_000, help="iterations of the pure-Python loop")
    args = parser.parse_args()
    ctx = lessonlib.setup()

    copies = memory_is_private(ctx)
    print(f"rank {ctx.rank}: my SHARED = {SHARED}")
    box = threads_share_memory()
    serial, threaded = gil_timing(args.loop)
    print(
        f"rank {ctx.rank}: 2 x count() serial {serial:.3f} s, in 2 threads {threaded:.3f} s "
        f"(threads/serial = {threaded / serial:.2f})"
    )
    lessonlib.report("gil", {"serial": serial, "threaded": threaded})
    if ctx.is_main:
        print(f"every rank's copy of SHARED: {copies}")
        print(f"two threads, one list: {box}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
