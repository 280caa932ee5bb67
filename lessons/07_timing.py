"""torchrun --nproc_per_node=2 lessons/07_timing.py

What averaging gradients costs: one all_reduce per tensor, one flat all_reduce, DDP's buckets.

Options: --layers 16, --steps 3, --caps 0.01,0.5,25 (the defaults).

Every variant trains the same model (many small Linear layers, float32) from the same weights on the
same per-rank batches, with SGD on an MSE loss: no communication at all (the floor), one all_reduce
per parameter tensor after backward, one all_reduce on all gradients flattened into one tensor, DDP
with its default buckets, and DDP with bucket_cap_mb swept. A step is forward + backward + averaging
+ optimizer step, timed after a warm-up (DDP lays out its buckets again after its first iteration);
each rank starts it at a barrier and the job's time for a step is the slowest rank's. The variants take
turns, one step each, so that load from elsewhere on the machine falls on all of them alike. Asserted, not
speed, which depends on the machine: after one step the per-tensor, flat and DDP variants hold the
same weights, and the all_reduce calls per step are what they must be (one per tensor, one, one per
DDP bucket, fewer buckets for a bigger cap).
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib

WARMUP = 2  # DDP's first iteration uses one bucket for everything; its real buckets start at the second
TOL = 1e-6


def build(layers, width):
    torch.manual_seed(0)  # the same starting weights in every variant, on every rank
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])


# [start: per_tensor]
def per_tensor(model, all_reduce, world_size):
    for p in model.parameters():  # one collective per tensor: many tiny messages
        all_reduce(p.grad)
        p.grad /= world_size


# [end: per_tensor]


# [start: flat]
def flat(model, all_reduce, world_size):
    grads = [p.grad for p in model.parameters()]
    buffer = torch.cat([g.flatten() for g in grads])  # one big message, at the price of two copies
    all_reduce(buffer)
    buffer /= world_size
    for g, part in zip(grads, buffer.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


# [end: flat]


def variant(name, cap, args, world_size):
    """(module to call, averaging to run after backward, all_reduce call counter) for one variant."""
    model, calls = build(args.layers, args.width), [0]

    def counted(t):
        calls[0] += 1
        dist.all_reduce(t)

    def hook(state, bucket):  # the all-reduce DDP runs anyway, counted
        calls[0] += 1
        return allreduce_hook(None, bucket)

    if name == "local":
        return model, lambda: None, calls
    if name in ("per-tensor", "flat"):
        average = per_tensor if name == "per-tensor" else flat
        return model, lambda: average(model, counted, world_size), calls
    ddp = DDP(model) if cap is None else DDP(model, bucket_cap_mb=cap)
    ddp.register_comm_hook(None, hook)
    return ddp, lambda: None, calls  # DDP has averaged by the time backward() returns


def measure(variants, batches, steps):
    """Per variant: median ms per step (the slowest rank's), all_reduce calls per step, weights after step 1.

    The variants take turns, one step each, in an order that rotates every step: a burst of load from
    elsewhere on the machine then slows every variant alike instead of the one that happened to be running.
    """
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net, _, _ in variants]
    times = torch.zeros(len(variants), len(batches), dtype=torch.float64)
    after_one = [None] * len(variants)
    for i, (x, y) in enumerate(batches):
        for k in range(len(variants)):
            v = (i + k) % len(variants)
            (net, sync, calls), opt = variants[v], opts[v]
            if i == WARMUP:
                calls[0] = 0
            dist.barrier()  # all ranks start the step together
            start = time.perf_counter()
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            sync()
            opt.step()
            times[v, i] = time.perf_counter() - start
            if i == 0:
                after_one[v] = torch.cat([p.detach().flatten() for p in net.parameters()])
    slowest = times[:, WARMUP:].contiguous()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is over when its slowest rank is done
    results = []
    for (_, _, calls), row, weights in zip(variants, slowest, after_one):
        assert calls[0] % steps == 0, f"{calls[0]} all_reduce calls in {steps} steps: not the same every step"
        results.append((row.median().item() * 1e3, calls[0] // steps, weights))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--layers", type=int, default=16, choices=range(1, 129), metavar="1..128")
    parser.add_argument("--width", type=int, default=128, choices=range(1, 1025), metavar="1..1024")
    parser.add_argument("--batch", type=int, default=32, choices=range(1, 1025), metavar="1..1024")
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 201), metavar="1..200")
    parser.add_argument(
        "--caps",
        type=lessonlib.comma_list(float, low=0.001, high=100),
        default="0.01,0.5,25",
        metavar="MB,MB,...",
        help="bucket_cap_mb values to sweep (MiB)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu")
    n, r = ctx.world_size, ctx.rank
    caps = sorted(set(args.caps))
    g = torch.Generator().manual_seed(r)  # each rank its own data, the same for every variant
    batches = [
        (torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g))
        for _ in range(WARMUP + args.steps)
    ]
    tensors = 2 * args.layers

    names = [("local", None), ("per-tensor", None), ("flat", None), ("DDP default", None), *[("DDP", c) for c in caps]]
    measured = measure([variant(name, cap, args, n) for name, cap in names], batches, args.steps)
    rows, weights = [], {}
    for (name, cap), (ms, per_step, after_one) in zip(names, measured):
        weights[name, cap] = after_one
        rows.append(
            {"variant": name, "bucket_cap_mb": cap, "all_reduces_per_step": per_step, "median_ms": round(ms, 3)}
        )

    want = weights["per-tensor", None]
    for (name, cap), got in weights.items():
        gap = (got - want).abs().max().item()
        # Without averaging, the local model must drift from the others: the check would catch a missing sync.
        assert (gap <= TOL) == (name != "local" or n == 1), f"rank {r}: {name} {cap}: {gap:.1e} from per-tensor"
    counts = {(row["variant"], row["bucket_cap_mb"]): row["all_reduces_per_step"] for row in rows}
    assert counts["local", None] == 0 and counts["per-tensor", None] == tensors and counts["flat", None] == 1, counts
    swept = [counts["DDP", c] for c in caps]
    assert min(swept) >= 1 and swept == sorted(swept, reverse=True), f"buckets by cap {caps}: {swept}"
    if ctx.is_main:
        print(
            f"{n} rank(s), {args.layers} x Linear({args.width}, {args.width}) = {tensors} tensors, "
            f"batch {args.batch}, median of {args.steps} steps, slowest rank"
        )
        print(f"{'variant':12} {'cap MB':>7} {'all_reduces':>11} {'ms/step':>8}")
        for row in rows:
            lessonlib.report("timing", row)
            cap = "-" if row["bucket_cap_mb"] is None else f"{row['bucket_cap_mb']:g}"
            print(f"{row['variant']:12} {cap:>7} {row['all_reduces_per_step']:>11} {row['median_ms']:>8.2f}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
