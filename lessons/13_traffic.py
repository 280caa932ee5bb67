"""torchrun --nproc_per_node=4 lessons/13_traffic.py

What each rank sends: the bytes the kernel saw leave the process, and the collectives that sent them.

Options: --parts collectives,step (the default: both); --mib 1 (part 1's tensor); --width 384 --layers 4
(part 2's model); --pg-timeout S.

Bytes are measured, not assumed: lessonlib.sharding.Traffic reads /proc/self/io's wchar (every byte the
process passed to write(), writev() and the like, which gloo's TCP transport sends with) before and after,
and counts the c10d collectives inside by name.
  1. collectives: one tensor of B bytes through all_reduce, all_gather_single (output B),
     reduce_scatter_single (input B) and broadcast. Asserted per rank against the ring model, within TOL:
     all_reduce 2(N-1)/N*B, all_gather (N-1)/N*B; gloo's reduce-scatter sends 2(N-1)/N*B, twice the
     ring's (N-1)/N*B (it is an all-reduce of the whole tensor); broadcast is a tree, the ranks send
     unequal shares (reported), their sum is (N-1)*B (asserted).
  2. step: one training step (Adam) of the same model under DDP, ZeRO-1 (ZeroRedundancyOptimizer) and
     FSDP (fully_shard per Linear + root), measured after two warm-up steps (DDP's second rebuilds its
     buckets, with 2 more broadcasts: asserted). Each rank's bytes against lessonlib.sharding.sent_per_step, by the
     ring model (NCCL) and by gloo's (reduce_scatter="allreduce"), asserted against gloo's; the calls by
     kind, asserted. ZeroRedundancyOptimizer broadcasts each parameter from the rank that owns it: the
     ranks send unequal bytes, so their mean is asserted. FSDP sends 1.5x DDP's bytes by the ring model,
     2x on gloo (asserted); what it buys is memory: the bytes of weights, gradients and Adam state each
     rank holds, reported, FSDP's asserted to be 1/N of DDP's (lessons/13_memory.py measures them all).
At world size 1 nothing is sent (asserted: 0 bytes). Where /proc/self/io does not exist (not Linux),
the byte assertions are skipped with a printed reason; the call counts are still asserted.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.sharding import Traffic, held, optimizer_state, sent_per_step

TOL = 0.01  # relative: gloo frames every message with a small header (measured: 0.03% to 0.3% here)
ROWS = 8  # rows per rank and step
# Warm-ups run inside a Traffic block too: the first collective under its dispatch mode imports
# torch._dynamo, which finds a temporary folder by writing a 4-byte test file, and wchar counts files.
PARTS = ("collectives", "step")


def within(got, want, n):
    return got == 0 if n == 1 else abs(got - want) <= TOL * want


# [start: collectives]
def collectives(n, numel):
    """Each collective on a float32 tensor of B = 4 * numel bytes; what this rank sent, by name."""
    x, part, whole = torch.ones(numel), torch.empty(numel // n), torch.empty(numel)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather_single(whole, part),  # output: B
        "reduce_scatter": lambda: dist.reduce_scatter_single(part, x),  # input: B
        "broadcast": lambda: dist.broadcast(x, src=0),
    }
    sent = {}
    for name, call in calls.items():
        for _ in range(2):  # the first is a warm-up, the second is measured
            dist.barrier()  # every rank is done with the last call before anyone measures
            with Traffic() as t:  # nothing may print in here: stdout is a pipe, its bytes would count
                call()
        sent[name] = t.sent
    return sent


# [end: collectives]


def ring_model(n, b):
    """Bytes one rank sends by the ring model (NCCL), and on gloo, per collective of a B-byte tensor."""
    one = (n - 1) / n * b
    ring = {"all_reduce": 2 * one, "all_gather": one, "reduce_scatter": one, "broadcast": one}
    return ring, {**ring, "reduce_scatter": 2 * one}  # broadcast: the mean over ranks


def part_collectives(ctx, mib):
    n, rank = ctx.world_size, ctx.rank
    numel = max(n, int(mib * 2**20 / 4) // n * n)  # a multiple of N: N equal parts
    b = 4 * numel
    sent = collectives(n, numel)
    ring, gloo = ring_model(n, b)
    lessonlib.report("collectives", {"rank": rank, "world_size": n, "B": b, "sent": sent, "ring": ring, "gloo": gloo})
    if sent["all_reduce"] is None:
        print(f"rank {rank}: /proc/self/io is missing (not Linux): byte assertions skipped")
        return
    every = [None] * n
    dist.all_gather_object(every, sent)
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        got = sent[name]
        assert within(got, gloo[name], n), f"rank {rank}: {name} sent {got} B, model {gloo[name]:.0f} (B={b})"
    if n > 1:  # gloo's reduce-scatter: twice what a ring reduce-scatter sends
        assert abs(sent["reduce_scatter"] / ring["reduce_scatter"] - 2) < 2 * TOL, f"rank {rank}: {sent}"
    total = sum(s["broadcast"] for s in every)  # a tree: unequal shares, (N-1)*B in all
    assert within(total, (n - 1) * b, n), f"rank {rank}: broadcast sent {total} B in all, want {(n - 1) * b}"
    print(f"rank {rank}: " + ", ".join(f"{k} {v / b:.4f} B" for k, v in sent.items()))
    if ctx.is_main:
        print(
            f"  B = {b} bytes; ring model per rank: all_reduce {2 * (n - 1) / n:.3f} B, the others {(n - 1) / n:.3f} B"
        )


def model(width, layers):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])


# [start: strategies]
def build(strategy, width, layers, n):
    net = model(width, layers)
    if strategy == "ddp":
        # 25 passed: one bucket, so one all-reduce per step (chapter 7); the bucket is the .grad, as in 13_memory
        net = DDP(net, bucket_cap_mb=25, gradient_as_bucket_view=True)
        return net, torch.optim.Adam(net.parameters())
    if strategy == "zero1":  # the same all-reduce, then each rank updates the parameters it owns
        net = DDP(net, bucket_cap_mb=25, gradient_as_bucket_view=True)
        return net, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam)
    mesh = init_device_mesh("cpu", (n,))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # one unit per Linear: its own all-gathers and reduce-scatter
    fully_shard(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters())


def step(net, opt, x, y):
    opt.zero_grad()
    F.mse_loss(net(x), y).backward()
    opt.step()


# [end: strategies]


def expected_calls(strategy, layers, n):
    if strategy == "ddp":
        return {"all_reduce": 1}
    if strategy == "zero1":  # and a broadcast per parameter tensor, from the rank that updated it
        return {"all_reduce": 1, "broadcast": 2 * layers}
    return {"all_gather": 2 * layers, "reduce_scatter": layers} if n > 1 else {}  # one rank: FSDP skips them


def part_step(ctx, width, layers):
    n, rank = ctx.world_size, ctx.rank
    p = sum(q.numel() for q in model(width, layers).parameters())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(ROWS, width, generator=g), torch.randn(ROWS, width, generator=g)
    rows = {}
    for strategy in ("ddp", "zero1", "fsdp"):
        net, opt = build(strategy, width, layers, n)
        for _ in range(2):  # warm-up: DDP rebuilds its buckets in the second step (2 broadcasts)
            with Traffic() as second:
                step(net, opt, x, y)
        dist.barrier()
        # [start: measure]
        with Traffic() as t:
            step(net, opt, x, y)
        # [end: measure]
        state = optimizer_state(opt.optim if strategy == "zero1" else opt)
        rows[strategy] = {
            "rank": rank,
            "world_size": n,
            "strategy": strategy,
            "params": p,
            "sent": t.sent,
            "ring": sent_per_step(p, n, strategy),
            "gloo": sent_per_step(p, n, strategy, reduce_scatter="allreduce"),
            "calls": dict(t.calls),
            "held": held([*net.parameters(), *(q.grad for q in net.parameters()), *state]),
        }
        want = expected_calls(strategy, layers, n)
        assert dict(t.calls) == want, f"rank {rank}: {strategy}: collectives {dict(t.calls)}, expected {want}"
        if strategy != "fsdp":
            extra = dict(second.calls - t.calls)
            assert extra == {"broadcast": 2}, f"rank {rank}: {strategy}'s second step also called {extra}"
        lessonlib.report("step", rows[strategy])
    fsdp, ddp = rows["fsdp"], rows["ddp"]
    # What FSDP buys: weights, gradients and Adam's two moments, 1/N of DDP's on each rank.
    assert abs(fsdp["held"] - ddp["held"] / n) <= TOL * ddp["held"] / n, f"rank {rank}: held {fsdp['held']} B"
    assert n == 1 or fsdp["ring"] / ddp["ring"] == 1.5, "the ring model: 3 collectives of (N-1)/N against 2"
    every = [None] * n
    dist.all_gather_object(every, rows)
    if ddp["sent"] is None:
        print(f"rank {rank}: /proc/self/io is missing (not Linux): byte assertions skipped, call counts checked")
        return
    for s in ("ddp", "fsdp"):  # every rank sends the same
        got, want = rows[s]["sent"], rows[s]["gloo"]
        assert within(got, want, n), f"rank {rank}: {s} sent {got} B per step, gloo's model {want:.0f}"
    mean = sum(r["zero1"]["sent"] for r in every) / n  # whole tensors per rank: unequal shares
    assert within(mean, rows["zero1"]["gloo"], n), f"rank {rank}: zero1 sent {mean:.0f} B per rank on average"
    if n > 1:
        ratio = fsdp["sent"] / ddp["sent"]
        assert abs(ratio - 2) < 2 * TOL, f"rank {rank}: FSDP sent {ratio:.3f}x DDP's bytes, expected 2x on gloo"
    m = 4 * p  # the model's bytes
    print(f"rank {rank}: sent per step " + ", ".join(f"{s} {r['sent'] / m:.3f}" for s, r in rows.items()) + " x M")
    if ctx.is_main:
        print(f"  M = {m} bytes ({p} parameters); per rank, ring model / gloo's (x M), and the calls:")
        for s, r in rows.items():
            print(f"    {s}: {r['ring'] / m:.3f} / {r['gloo'] / m:.3f}, {r['calls']}, holding {r['held']} B")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: collectives, step")
    parser.add_argument("--mib", type=float, default=1.0, help="part 1's tensor, in MiB (0.01..64)")
    parser.add_argument("--width", type=int, default=384, choices=range(12, 2049, 12), metavar="12..2048 (x12)")
    parser.add_argument("--layers", type=int, default=4, choices=range(1, 17), metavar="1..16")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective may wait (default 30)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS) or not 0.01 <= args.mib <= 64:
        parser.error(f"--parts takes {', '.join(PARTS)}; --mib 0.01..64")
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout or 30)
    if "collectives" in parts:
        part_collectives(ctx, args.mib)
    if "step" in parts:
        part_step(ctx, args.width, args.layers)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
