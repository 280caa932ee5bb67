"""torchrun --nproc_per_node=2 lessons/05_data_parallel.py

nn.DataParallel from a real run: what it does without GPUs, with them, and what the GIL costs its threads.

Options: --iters 100 --repeats 5 (the defaults).

DataParallel is one process. With two or more GPUs, every forward() splits the batch across them
(scatter), copies the module to every GPU (replicate), runs the copies in one Python thread each
(parallel_apply) and brings the outputs back to the first GPU (gather), where the loss and the
optimizer step then run alone. With no GPU there is nothing to split over: DataParallel's device list
is empty and forward() simply calls the module, in the caller's thread, on the whole batch. Both are
asserted; the GPU path runs only with 2+ GPUs and is otherwise skipped with the reason printed.

Why threads are a problem: a Python thread must hold the GIL to run Python code. torch's operators let
go of it while their C++ code runs, and take it back to return. Two workloads, 2 x iters steps each:
a forward pass of 40 tiny layers (Python around every op, a little C++ inside), and a pure-Python
counting loop. Rank 0 runs each in one thread, then split over two threads, while the other ranks
sleep in a barrier; then every rank does its share at the same moment, as DDP's processes do. Each
has a wall time and a CPU time (each thread's own), and their ratio, the cores it kept busy; the
figures are medians over --repeats rounds, each round's timings moments apart.
Asserted: two threads running pure Python kept at most 1.1 cores busy (the GIL: one at a time; other
programs on the machine can only lower it). The rest is measured and reported, not asserted: it
depends on the machine and on what else it is running.
"""

import argparse
import statistics
import threading
import time

import torch
import torch.distributed as dist

import lessonlib

THREADS_CORES_AT_MOST = 1.1  # CPU seconds per wall second of two threads running pure Python (GIL: 1)


def small_layers(depth=40):
    """Many tiny layers: the time goes to Python and dispatch, not to arithmetic."""
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(depth)])


def cpu_data_parallel():
    """What DataParallel does on a machine without GPUs, observed with a forward hook."""
    if torch.cuda.is_available():  # DataParallel would take the GPUs and refuse a CPU module
        return {"ran": False, "reason": "this machine has a GPU: DataParallel uses it (see the GPU path)"}
    model = torch.nn.Linear(6, 2)
    calls = []
    model.register_forward_hook(lambda m, inp, out: calls.append((threading.get_ident(), inp[0].shape[0])))
    # [start: cpu]
    dp = torch.nn.DataParallel(model)
    x = torch.randn(8, 6)
    out = dp(x)  # no GPU: no scatter, no replicas, no threads; just model(x)
    # [end: cpu]
    seen = {
        "ran": True,
        "device_ids": dp.device_ids,
        "calls": len(calls),
        "rows per call": [c[1] for c in calls],
        "same thread": calls[0][0] == threading.get_ident(),
    }
    assert dp.device_ids == [] and dp.module is model, dp.device_ids
    assert calls == [(threading.get_ident(), 8)], f"expected one call, whole batch, this thread: {calls}"
    assert torch.equal(out, model(x))
    return seen


