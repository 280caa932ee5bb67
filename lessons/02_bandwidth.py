"""torchrun --nproc_per_node=2 lessons/02_bandwidth.py

Latency and bandwidth of collectives against message size, on this machine, with this backend.

For each op and size: two warm-up calls, three calls to estimate the time per call, then as many
timed calls as fill --min-seconds (the ranks agree on that count: they must all make the same
calls). A collective is as slow as its slowest rank, so each size's time is the maximum over ranks
of the per-call mean. Two bandwidths follow, as in nccl-tests:
  algbw = S / t, where S is the data one rank ends up with (all_reduce, broadcast: the tensor;
          all_gather: the gathered output; reduce_scatter: the input it reduces);
  busbw = algbw x factor, the rate each rank's link carries under the ring algorithm: 2(n-1)/n for
          all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for broadcast. Comparable across
          world sizes. (gloo's reduce_scatter is an all-reduce underneath and moves twice the ring's
          bytes: chapter 13 measures the bytes each rank sends.)
Beside them: this machine's memory-copy bandwidth (every rank copying at once, as during a collective),
the ceiling for any transfer between processes on one machine.
"""

import argparse
import time

import torch
import torch.distributed as dist

import lessonlib

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


# [start: bus_factor]
def bus_factor(op, n):
    """How much data each rank must move per byte of S; 0 at n = 1, where nothing moves."""
    return {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,  # the ring's; gloo's sends twice this (chapter 13)
        "broadcast": 1.0 if n > 1 else 0.0,
    }[op]


# [end: bus_factor]


def make_call(op, nbytes, n, device):
    """`op` on float32 data of S = nbytes: the call, and a check that fills rank-dependent values,
    runs the call once more and compares with the closed form."""
    numel = max(nbytes // 4 // n * n, n)  # a multiple of n, so every rank's share is equal
    r = dist.get_rank()
    if op == "all_reduce":
        x = out = torch.zeros(numel, device=device)  # zeros: the timed calls keep the data finite
        call = lambda: dist.all_reduce(x)  # noqa: E731
        expected = n * (n + 1) / 2  # sum of (rank + 1)
    elif op == "broadcast":
        x = out = torch.zeros(numel, device=device)
        call = lambda: dist.broadcast(x, src=0)  # noqa: E731
        expected = 1.0  # rank 0's value, rank + 1
    elif op == "all_gather":
        x, out = torch.zeros(numel // n, device=device), torch.empty(numel, device=device)
        call = lambda: dist.all_gather_single(out, x)  # noqa: E731
        expected = torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat_interleave(numel // n)
    else:
        x, out = torch.zeros(numel, device=device), torch.empty(numel // n, device=device)
        call = lambda: dist.reduce_scatter_single(out, x)  # noqa: E731
        expected = n * (n + 1) / 2

    def check():
        x.fill_(r + 1)
        call()
        assert torch.all(out == expected), f"rank {r}: {op} of {numel * 4} bytes gave {out[:4].tolist()}..."

    return call, check, numel


# [start: measure]
def measure(op, nbytes, n, min_seconds, device):
    call, check, numel = make_call(op, nbytes, n, device)
    if device.type == "cuda":  # a GPU collective returns once queued: wait for the GPU before the clock
        queue = call
        call = lambda: (queue(), torch.cuda.synchronize())  # noqa: E731
    for _ in range(2):
        call()  # warm-up: first calls set up buffers and connections
    dist.barrier()
    start = time.perf_counter()
    for _ in range(3):
        call()
    # Every rank must make the same number of calls: a rank that stops early leaves the others in a
    # collective it never joins. So the ranks agree on the count (the largest estimate) first.
    per_call = max(time.perf_counter() - start, 1e-9) / 3
    calls = torch.tensor([max(3, min(1000, int(min_seconds / per_call)))], device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls.item()):
        call()
    mean = torch.tensor([(time.perf_counter() - start) / calls.item()], device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    check()
    seconds, size = mean.item(), numel * 4
    return {
        "op": op,
        "bytes": size,
        "calls": calls.item(),
        "time (us)": seconds * 1e6,
        "algbw (GB/s)": size / seconds / 1e9,
        "busbw (GB/s)": size / seconds / 1e9 * bus_factor(op, n),
    }


# [end: measure]


def memcpy_bandwidth(nbytes, device, repeats=5):
    """Copy bandwidth on this rank's device (host memory on CPU), every rank copying at once."""
    src, dst = torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
    dst.copy_(src)
    dist.barrier()  # all ranks copy at the same time, as they would during a collective
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--ops",
        type=lessonlib.comma_list(choices=OPS),
        default="all_reduce,all_gather,broadcast",
        help=f"comma-separated, from {', '.join(OPS)}",
    )
    parser.add_argument("--min-bytes", type=int, default=4 << 10)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--min-seconds", type=float, default=0.05, help="time spent per size, at least")
    args = parser.parse_args()
    ops = args.ops
    if not 64 <= args.min_bytes <= args.max_bytes <= 1 << 30:
        parser.error("need 64 <= --min-bytes <= --max-bytes <= 1 GiB")

    ctx = lessonlib.setup()
    n = ctx.world_size
    sizes = []
    while (size := args.min_bytes * 4 ** len(sizes)) <= args.max_bytes:
        sizes.append(size)
    if ctx.is_main and n == 1:
        print("world size 1: nothing moves between ranks, so busbw is 0; run with 2 or more ranks")
    for op in ops:
        for nbytes in sizes:
            row = lessonlib.report("bandwidth", measure(op, nbytes, n, args.min_seconds, ctx.device))
            if ctx.is_main:
                print(
                    f"{op:<15}{row['bytes']:>10} B {row['time (us)']:>10.0f} us  algbw {row['algbw (GB/s)']:6.3f}"
                    f"  busbw {row['busbw (GB/s)']:6.3f} GB/s"
                )
    copy = lessonlib.report("memcpy", {"bytes": 64 << 20, "GB/s": memcpy_bandwidth(64 << 20, ctx.device)})
    print(f"rank {ctx.rank}: memcpy {copy['GB/s']:.2f} GB/s (64 MiB, all ranks copying at once)")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
