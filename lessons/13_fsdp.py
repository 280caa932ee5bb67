"""torchrun --nproc_per_node=2 lessons/13_fsdp.py

FSDP's unit of sharding, reshard_after_forward, and mixed precision: what each changes, measured per rank.

Options: --parts wrap,reshard,mixed (the default: all three); --blocks 6; --width 192; --steps 5;
--pg-timeout S.

The model: --blocks equal blocks (Linear + ReLU), float32, SGD; rank r trains on its rows of a global batch.
In the step after a warm-up, each rank measures: the collectives by kind and the bytes sent
(lessonlib.sharding.Traffic), and two peaks, in bytes, sampled before every operation (Gathered):
`whole`, the whole (unsharded) weights FSDP has registered on the Linears, which the step computes with;
`gathered`, those plus the flat buffers the all-gathers wrote into, while FSDP keeps them. A block is
`unit` bytes (weight and bias, float32); every peak is a whole number of blocks, so checked exactly.
  1. wrap: fully_shard on every block and then the root, against the root alone (the whole model one
     unit), reshard_after_forward at its default (True for the blocks, False for the root). Per block:
     1 or 2 blocks whole, at most 3 gathered (FSDP keeps the last all-gather's buffer in forward and
     all-gathers the next block early in backward), whatever the depth; 2 all-gathers and 1
     reduce-scatter per block. The root alone: the whole model whole, twice it gathered (the buffer and
     the copies out of it), 1 all-gather, 1 reduce-scatter, 3/4 of the bytes on gloo (within TOL).
  2. reshard: per block with reshard_after_forward=False: one all-gather per block, not two (3/4 of the
     bytes), and every block stays whole from its forward to its backward: the whole model at the peak.
  3. mixed: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32). The sharded parameters
     and gradients (what the optimizer updates) stay float32; the first Linear computes with a bfloat16
     weight and returns bfloat16 (a forward hook reads both); the all-gathers carry half the bytes (the
     forward, measured alone: 1/2 within TOL) and both peaks halve; the reduce-scatters stay float32.
     After --steps steps, float32 FSDP equals one process on the global batch within F32_TOL; bfloat16
     is within BF16_TOL of float32 FSDP (the gaps reported).
At world size 1 FSDP calls no collective and sends nothing (asserted), but still swaps whole weights in.
"""

import argparse
import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import lessonlib
from lessonlib.sharding import Traffic

ROWS, LR = 4, 0.1  # rows per rank and step; SGD's learning rate
# Relative, on ratios of bytes sent: gloo adds a header to every message, which weighs more in small
# collectives (measured with the defaults: 0.4% to 0.8% from the ideal ratio, at 2 to 4 ranks).
TOL = 0.02
F32_TOL = 1e-6  # float32 FSDP vs one process: the same sums in another order (measured: 7.5e-9)
BF16_TOL = 2e-3  # bfloat16 vs float32 weights after 5 steps, weights up to 0.07 (measured: 0.9e-4 to 3.4e-4)
PARTS = ("wrap", "reshard", "mixed")
CONFIGS = {  # name: (wrap each block, the blocks' reshard_after_forward, mixed precision)
    "per block": (True, None, False),
    "root only": (False, None, False),
    "kept whole": (True, False, False),
    "bfloat16": (True, None, True),
}


def blocks(n_blocks, width):
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(n_blocks)]
    return torch.nn.Sequential(*layers)


# [start: wrap]
def build(n_blocks, width, world_size, per_block, reshard, mixed):
    net = blocks(n_blocks, width)
    options = {"mesh": init_device_mesh("cpu", (world_size,))}
    if mixed:  # weights all-gathered and computed in bfloat16, gradients reduce-scattered in float32
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if per_block:
        for block in net:  # one unit per block: all-gathered just before its forward, freed after
            fully_shard(block, reshard_after_forward=reshard, **options)
    fully_shard(net, **options)  # the root: whatever the blocks do not hold (here nothing), one unit
    return net, torch.optim.SGD(net.parameters(), lr=LR)


# [end: wrap]


# [start: whole]
class Gathered(TorchDispatchMode):
    """Peak bytes of gathered weights alive on this rank, sampled before every operation in the block.

    For a unit's forward and backward, FSDP all-gathers its shards into one flat buffer, copies each
    parameter out of it into a whole tensor, and registers those on the modules in the shards' place;
    resharding frees their storage (0 bytes) and puts the shards back. A forward pre-hook on each Linear
    notes the whole tensors (run a step first): `whole` is the peak of their bytes, the weights the step
    computes with; `gathered` adds the flat buffers of the all-gathers still alive.
    """

    GATHERS = ("_allgather_base_", "allgather_into_tensor_coalesced_")

    def __init__(self, net):
        super().__init__()
        self.tensors, self.buffers, self.whole, self.gathered = {}, [], 0, 0
        for layer in net.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_pre_hook(self.note)

    def note(self, layer, args):
        for name, p in layer.named_parameters(recurse=False):
            if not isinstance(p, DTensor):
                self.tensors[layer, name] = p

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        whole = sum(t.untyped_storage().nbytes() for t in self.tensors.values())
        self.buffers = [b for b in self.buffers if b() is not None]  # FSDP dropped the others: freed
        flat = sum(b().untyped_storage().nbytes() for b in self.buffers)
        self.whole, self.gathered = max(self.whole, whole), max(self.gathered, whole + flat)
        if func.overloadpacket.__name__ in self.GATHERS:  # the output: a tensor, or a list of them
            self.buffers += [weakref.ref(t) for t in (args[0] if isinstance(args[0], list) else [args[0]])]
        return func(*args, **(kwargs or {}))