def gpu_data_parallel():
    """With 2+ GPUs: one call per GPU, each in its own thread on its slice; output on GPU 0."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        return {
            "ran": False,
            "reason": f"needs 2 or more GPUs; torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}, device_count {count}",
        }
    model = torch.nn.Linear(6, 2).cuda(0)
    calls = []
    model.register_forward_hook(
        lambda m, inp, out: calls.append((threading.get_ident(), inp[0].device.index, inp[0].shape[0]))
    )
    dp = torch.nn.DataParallel(model)
    x = torch.randn(8 * count, 6, device="cuda:0")
    out = dp(x)
    assert len(calls) == count and sorted(c[1] for c in calls) == list(range(count)), calls
    assert len({c[0] for c in calls}) == count, "expected one thread per GPU"
    assert out.device.index == 0 and torch.allclose(out, model(x), atol=1e-5)
    return {
        "ran": True,
        "gpus": count,
        "rows per call": [c[2] for c in calls],
        "threads": len({c[0] for c in calls}),
        "output device": str(out.device),
    }


def count(n):
    """Pure Python: no call into C that could let go of the GIL while the loop runs."""
    total = 0
    for i in range(n):
        total += i
    return total


def workloads():
    """Two kinds of work, each as fn(steps, out) that appends the CPU seconds its thread spent on it."""
    model, x = small_layers(), torch.randn(2, 4)

    def layers(k, out):  # 40 tiny layers: Python around each op, C++ inside it
        start = time.thread_time()
        with torch.no_grad():
            for _ in range(k):
                model(x)
        out.append(time.thread_time() - start)

    def python(k, out):  # the Python part alone: a counting loop
        start = time.thread_time()
        for _ in range(k):
            count(15_000)
        out.append(time.thread_time() - start)

    layers(10, [])  # warm-up
    return {"40 tiny layers": layers, "pure Python": python}


def timed(fn):
    """(wall seconds, CPU seconds that fn(out) appended)."""
    out = []
    start = time.perf_counter()
    fn(out)
    return time.perf_counter() - start, sum(out)


def in_two_threads(fn, k, out):
    # [start: threads]
    threads = [threading.Thread(target=fn, args=(k, out)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # [end: threads]
    assert not any(t.is_alive() for t in threads), "a worker thread did not finish in 120 s"


def gil(ctx, iters, repeats):
    """`repeats` rounds of 2 x iters steps of each workload: in one thread, in two threads (iters each),
    and (world size 2 or more) split over the ranks at once; (wall s, CPU s) for each."""
    torch.set_num_threads(1)  # one core per worker, as torchrun arranges for ranks
    work = workloads()
    share = 2 * iters // ctx.world_size
    rounds = []
    for i in range(repeats):
        row = {}
        dist.barrier()
        if ctx.is_main:  # the other ranks sleep in the barrier below, leaving the cores to rank 0
            for name, fn in work.items():
                ways = {
                    "one thread": lambda out, fn=fn: fn(2 * iters, out),
                    "two threads": lambda out, fn=fn: in_two_threads(fn, iters, out),
                }
                for way in sorted(ways, reverse=i % 2 == 1):  # alternate which goes first
                    row[f"{name}, {way}"] = timed(ways[way])
        dist.barrier()
        if ctx.world_size > 1:  # every rank does its share at the same moment; the job takes the slowest
            for name, fn in work.items():
                times = [None] * ctx.world_size
                dist.all_gather_object(times, timed(lambda out, fn=fn: fn(share, out)))
                row[f"{name}, {ctx.world_size} processes"] = (max(w for w, _ in times), sum(c for _, c in times))
        rounds.append(row)
    return rounds


def summarise(rounds):
    """Per workload and way, medians over the rounds: wall seconds, cores busy (CPU s / wall s), and the
    speed-up over one thread on the same workload in the same round."""
    summary = {}
    for key in rounds[0]:
        base = key.split(", ")[0] + ", one thread"
        summary[key] = {
            "seconds": statistics.median(row[key][0] for row in rounds),
            "cores": statistics.median(row[key][1] / row[key][0] for row in rounds),
            "speed-up": statistics.median(row[base][0] / row[key][0] for row in rounds),
        }
    return summary


def check_gil(summary):
    """What the chapter says about the timing, asserted on rank 0's medians."""
    cores = summary["pure Python, two threads"]["cores"]
    assert cores <= THREADS_CORES_AT_MOST, (
        f"two threads running pure Python kept {cores:.2f} cores busy: the GIL should let only one of them "
        f"run at a time (expected <= {THREADS_CORES_AT_MOST})"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--iters", type=int, default=100, choices=range(10, 100_001), metavar="10..100000")
    parser.add_argument("--repeats", type=int, default=5, choices=range(1, 1001), metavar="1..1000")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")

    cpu = lessonlib.report("cpu", cpu_data_parallel())
    gpu = lessonlib.report("gpu", gpu_data_parallel())
    rounds = gil(ctx, args.iters, args.repeats)
    if ctx.is_main:
        summary = lessonlib.report("gil", summarise(rounds))
        print(
            f"DataParallel without GPUs: device_ids={cpu['device_ids']}, {cpu['calls']} call of the module, "
            f"on all {cpu['rows per call'][0]} rows, in the caller's thread"
            if cpu["ran"]
            else f"DataParallel without GPUs: not run: {cpu['reason']}"
        )
        print(f"DataParallel with GPUs: {gpu if gpu['ran'] else 'skipped: ' + gpu['reason']}")
        for key, v in summary.items():
            print(
                f"{2 * args.iters} steps, {key:30}: {v['seconds']:6.3f} s, {v['cores']:.2f} cores busy, "
                f"{v['speed-up']:.2f}x the speed of one thread (medians of {args.repeats} rounds)"
            )
        check_gil(summary)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
