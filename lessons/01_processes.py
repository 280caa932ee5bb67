"""torchrun --nproc_per_node=2 lessons/01_processes.py

Ranks are processes, not threads: each has its own memory and its own interpreter (and GIL).

Options: --loop 300000 --repeats 7 (the defaults).

1. Rank 0 changes a module-level list; the other ranks do not see the change (gathered and checked).
   Two threads in one process, by contrast, append to one shared list.
2. The GIL: k = max(2, world size) runs of a pure-Python loop, three ways: one after another in one
   thread; in k threads of one process; and one per rank, every rank at once. Rank 0 runs the first
   two while the other ranks sleep in a barrier. Each way gets its wall time and its CPU time (each
   thread's own, time.thread_time), and their ratio, the cores it kept busy. A round runs all three
   moments apart; the figures are medians over --repeats rounds, so a few busy moments on a shared
   machine do not decide them. Asserted: the threads kept at most 1.1 cores busy. The loop holds the
   GIL, so only one thread runs at a time, however many cores are free, and other programs on the
   machine can only lower the figure. The ranks' figures are reported, not asserted: each rank has a
   GIL of its own, so on 2 free cores they take about half the time of the loops in a row, but on a
   busy machine a rank can spend its whole run sharing one core with another program.
Also runs as `python lessons/01_processes.py` (world size 1: threads only).
"""

import argparse
import statistics
import threading
import time

import torch.distributed as dist

import lessonlib

SHARED = ["original"]
THREADS_CORES_AT_MOST = 1.1  # CPU seconds per wall second of the threads: 1 when the GIL lets one run at a time


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
    """Pure Python: no call into C that could let go of the GIL while the loop runs."""
    total = 0
    for i in range(n):
        total += i
    return total


def cpu_count(n, out):
    """count(n), appending the CPU seconds this thread spent on it (time.thread_time: this thread only)."""
    start = time.thread_time()
    count(n)
    out.append(time.thread_time() - start)


def timed(fn):
    """(wall seconds, CPU seconds of every loop fn ran) for fn(out)."""
    out = []
    start = time.perf_counter()
    fn(out)
    return time.perf_counter() - start, sum(out)


def in_threads(k, n, out):
    threads = [threading.Thread(target=cpu_count, args=(n, out)) for _ in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a counting thread did not finish in 120 s"


# [start: gil_timing]
def gil_timing(ctx, n, repeats):
    """`repeats` rounds of k = max(2, world size) runs of count(n), as (wall s, CPU s): one after
    another, in k threads, and (world size 2 or more) one per rank with every rank at once."""
    k = max(2, ctx.world_size)
    rounds = []
    for i in range(repeats):
        dist.barrier()
        row = {}
        if ctx.is_main:  # the others sleep in the barrier below, leaving the cores to rank 0
            ways = {
                "serial": lambda out: [cpu_count(n, out) for _ in range(k)],
                "threads": lambda out: in_threads(k, n, out),
            }
            for name in sorted(ways, reverse=i % 2 == 1):  # alternate which goes first
                row[name] = timed(ways[name])
        dist.barrier()
        if ctx.world_size == k:  # one loop per rank, all at once: the job takes the slowest rank's time
            times = [None] * ctx.world_size
            dist.all_gather_object(times, timed(lambda out: cpu_count(n, out)))
            row["ranks"] = (max(w for w, _ in times), sum(c for _, c in times))
        rounds.append(row)
    return {"loops": k, "rounds": rounds}


# [end: gil_timing]


def summarise(times):
    """Per way, medians over the rounds: wall seconds, cores kept busy (CPU s / wall s), and time over
    the loops in a row of the same round."""
    rounds = times["rounds"]
    return {
        name: {
            "seconds": statistics.median(row[name][0] for row in rounds),
            "cores": statistics.median(row[name][1] / row[name][0] for row in rounds),
            "time / in a row": statistics.median(row[name][0] / row["serial"][0] for row in rounds),
        }
        for name in rounds[0]
    }


def check_gil(summary, k):
    """What the chapter says about the timing, asserted on rank 0's medians."""
    cores = summary["threads"]["cores"]
    assert cores <= THREADS_CORES_AT_MOST, (
        f"{k} threads kept {cores:.2f} cores busy: the GIL should let only one of them run Python at a "
        f"time (expected <= {THREADS_CORES_AT_MOST})"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--loop", type=int, default=300_000, help="iterations of the pure-Python loop")
    parser.add_argument("--repeats", type=int, default=7, help="rounds; the figures are their medians")
    args = parser.parse_args()
    ctx = lessonlib.setup()

    copies = memory_is_private(ctx)
    print(f"rank {ctx.rank}: my SHARED = {SHARED}")
    box = threads_share_memory()
    times = gil_timing(ctx, args.loop, args.repeats)
    if ctx.is_main:
        summary = lessonlib.report("gil", summarise(times))
        print(f"every rank's copy of SHARED: {copies}")
        print(f"two threads, one list: {box}")
        k = times["loops"]
        for name, row in summary.items():
            print(
                f"{k} x count() {name:8}: {row['seconds']:.3f} s, {row['cores']:.2f} cores busy, "
                f"{row['time / in a row']:.2f} x the time in a row (medians of {args.repeats} rounds)"
            )
        check_gil(summary, k)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
