"""torchrun --nproc_per_node=2 lessons/13_fsdp_practice.py

Three things a real FSDP job does: gradient accumulation, gradient clipping, and a model built without memory.

Options: --parts accumulate,clip,meta (the default: all three); --blocks 4; --width 64; --micro 3 (micro-steps
per step in accumulate); --max-norm 0.05 (clip); --pg-timeout S.

The model: --blocks equal blocks (Linear + ReLU), float32, each block and the root under fully_shard, SGD;
rank r trains on its rows of a global batch, and one process on every row checks each result.
  accumulate: --micro micro-steps per optimizer step. With set_requires_gradient_sync(False) on all but
    the last, those backwards reduce-scatter nothing (asserted: 0 calls; the all-gathers still run) and
    FSDP keeps whole, unsharded gradients until the last micro-step reduce-scatters their sum (one call
    per unit). Weights after one step equal one process's on the --micro batches within TOL.
  clip: torch.nn.utils.clip_grad_norm_ on the sharded gradients returns the norm of the whole gradient
    (its DTensor result, reduced across ranks), and the clipped step equals one process's within TOL.
    The mistake: the norm of this rank's shards alone (their local tensors), smaller than the true norm
    on every rank and different from rank to rank (asserted at 2 ranks and more).
  meta: the model built on the meta device (shapes, no storage: 0 bytes), sharded, then to_empty(device=
    "cpu") allocates this rank's shards only and reset_parameters() initialises them. No rank ever holds
    the whole model (asserted: the bytes held equal its shards', at most the model's / N plus padding),
    and a training step runs. The mistake: one seed on every rank. On a CPU mesh (torch 2.14.1) each
    rank draws its shards from its own generator, so every rank draws the same numbers and each weight
    repeats rank 0's shard (asserted at 2 ranks and more). The fix: a seed per rank; then no shard
    repeats another, and the weights have nn.Linear's spread, uniform in +-1/sqrt(width) (asserted).
At world size 1 the shards are the whole model and nothing is sent; every assertion still holds.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import lessonlib
from lessonlib.sharding import Traffic, held, shard

ROWS, LR = 4, 0.1  # rows per rank and micro-step; SGD's rate
TOL = 1e-6  # float32 FSDP against one process: the same sums in another order
PARTS = ("accumulate", "clip", "meta")


def blocks(n_blocks, width):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(n_blocks)]
    )


def sharded(net, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    for block in net:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def batch(micro, width, world_size):
    g = torch.Generator().manual_seed(1000 + micro)
    x = torch.randn(ROWS * world_size, width, generator=g)
    return x, torch.sin(x)


def mine(t, rank):
    return t[rank * ROWS : (rank + 1) * ROWS]


def whole(net):
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten() for p in net.parameters()])


# [start: accumulate]
def accumulate(ctx, net, opt, micro, width):
    """One optimizer step over `micro` micro-batches; the collectives of each micro-step's backward."""
    per_micro = []
    for i in range(micro):
        net.set_requires_gradient_sync(i == micro - 1)  # reduce-scatter on the last micro-step only
        x, y = (mine(t, ctx.rank) for t in batch(i, width, ctx.world_size))
        loss = F.mse_loss(net(x), y) / micro
        with Traffic() as t:
            loss.backward()
        per_micro.append(dict(t.calls))
    opt.step()
    opt.zero_grad()
    return per_micro


# [end: accumulate]


def part_accumulate(ctx, n_blocks, width, micro):
    net = sharded(blocks(n_blocks, width), ctx.world_size)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    calls = accumulate(ctx, net, opt, micro, width)
    ref = blocks(n_blocks, width)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for i in range(micro):
        x, y = batch(i, width, ctx.world_size)
        (F.mse_loss(ref(x), y) / micro).backward()
    ref_opt.step()
    gap = (whole(net) - torch.cat([p.detach().flatten() for p in ref.parameters()])).abs().max().item()
    scatters = [c.get("reduce_scatter", 0) for c in calls]
    if ctx.world_size > 1:
        # One reduce-scatter per block on the last micro-step; the root holds no parameter of its own.
        assert scatters == [0] * (micro - 1) + [n_blocks], f"rank {ctx.rank}: {calls}"
        assert all(c.get("all_gather", 0) >= n_blocks for c in calls), f"rank {ctx.rank}: {calls}"
    assert gap <= TOL, f"rank {ctx.rank}: weights {gap} from one process"
    if ctx.is_main:
        for i, c in enumerate(calls):
            print(f"micro-step {i}: backward's collectives {dict(sorted(c.items()))}")
        print(f"after one step of {micro} micro-steps: {gap:.1e} from one process")
    lessonlib.report("accumulate", {"calls": calls, "gap": gap})


# [start: clip]
def clip(net, max_norm):
    local = torch.cat([p.grad.to_local().flatten() for p in net.parameters()]).norm()  # the mistake
    total = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)  # a DTensor: reduced over ranks
    total = total.full_tensor() if isinstance(total, DTensor) else total
    return total.item(), local.item()


# [end: clip]