# [end: whole]


def batch(step, world_size, width):
    """The global batch of `step`, the same on every rank; rank r's rows are the r-th ROWS."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS * world_size, width, generator=g), torch.randn(ROWS * world_size, width, generator=g)


def step(net, opt, x, y, forward=None):
    opt.zero_grad()
    with forward or contextlib.nullcontext():  # a Traffic block around the forward: its all-gathers alone
        out = net(x)
    F.mse_loss(out.float(), y).backward()  # the bfloat16 output's loss in float32
    opt.step()


def measure(ctx, args, name):
    """Build CONFIGS[name], run a warm-up step, then measure one: peak whole bytes, calls, bytes sent."""
    net, opt = build(args.blocks, args.width, ctx.world_size, *CONFIGS[name])
    seen = Gathered(net)
    mine = slice(ROWS * ctx.rank, ROWS * (ctx.rank + 1))
    for i in range(args.steps):
        x, y = batch(i, ctx.world_size, args.width)
        dist.barrier()
        fwd = Traffic()
        with Traffic() as t, seen:  # step 0 is a warm-up, for Traffic too (see 13_traffic)
            seen.whole = seen.gathered = 0
            step(net, opt, x[mine], y[mine], fwd)
        if i == 1:  # the step after the warm-up
            row = {"config": name, "rank": ctx.rank, "world_size": ctx.world_size}
            row.update(whole=seen.whole, gathered=seen.gathered)
            row.update(calls=dict(t.calls), sent=t.sent, forward_sent=fwd.sent, payload=dict(t.payload))
    return net, row


def want_calls(name, n_blocks, n):
    if n == 1:
        return {}  # one rank: FSDP skips every collective
    if name == "root only":  # the root keeps its weights whole from forward to backward by default
        return {"all_gather": 1, "reduce_scatter": 1}
    gathers = n_blocks if name == "kept whole" else 2 * n_blocks
    return {"all_gather": gathers, "reduce_scatter": n_blocks}


def check(ctx, rows, a, b, ratio):
    """b's bytes per step against a's: `ratio` on gloo, within TOL (0 bytes at world size 1)."""
    sent_a, sent_b = rows[a]["sent"], rows[b]["sent"]
    if sent_a is None:
        print(f"rank {ctx.rank}: /proc/self/io is missing (not Linux): byte assertions skipped")
    elif ctx.world_size == 1:
        assert sent_a == sent_b == 0, f"rank {ctx.rank}: one rank sent {sent_a} and {sent_b} bytes"
    else:
        got = sent_b / sent_a
        assert abs(got - ratio) <= TOL * ratio, f"rank {ctx.rank}: {b} sent {got:.3f}x {a}'s bytes, want {ratio}"


def part_wrap(ctx, args, rows, unit):
    """Peaks in blocks, exact: storage sizes are whole numbers of bytes, not estimates."""
    n, rank, L = ctx.world_size, ctx.rank, args.blocks
    block, root = rows["per block"], rows["root only"]
    # Per block: the block computing, and the next block's all-gather in backward (FSDP prefetches it);
    # in forward the last all-gather's flat buffer is kept until the next one is copied out.
    assert block["whole"] in (unit, 2 * unit), f"rank {rank}: per block, {block['whole'] / unit} blocks whole"
    assert block["gathered"] <= 3 * unit, f"rank {rank}: per block, {block['gathered'] / unit} blocks gathered"
    # The root alone: every block whole at once, and beside them (N > 1) the flat buffer they came from.
    assert root["whole"] == L * unit, f"rank {rank}: root only, {root['whole'] / unit} blocks whole"
    want = (2 if n > 1 else 1) * L * unit
    assert root["gathered"] == want, f"rank {rank}: root only, {root['gathered'] / unit} blocks gathered"
    check(ctx, rows, "per block", "root only", 3 / 4)  # the root keeps its weights: no all-gather in backward


def part_reshard(ctx, args, rows, unit):
    kept = rows["kept whole"]
    assert kept["whole"] == args.blocks * unit, f"rank {ctx.rank}: kept whole, {kept['whole'] / unit} blocks"
    check(ctx, rows, "per block", "kept whole", 3 / 4)  # one all-gather per block instead of two


def part_mixed(ctx, args, rows, nets):
    n, rank, f32, bf16 = ctx.world_size, ctx.rank, rows["per block"], rows["bfloat16"]
    # [start: mixed]
    net = nets["bfloat16"]
    kept = {t.to_local().dtype for p in net.parameters() for t in (p, p.grad)}  # shards, as the optimizer sees
    assert kept == {torch.float32}, f"rank {rank}: the sharded parameters and gradients are {kept}"
    seen = []  # the weight the first Linear computes with, and its output
    net[0][0].register_forward_hook(lambda layer, args, out: seen.append((layer.weight.dtype, out.dtype)))
    with torch.no_grad():
        net(torch.zeros(1, args.width))  # a float32 input: the root casts it
    assert seen == [(torch.bfloat16, torch.bfloat16)], f"rank {rank}: the forward computed with {seen}"
    # [end: mixed]
    for peak in ("whole", "gathered"):
        assert bf16[peak] * 2 == f32[peak], f"rank {rank}: {peak} weights {bf16[peak]} B in bf16, {f32[peak]} B"
    if n > 1:
        pay32, pay16 = f32["payload"], bf16["payload"]
        assert pay16["all_gather"] * 2 == pay32["all_gather"], f"rank {rank}: all-gather payload {pay16}"
        assert pay16["reduce_scatter"] == pay32["reduce_scatter"], f"rank {rank}: reduce-scatter in float32"
        if f32["forward_sent"] is not None:
            got = bf16["forward_sent"] / f32["forward_sent"]
            assert abs(got - 0.5) <= TOL * 0.5, f"rank {rank}: bf16 forward sent {got:.3f}x float32's"
    # After --steps steps: float32 FSDP against one process on the global batch, and bfloat16 against both.
    alone = blocks(args.blocks, args.width)
    opt = torch.optim.SGD(alone.parameters(), lr=LR)
    for i in range(args.steps):
        step(alone, opt, *batch(i, n, args.width))
    flat = {k: torch.cat([p.full_tensor().flatten() for p in net.parameters()]) for k, net in nets.items()}
    ref = torch.cat([p.detach().flatten() for p in alone.parameters()])
    gap32 = (flat["per block"] - ref).abs().max().item()
    gap16 = (flat["bfloat16"] - flat["per block"]).abs().max().item()
    assert gap32 < F32_TOL, f"rank {rank}: float32 FSDP is {gap32:.1e} from one process"
    assert gap32 < gap16 < BF16_TOL, f"rank {rank}: bfloat16 FSDP is {gap16:.1e} from float32 ({gap32:.1e})"
    return {"float32 vs one process": gap32, "bfloat16 vs float32": gap16, "largest weight": ref.abs().max().item()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: wrap, reshard, mixed")
    parser.add_argument("--blocks", type=int, default=6, choices=range(2, 33), metavar="2..32")
    parser.add_argument("--width", type=int, default=192, choices=range(12, 1025, 12), metavar="12..1024 (x12)")
    parser.add_argument("--steps", type=int, default=5, choices=range(2, 51), metavar="2..50")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective may wait (default 30)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}")
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout or 30)
    unit = 4 * (args.width + 1) * args.width  # one block's float32 weight and bias
    names = {"wrap": ["per block", "root only"], "reshard": ["per block", "kept whole"]}
    names["mixed"] = ["per block", "bfloat16"]
    wanted = list(dict.fromkeys(name for part in parts for name in names[part]))
    nets, rows = {}, {}
    for name in wanted:
        nets[name], rows[name] = measure(ctx, args, name)
        want = want_calls(name, args.blocks, ctx.world_size)
        assert rows[name]["calls"] == want, f"rank {ctx.rank}: {name}: {rows[name]['calls']}, want {want}"
        assert ctx.world_size > 1 or rows[name]["sent"] in (0, None), f"one rank sent {rows[name]['sent']} bytes"
        lessonlib.report("fsdp", {**rows[name], "blocks": args.blocks, "block bytes": unit})
    peaks = ", ".join(f"{k} {r['whole'] / unit:g}/{r['gathered'] / unit:g}" for k, r in rows.items())
    print(f"rank {ctx.rank}: blocks whole/gathered at the peak: {peaks}")
    if ctx.is_main:
        m = args.blocks * unit  # the model's bytes
        print(f"  a block: {unit} bytes; M, the model: {m} bytes; per step, on each rank:")
        for k, r in rows.items():
            sent = "?" if r["sent"] is None else f"{r['sent'] / m:.3f} M"
            print(f"    {k}: {r['calls']}, sent {sent}")
    if "wrap" in parts:
        part_wrap(ctx, args, rows, unit)
    if "reshard" in parts:
        part_reshard(ctx, args, rows, unit)
    if "mixed" in parts:
        gaps = part_mixed(ctx, args, rows, nets)
        lessonlib.report("mixed", {"rank": ctx.rank, "world_size": ctx.world_size, "steps": args.steps, **gaps})
        print(f"rank {ctx.rank}: after {args.steps} steps: " + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))
    lessonlib.teardown()


if __name__ == "__main__":
    main()
