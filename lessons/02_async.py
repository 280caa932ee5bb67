"""torchrun --nproc_per_node=2 lessons/02_async.py

async_op=True: a collective that returns at once, what wait() guarantees, and what it costs to forget it.

1. all_reduce(x, async_op=True) returns a Work handle while a late rank has not even joined yet.
   Reading x before wait() gives the old value; after wait() x holds the sum (both asserted).
2. The pitfall: writing to x between the call and wait(). The collective reads x while it runs, so
   the write leaks into every rank's result (asserted: the result is not the sum of what the ranks
   passed in).
3. Overlap, measured: communication of --numel floats run during other work. With "work" that leaves
   the CPU free (a sleep, standing in for a GPU kernel) the two overlap; with CPU-bound matmuls on a
   machine with no spare core they mostly take turns.
4. get_future().then(...): run a step when the collective finishes (what DDP's comm hooks build on).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import lessonlib


# [start: wait]
def read_before_wait(ctx, late):
    n = ctx.world_size
    x = torch.full((4,), float(ctx.rank + 1))
    dist.barrier()
    if ctx.rank != 0:
        time.sleep(late)  # rank 0 issues the all_reduce while the others are still away
    work = dist.all_reduce(x, async_op=True)
    peek, done = x.clone(), work.is_completed()
    work.wait()  # on CPU/gloo: the result is in x when wait() returns
    total = n * (n + 1) / 2  # sum over ranks of (rank + 1)
    assert torch.all(x == total), f"rank {ctx.rank}: after wait() x = {x.tolist()}, expected {total}"
    if ctx.rank == 0 and n > 1:  # the peers were asleep: the sum cannot have been there yet
        assert not done and torch.all(peek == 1.0), f"rank 0: before wait() x was {peek.tolist()}"
    return {"completed right after the call": done, "x before wait()": peek[0].item(), "x after wait()": x[0].item()}


def write_before_wait(ctx, late):
    n = ctx.world_size
    x = torch.full((4,), float(ctx.rank + 1))
    dist.barrier()
    if ctx.rank != 0:
        time.sleep(late)
    work = dist.all_reduce(x, async_op=True)
    if ctx.rank == 0:
        x.add_(1000)  # the bug: reuse the buffer before the collective is done with it
    work.wait()
    total = n * (n + 1) / 2
    if n > 1:
        assert not torch.all(x == total), f"rank {ctx.rank}: the write did not leak this time"
    return {"expected": total, "got": x[0].item()}
# [end: wait]


# [start: overlap]
def overlap(ctx, numel, repeats):
    """Median seconds for: comm alone, work alone, one after the other, and work during async comm."""
    buf = torch.randn(numel)
    a = torch.randn(256, 256)

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
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    comm_s = timeit(lambda: comm().wait())
    rows = []
    for name, work in [("sleep (CPU left free)", lambda: time.sleep(comm_s)), ("matmuls (CPU busy)", matmuls)]:
        work_s = timeit(work)
        serial_s = timeit(lambda: (comm().wait(), work()))
        overlapped_s = timeit(lambda: (w := comm(), work(), w.wait()))
        rows.append({"work": name, "comm alone (ms)": comm_s * 1e3, "work alone (ms)": work_s * 1e3,
                     "comm, then work (ms)": serial_s * 1e3, "work during async comm (ms)": overlapped_s * 1e3,
                     "saved": 1 - overlapped_s / serial_s})
    return rows
# [end: overlap]


# [start: future]
def mean_via_future(ctx):
    x = torch.full((3,), float(ctx.rank))
    fut = dist.all_reduce(x, async_op=True).get_future()
    mean = fut.then(lambda f: f.value()[0] / ctx.world_size).wait()  # runs once the sum has arrived
    expected = (ctx.world_size - 1) / 2  # mean of 0..n-1
    assert torch.allclose(mean, torch.full((3,), expected)), f"rank {ctx.rank}: mean {mean.tolist()}"
    return mean[0].item()
# [end: future]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--late", type=float, default=0.3, help="seconds ranks other than 0 arrive late")
    parser.add_argument("--numel", type=int, default=2_000_000, help="floats all-reduced in the overlap test")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.late <= 0 or args.numel < 1 or args.repeats < 1:
        parser.error("--late must be positive, --numel and --repeats at least 1")

    ctx = lessonlib.setup()
    row = lessonlib.report("wait", read_before_wait(ctx, args.late))
    print(f"completed at once: {row['completed right after the call']}; x before wait(): "
          f"{row['x before wait()']}, after: {row['x after wait()']}")
    row = lessonlib.report("write_before_wait", write_before_wait(ctx, args.late))
    print(f"rank 0 wrote to x before wait(): result {row['got']}, the sum of the inputs is {row['expected']}")
    for row in lessonlib.report("overlap", overlap(ctx, args.numel, args.repeats)):
        print(f"{row['work']}: comm {row['comm alone (ms)']:.1f} ms, work {row['work alone (ms)']:.1f} ms, "
              f"serial {row['comm, then work (ms)']:.1f} ms, overlapped {row['work during async comm (ms)']:.1f} ms")
    print(f"mean over ranks via a future: {lessonlib.report('future', mean_via_future(ctx))}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
