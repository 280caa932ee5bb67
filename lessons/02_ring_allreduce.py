"""torchrun --nproc_per_node=4 lessons/02_ring_allreduce.py

A ring all-reduce built from isend/irecv, checked against dist.all_reduce, with every byte counted.

The tensor is cut into n chunks (n = world size; lengths that n does not divide give chunks that
differ by one element, some possibly empty). Each rank talks only to its two neighbours:
  reduce-scatter, n-1 steps: send one chunk right, receive one from the left, add it in. Afterwards
                  rank r holds the complete sum of chunk r+1.
  all-gather,     n-1 steps: pass the completed chunks around the ring, overwriting.
Each rank sends 2(n-1)/n of the tensor, however large n is. Two schemes that tutorials also call
"ring" are counted beside it: passing the whole tensor around (n-1 times the tensor per rank) and a
star through rank 0 (rank 0 moves 2(n-1) tensors). All three must equal dist.all_reduce exactly on
integer tensors of every --lengths (asserted); the bytes each rank sent must match the closed form.
"""

import argparse
import time

import torch
import torch.distributed as dist

import lessonlib


class Link:
    """Sends to the right neighbour and receives from the left one, counting elements sent."""

    def __init__(self, rank, n):
        self.right, self.left, self.sent = (rank + 1) % n, (rank - 1) % n, 0

    def exchange(self, outgoing, incoming):
        # An empty chunk is not sent. The chunk I send is the one my right neighbour receives, so
        # each direction is skipped on both of its ends; my own two chunks may differ in size.
        send = dist.isend(outgoing, dst=self.right) if outgoing.numel() else None  # not a blocking
        if incoming.numel():  # send: on gloo every
            dist.recv(incoming, src=self.left)  # rank would wait
        if send is not None:
            send.wait()
            self.sent += outgoing.numel()


# [start: ring]
def ring_all_reduce(x, snapshots=None):
    """Sum x over all ranks, in place, with 2(n-1) neighbour exchanges of one chunk each."""
    n, r = dist.get_world_size(), dist.get_rank()
    link = Link(r, n)
    chunks = x.view(-1).tensor_split(n)  # views into x: writing a chunk writes x
    for step in range(n - 1):  # reduce-scatter
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        link.exchange(chunks[send_i], incoming)
        chunks[recv_i].add_(incoming)
        if snapshots is not None:
            snapshots.append(x.tolist())
    for step in range(n - 1):  # all-gather: chunk (r + 1) is complete here; pass it on
        send_i, recv_i = (r + 1 - step) % n, (r - step) % n
        link.exchange(chunks[send_i], chunks[recv_i])
        if snapshots is not None:
            snapshots.append(x.tolist())
    return link.sent


# [end: ring]


def whole_tensor_ring(x):
    """Pass the whole running sum around the ring: correct, but each rank sends (n-1) full tensors."""
    n, r = dist.get_world_size(), dist.get_rank()
    link, travelling = Link(r, n), x.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(travelling)
        link.exchange(travelling, incoming)
        travelling = incoming
        x.add_(incoming)  # after n-1 steps every other rank's tensor has passed through here once
    return link.sent


def star(x):
    """Everyone sends to rank 0, which sums and sends the total back: rank 0 carries it all."""
    n, r = dist.get_world_size(), dist.get_rank()
    sent = 0
    if r == 0:
        incoming = torch.empty_like(x)
        for peer in range(1, n):
            dist.recv(incoming, src=peer)
            x.add_(incoming)
        for peer in range(1, n):
            dist.send(x, dst=peer)
            sent += x.numel()
    else:
        dist.send(x, dst=0)
        dist.recv(x, src=0)
        sent += x.numel()
    return sent


def expected_sent(length, n, r):
    """Closed form for the chunked ring: rank r sends every chunk but r+1, then every chunk but r+2."""
    sizes = [length // n + (1 if i < length % n else 0) for i in range(n)]  # how tensor_split cuts
    return 0 if n == 1 else 2 * length - sizes[(r + 1) % n] - sizes[(r + 2) % n]


def check_lengths(ctx, lengths):
    n, r = ctx.world_size, ctx.rank
    rows = []
    for length in lengths:
        g = torch.Generator().manual_seed(1000 * length + r)  # different data on every rank
        x = torch.randint(-1000, 1000, (length,), generator=g).to(ctx.device)
        want = x.clone()
        dist.all_reduce(want)
        row = {"length": length}
        for name, fn in [("ring", ring_all_reduce), ("whole-tensor ring", whole_tensor_ring), ("star", star)]:
            got = x.clone()
            row[f"{name} sent"] = fn(got)
            assert torch.equal(got, want), (
                f"rank {r}: {name} all-reduce differs from dist.all_reduce at length {length}"
            )
        assert row["ring sent"] == expected_sent(length, n, r), (
            f"rank {r}: ring sent {row['ring sent']} at length {length}"
        )
        assert row["whole-tensor ring sent"] == (n - 1) * length
        rows.append(row)
    return rows


def timing(ctx, numel, repeats):
    """Best-of-`repeats` time of the ring and of dist.all_reduce on the same floats; their difference."""
    big = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    times, results = {}, {}
    for name, fn in [("ring_all_reduce", ring_all_reduce), ("dist.all_reduce", dist.all_reduce)]:
        best = float("inf")
        for _ in range(repeats):
            y = big.clone()
            dist.barrier()
            start = time.perf_counter()
            fn(y)
            if y.is_cuda:
                torch.cuda.synchronize()  # on a GPU the call returns before the work is done
            best = min(best, time.perf_counter() - start)
        times[name], results[name] = best, y
    ring, ref = results["ring_all_reduce"], results["dist.all_reduce"]
    diff = (ring - ref).abs().max().item()  # float sums taken in another order differ by rounding
    assert torch.allclose(ring, ref, rtol=1e-5, atol=1e-5), f"rank {ctx.rank}: float ring differs by {diff}"
    return {**{k + " (ms)": v * 1e3 for k, v in times.items()}, "max |ring - all_reduce|": diff}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--lengths",
        type=lessonlib.comma_list(int, low=1),
        default="1,2,3,4,5,7,10,1000,1001",
        help="tensor lengths to check, comma-separated",
    )
    parser.add_argument("--numel", type=int, default=1_000_000, help="float32 elements for the timing")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = args.lengths
    if args.numel < 1 or args.repeats < 1:
        parser.error("--numel and --repeats must be at least 1")

    ctx = lessonlib.setup()
    n, r = ctx.world_size, ctx.rank
    rows = lessonlib.report("sent", check_lengths(ctx, lengths))
    print(f"rank {r}: ring, whole-tensor ring and star all equal dist.all_reduce for lengths {lengths}")
    print(
        f"rank {r}: elements sent for length {rows[-1]['length']}: "
        + ", ".join(f"{k[:-5]} {v}" for k, v in rows[-1].items() if k != "length")
    )

    x = torch.full((n,), 10**r, dtype=torch.int64, device=ctx.device)  # the digits of the sum say which ranks are in it
    snapshots = [x.tolist()]
    ring_all_reduce(x, snapshots)
    assert x.tolist() == [int("1" * n)] * n, f"rank {r}: {x.tolist()}"
    lessonlib.report("steps", snapshots)

    row = lessonlib.report("timing", timing(ctx, args.numel, args.repeats))
    if ctx.is_main:
        print(
            f"{args.numel} floats: ring {row['ring_all_reduce (ms)']:.1f} ms, dist.all_reduce "
            f"{row['dist.all_reduce (ms)']:.1f} ms, max float difference {row['max |ring - all_reduce|']:.2e}"
        )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