def part_clip(ctx, n_blocks, width, max_norm):
    net = sharded(blocks(n_blocks, width), ctx.world_size)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = batch(0, width, ctx.world_size)
    F.mse_loss(net(mine(x, ctx.rank)), mine(y, ctx.rank)).backward()
    total, local = clip(net, max_norm)
    opt.step()
    ref = blocks(n_blocks, width)
    F.mse_loss(ref(x), y).backward()
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    gap = (whole(net) - torch.cat([p.detach().flatten() for p in ref.parameters()])).abs().max().item()
    locals_ = [None] * ctx.world_size
    dist.all_gather_object(locals_, local)
    print(f"rank {ctx.rank}: norm {total:.6f} (one process: {ref_total:.6f}); its shards' alone: {local:.6f}")
    assert abs(total - ref_total) <= TOL * max(1.0, ref_total) and ref_total > max_norm, (total, ref_total)
    assert gap <= TOL, f"rank {ctx.rank}: clipped weights {gap} from one process"
    if ctx.world_size > 1:
        assert all(v < total for v in locals_) and len(set(locals_)) == ctx.world_size, f"{locals_} vs {total}"
    # The whole gradient's norm is the root of the sum of the shards' squared norms.
    assert abs(sum(v * v for v in locals_) ** 0.5 - total) <= TOL * max(1.0, total), f"{locals_} vs {total}"
    lessonlib.report("clip", {"total": total, "one process": ref_total, "local": locals_, "gap": gap})


# [start: meta]
def build_on_meta(n_blocks, width, world_size, seed):
    with torch.device("meta"):  # shapes and dtypes only: no storage
        net = blocks(n_blocks, width)
    on_meta = all(p.is_meta for p in net.parameters())
    sharded(net, world_size)  # the shards are meta too
    net.to_empty(device="cpu")  # storage for this rank's shards, uninitialised
    # On a CPU mesh each rank fills its shards from its own generator: the same seed on every rank
    # would give every rank the same numbers. The caller passes a seed of this rank's own.
    torch.manual_seed(seed)
    for module in net.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()  # nn.Linear's own init, on the shards
    return net, on_meta


def repeats(net, world_size):
    """The parameters in which another rank's shard repeats rank 0's numbers."""
    names = []
    for name, p in net.named_parameters():
        shards = p.full_tensor().detach().chunk(world_size)  # fully_shard's split of the first dimension
        first = shards[0].flatten()
        if any(0 < s.numel() and torch.equal(s.flatten(), first[: s.numel()]) for s in shards[1:]):
            names.append(name)
    return names


# [end: meta]


def part_meta(ctx, n_blocks, width):
    n_params = len(list(blocks(n_blocks, width).parameters()))
    same, _ = build_on_meta(n_blocks, width, ctx.world_size, seed=0)  # the mistake: one seed everywhere
    copies = repeats(same, ctx.world_size)
    net, on_meta = build_on_meta(n_blocks, width, ctx.world_size, seed=1000 + ctx.rank)  # the fix
    fixed = repeats(net, ctx.world_size)
    after = held(net.parameters())
    shapes = [p.shape for p in blocks(n_blocks, width).parameters()]
    model = sum(s.numel() for s in shapes) * 4
    # fully_shard splits each parameter along its first dimension, padded to an even split
    shards = sum(shard(s[0], ctx.world_size) * (s.numel() // s[0]) for s in shapes) * 4
    print(f"rank {ctx.rank}: built on meta: {on_meta}; after to_empty it holds {after} bytes (the model: {model})")
    assert on_meta and after == shards and (after < model or ctx.world_size == 1), (after, shards, model)
    if ctx.world_size > 1:  # torch 2.14.1, CPU mesh: every shard of every parameter is rank 0's numbers again
        assert len(copies) == n_params, f"rank {ctx.rank}: one seed, yet only {copies} repeat rank 0's shards"
    assert fixed == [], f"rank {ctx.rank}: a seed per rank, yet {fixed} repeat rank 0's shards"
    # nn.Linear(width, width) draws weights and biases uniformly in +-1/sqrt(width): std 1/sqrt(3 width)
    weights, bound = whole(net), width**-0.5
    spread = weights.std().item() / (bound / 3**0.5)
    assert weights.abs().max() <= bound and abs(spread - 1) < 0.05, f"std {spread:.3f} x nn.Linear's"
    if ctx.is_main:
        print(f"one seed on every rank: {len(copies)} of {n_params} parameters repeat rank 0's shard")
        print(f"a seed per rank: {len(fixed)} of {n_params}; weights' std {spread:.3f} x nn.Linear's")
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = batch(0, width, ctx.world_size)
    loss = F.mse_loss(net(mine(x, ctx.rank)), mine(y, ctx.rank))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss), loss
    report = {"on_meta": on_meta, "after": after, "model": model, "shards": shards, "params": n_params}
    lessonlib.report("meta", {**report, "copies": len(copies), "fixed": len(fixed), "spread": spread})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--parts", type=lessonlib.comma_list(choices=PARTS), default=list(PARTS))
    parser.add_argument("--blocks", type=int, default=4, choices=range(1, 33), metavar="1..32")
    parser.add_argument("--width", type=int, default=64, choices=range(2, 1025), metavar="2..1024")
    parser.add_argument("--micro", type=int, default=3, choices=range(2, 17), metavar="2..16")
    parser.add_argument("--max-norm", type=float, default=0.05)
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    args = parser.parse_args()
    if args.max_norm <= 0:
        parser.error(f"--max-norm must be above 0; got {args.max_norm}")
    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    if "accumulate" in args.parts:
        part_accumulate(ctx, args.blocks, args.width, args.micro)
    if "clip" in args.parts:
        part_clip(ctx, args.blocks, args.width, args.max_norm)
    if "meta" in args.parts:
        part_meta(ctx, args.blocks, args.width)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
