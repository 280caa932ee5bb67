"""torchrun --nproc_per_node=2 lessons/05_data_parallel.py

nn.DataParallel from a real run: what it does without GPUs, with them, and why threads lose to processes.

Options: --iters 300 (the default).

DataParallel is one process. With two or more GPUs, every forward() splits the batch across them
(scatter), copies the module to every GPU (replicate), runs the copies in one Python thread each
(parallel_apply) and brings the outputs back to the first GPU (gather), where the loss and the
optimizer step then run alone. With no GPU there is nothing to split over: DataParallel's device list
is empty and forward() simply calls the module, in the caller's thread, on the whole batch. Both are
asserted; the GPU path runs only with 2+ GPUs and is otherwise skipped with the reason printed.

Why threads are a problem: a Python thread holds the GIL while it runs Python code, and a forward
pass is a lot of Python. Rank 0 times a Python-heavy forward in one thread, then the same work split
over two threads; then every rank does its share at once, as DDP's processes do. The times are
measured and reported, not asserted: they depend on the machine.
"""

import argparse
import threading
import time

import torch
import torch.distributed as dist

import lessonlib


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


def work(model, iters, x):
    with torch.no_grad():
        for _ in range(iters):
            model(x)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gil(ctx, iters):
    """Seconds for 2 x iters forwards: one thread; two threads; and world_size processes at once."""
    torch.set_num_threads(1)  # one core per worker, as torchrun arranges for ranks
    model, x = small_layers(), torch.randn(2, 4)
    work(model, 20, x)  # warm-up
    row = {}
    if ctx.is_main:  # the other ranks wait, so rank 0 has the machine to itself
        row["one thread"] = timed(lambda: work(model, 2 * iters, x))
        # [start: threads]
        threads = [threading.Thread(target=work, args=(model, iters, x)) for _ in range(2)]
        row["two threads"] = timed(lambda: ([t.start() for t in threads], [t.join() for t in threads]))
        # [end: threads]
    dist.barrier()
    # Every rank does 2 x iters / world_size forwards at the same moment; the job takes the slowest.
    share = 2 * iters // ctx.world_size
    elapsed = torch.tensor([timed(lambda: work(model, share, x))])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    row[f"{ctx.world_size} processes"] = elapsed.item()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--iters", type=int, default=300, choices=range(10, 100_001), metavar="10..100000")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")

    cpu = lessonlib.report("cpu", cpu_data_parallel())
    gpu = lessonlib.report("gpu", gpu_data_parallel())
    times = gil(ctx, args.iters)
    if ctx.is_main:
        lessonlib.report("gil", times)
        print(
            f"DataParallel without GPUs: device_ids={cpu['device_ids']}, {cpu['calls']} call of the module, "
            f"on all {cpu['rows per call'][0]} rows, in the caller's thread"
            if cpu["ran"]
            else f"DataParallel without GPUs: not run: {cpu['reason']}"
        )
        print(f"DataParallel with GPUs: {gpu if gpu['ran'] else 'skipped: ' + gpu['reason']}")
        base = times["one thread"]
        for name, t in times.items():
            print(f"{2 * args.iters} forwards, {name:12}: {t:6.3f} s  ({base / t:4.2f}x the speed of one thread)")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
