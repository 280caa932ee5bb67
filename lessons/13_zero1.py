"""torchrun --nproc_per_node=3 lessons/13_zero1.py

ZeRO-1 by hand: every rank keeps the whole weights, and Adam's state for its own slice of them only.

Options: --variants reduce-scatter,broadcast (default: both); --steps 3.

The model, data and one-process reference are lessons/13_memory.py's (float32, P = 31841 parameters).
The parameters are flattened into one vector, zero-padded to N * ceil(P/N), and cut into N equal
slices; rank r's Adam is built on slice r alone. Each step, after the usual backward:
  reduce-scatter: the flat gradients are reduce-scattered (SUM, then / N: gloo has no AVG), so each
    rank gets the mean gradient of its slice; Adam updates the slice; all_gather_single puts every
    updated slice on every rank, copied back into the model.
  broadcast: the other common write-up (ZeroRedundancyOptimizer's): all-reduce the whole gradient,
    update the own slice, then each rank broadcasts its slice to the others.
Asserted at every world size: the weights equal one process's trained on the whole batch (TOL); each
rank's optimizer state is 8 * ceil(P/N) bytes plus Adam's 4-byte step (the last rank's slice ends in
N * ceil(P/N) - P elements of padding, which stay zero); the collectives each step makes; and the bytes
each rank sent in the last step (lessonlib.sharding.Traffic, /proc/self/io), within 2% of
lessonlib.sharding.sent_per_step with gloo's reduce-scatter (an all-reduce): 3(N-1)/N * 4P per rank, for
both variants. Each broadcast is a tree in which the root sends most, but every rank is the root once,
so the ranks end up sending the same.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lessonlib
from lessonlib.exercises import load_function
from lessonlib.sharding import Traffic, held, optimizer_state, sent_per_step

HERE = os.path.dirname(os.path.abspath(__file__))
model, batch, train = (load_function(os.path.join(HERE, "13_memory.py"), f) for f in ("model", "batch", "train"))
LR = 1e-2
TOL = 1e-6  # float32, as lessons/13_memory.py (measured here: 1.7e-7 to 3.5e-7 at 2 to 4 ranks)
VARIANTS = ("reduce-scatter", "broadcast")


# [start: flat]
def flatten(tensors, world_size):
    """One flat vector of `tensors`, zero-padded to N * ceil(P / N) elements: N equal slices."""
    flat = torch.cat([t.detach().flatten() for t in tensors])
    return F.pad(flat, (0, world_size * math.ceil(flat.numel() / world_size) - flat.numel()))


def copy_back(full, params):
    """The whole flat weights back into the model's parameters; the padding at the end stays out."""
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(full[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


# [end: flat]


# [start: step]
def zero1_step(net, mine, opt):
    """After backward: the mean gradient of my slice, Adam on my slice, every slice back to every rank."""
    n = dist.get_world_size()
    grads = flatten([p.grad for p in net.parameters()], n)
    grad = torch.empty_like(mine)
    dist.reduce_scatter_single(grad, grads)  # my slice of the sum over ranks (gloo has no AVG)
    mine.grad = grad / n  # the mean, as DDP's
    opt.step()  # Adam's moments exist for my slice only
    full = torch.empty_like(grads)
    dist.all_gather_single(full, mine.detach())
    copy_back(full, list(net.parameters()))


# [end: step]


# [start: broadcast]
def zero1_step_broadcast(net, mine, opt):
    """The same update: every gradient all-reduced, my slice updated, each slice broadcast by its owner."""
    n, rank = dist.get_world_size(), dist.get_rank()
    grads = flatten([p.grad for p in net.parameters()], n)
    dist.all_reduce(grads)  # the whole sum on every rank; each uses one slice of it
    mine.grad = grads.view(n, -1)[rank] / n
    opt.step()
    full = flatten(net.parameters(), n).view(n, -1)
    full[rank] = mine.detach()
    for owner in range(n):
        dist.broadcast(full[owner], src=owner)  # a row of `full`: contiguous, received in place
    copy_back(full.flatten(), list(net.parameters()))


# [end: broadcast]


def run(variant, ctx, steps):
    """Train `steps` steps with ZeRO-1; the model, this rank's slice and optimizer, the last step's Traffic."""
    n, rank = ctx.world_size, ctx.rank
    net = model()
    # [start: slice]
    flat = flatten(net.parameters(), n)
    shard = flat.numel() // n  # ceil(P / N)
    mine = flat[rank * shard : (rank + 1) * shard].clone().requires_grad_()  # my slice, my copy
    opt = torch.optim.Adam([mine], lr=LR)  # its state: 2 x 4 x ceil(P / N) bytes, and a step
    # [end: slice]
    step_fn = zero1_step if variant == "reduce-scatter" else zero1_step_broadcast
    for step in range(steps):
        x, y = batch(step)  # the global batch; 12 rows split evenly at 1 to 4 ranks
        rows = slice(rank * len(x) // n, (rank + 1) * len(x) // n)
        net.zero_grad()
        F.mse_loss(net(x[rows]), y[rows]).backward()
        with Traffic() as traffic:  # nothing may print in here: stdout's bytes would count as sent
            step_fn(net, mine, opt)
    return net, mine, opt, traffic


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--variants", type=lessonlib.comma_list(choices=VARIANTS), default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective waits (default: 30)")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout or 30)
    n, rank = ctx.world_size, ctx.rank
    alone = model()
    train(alone, torch.optim.Adam(alone.parameters(), lr=LR), args.steps)
    P = sum(p.numel() for p in alone.parameters())
    shard = math.ceil(P / n)
    for variant in args.variants:
        net, mine, opt, traffic = run(variant, ctx, args.steps)
        gap = max((a - b).abs().max().item() for a, b in zip(net.parameters(), alone.parameters()))
        assert gap < TOL, f"rank {rank}: {variant}: weights {gap:.1e} from one process's (tolerance {TOL})"
        state = held(optimizer_state(opt))
        assert state == 8 * shard + 4, f"rank {rank}: {state} B of Adam state, expected 8 * {shard} + 4"
        padding = max(0, (rank + 1) * shard - P)  # the slice's elements past the last parameter
        assert not mine[shard - padding :].any(), f"rank {rank}: the padding moved"
        calls = (
            {"reduce_scatter": 1, "all_gather": 1} if variant == "reduce-scatter" else {"all_reduce": 1, "broadcast": n}
        )
        assert dict(traffic.calls) == calls, f"rank {rank}: {variant}: collectives {dict(traffic.calls)}"
        model_sent = sent_per_step(P, n, "zero1", reduce_scatter="allreduce")
        if traffic.sent is not None:  # gloo frames each message with a small header: within 2%
            assert abs(traffic.sent - model_sent) <= 0.02 * model_sent, f"rank {rank}: {variant}: sent {traffic.sent} B"
        row = {
            "variant": variant,
            "rank": rank,
            "slice": [rank * shard, (rank + 1) * shard],
            "padding": padding,
            "optimizer state": state,
            "sent": traffic.sent,
            "model": model_sent,  # and for comparison: DDP's all-reduce, and ZeRO-1 with a ring reduce-scatter
            "ddp model": sent_per_step(P, n, "ddp"),
            "ring model": sent_per_step(P, n, "zero1"),
            "calls": dict(traffic.calls),
            "weights gap": gap,
        }
        lessonlib.report("zero1", row)
        sent = "not measured (no /proc/self/io: not Linux)" if traffic.sent is None else f"{traffic.sent} B"
        print(f"rank {rank} {variant:14}: state {state} B (padding {padding}), sent {sent}, {gap:.0e} off")
        if ctx.is_main:
            print(f"  {variant}: sent_per_step predicts {model_sent:.0f} B per rank (gloo's reduce-scatter)")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
