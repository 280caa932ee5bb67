"""torchrun --nproc_per_node=2 lessons/02_async.py

async_op=True: a collective that returns at once, what wait() guarantees, and what it costs to forget it.

1. all_reduce(x, async_op=True) returns a Work handle before the other ranks have even called it
   (they wait for rank 0's signal on a second group). Reading x before wait() does not give the
   sum; after wait() x holds it (both asserted on gloo).
2. The pitfall: writing to x between the call and wait(). The collective reads x while it runs, so
   the write leaks into every rank's result (asserted on gloo: the result is not the sum of what
   the ranks passed in).
3. Overlap, measured: communication of --numel floats run during other work: a sleep (leaves the
   CPU free, like a GPU kernel the CPU only queues) and CPU-bound matmuls. Reported, not asserted.
4. get_future().then(...): run a step when the collective finishes (what DDP's comm hooks build on).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import lessonlib


# [start: wait]
def read_before_wait(ctx, signal):
    """Rank 0 starts an all_reduce and looks at x before the others have even called it."""
    n = ctx.world_size
    x = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    if ctx.rank != 0:
        dist.barrier(group=signal)  # wait here until rank 0 has looked
    work = dist.all_reduce(x, async_op=True)
    peek, done = x.clone(), work.is_completed()
    if ctx.rank == 0:
        dist.barrier(group=signal)  # now the others may join the all_reduce
    work.wait()  # gloo: x holds the result now (NCCL: work queued after this on the stream sees it)
    total = n * (n + 1) / 2  # sum over ranks of (rank + 1)
    assert torch.all(x == total), f"rank {ctx.rank}: after wait() x = {x.tolist()}, expected {total}"
    if ctx.rank == 0 and n > 1 and ctx.backend == "gloo":  # nobody else had joined: no sum yet
        assert not done and not torch.all(peek == total), f"rank 0: before wait() x was {peek.tolist()}"
    return {"completed right after the call": done, "x before wait()": peek[0].item(), "x after wait()": x[0].item()}


def write_before_wait(ctx, signal):
    """The bug: rank 0 reuses x between starting the all_reduce and wait()."""
    n = ctx.world_size
    x = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    if ctx.rank != 0:
        dist.barrier(group=signal)
    work = dist.all_reduce(x, async_op=True)
    if ctx.rank == 0:
        x.add_(1000)  # the collective has not finished reading x: this write is a race
        dist.barrier(group=signal)
    work.wait()
    total = n * (n + 1) / 2
    if n > 1 and ctx.backend == "gloo":  # gloo reads x once the peers are there: after the write
        assert not torch.all(x == total), f"rank {ctx.rank}: the write did not leak this time"
    return {"expected": total, "got": x[0].item()}


# [end: wait]


# [start: overlap]
def overlap(ctx, numel, repeats):
    """Median seconds for: comm alone, work alone, one after the other, and work during async comm."""
    buf = torch.randn(numel, device=ctx.device)
    a = torch.randn(256, 256, device=ctx.device)

    def comm():
        return dist.all_reduce(buf, async_op=True)

    def matmuls():
        for _ in range(40):
            a @ a

    def timeit(fn):
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()  # GPU work is queued, not done, when the call returns
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    comm_s = timeit(lambda: comm().wait())
    rows = []
    for name, work in [("sleep (CPU left free)", lambda: time.sleep(comm_s)), ("matmuls (CPU busy)", matmuls)]:
        work_s = timeit(work)
        serial_s = timeit(lambda: (comm().wait(), work()))  # noqa: B023 - called in this iteration
        overlapped_s = timeit(lambda: (w := comm(), work(), w.wait()))  # noqa: B023
        rows.append(
            {
                "work": name,
                "comm alone (ms)": comm_s * 1e3,
                "work alone (ms)": work_s * 1e3,
                "comm, then work (ms)": serial_s * 1e3,
                "work during async comm (ms)": overlapped_s * 1e3,
                "saved": 1 - overlapped_s / serial_s,
            }
        )
    return rows


# [end: overlap]


# [start: future]
def mean_via_future(ctx):
    x = torch.full((3,), float(ctx.rank), device=ctx.device)
    fut = dist.all_reduce(x, async_op=True).get_future()
    mean = fut.then(lambda f: f.value()[0] / ctx.world_size).wait()  # runs once the sum has arrived
    expected = (ctx.world_size - 1) / 2  # mean of 0..n-1
    assert torch.allclose(mean.cpu(), torch.full((3,), expected)), f"rank {ctx.rank}: mean {mean.tolist()}"
    return mean[0].item()


# [end: future]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--numel", type=int, default=2_000_000, help="floats all-reduced in the overlap test")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.numel < 1 or args.repeats < 1:
        parser.error("--numel and --repeats must be at least 1")

    ctx = lessonlib.setup()
    signal = dist.new_group(backend="gloo", timeout=ctx.timeout)  # a side channel: rank 0 says "go"
    row = lessonlib.report("wait", read_before_wait(ctx, signal))
    print(
        f"completed at once: {row['completed right after the call']}; x before wait(): "
        f"{row['x before wait()']}, after: {row['x after wait()']}"
    )
    row = lessonlib.report("write_before_wait", write_before_wait(ctx, signal))
    print(f"rank 0 wrote to x before wait(): result {row['got']}, the sum of the inputs is {row['expected']}")
    for row in lessonlib.report("overlap", overlap(ctx, args.numel, args.repeats)):
        print(
            f"{row['work']}: comm {row['comm alone (ms)']:.1f} ms, work {row['work alone (ms)']:.1f} ms, "
            f"serial {row['comm, then work (ms)']:.1f} ms, overlapped {row['work during async comm (ms)']:.1f} ms"
        )
    print(f"mean over ranks via a future: {lessonlib.report('future', mean_via_future(ctx))}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
