"""torchrun --nproc_per_node=2 lessons/13_prefetch.py

When FSDP gathers each block's weights and frees them, and what explicit prefetching changes.

Options: --blocks 4; --width 96; --ahead 2 (blocks prefetched by the second run); --steps 3; --pg-timeout S.

The model: --blocks equal blocks (Linear + ReLU), float32, each block and then the root under
fully_shard, SGD; rank r trains on its rows of a global batch. Two runs of the same training:
  default: FSDP's own schedule. Forward: block i+1's all-gather starts only after block i has
    computed, and block i's flat buffer is freed when block i+1's weights are copied out of theirs
    (the same operation), so two buffers live side by side for a moment. Backward: FSDP gathers
    block i-1 before block i computes (it prefetches one block in backward by itself), and frees each
    buffer as soon as its weights are copied out. Peak: 3 blocks' bytes gathered (asserted exactly).
  prefetch: block i's set_modules_to_forward_prefetch names the next --ahead blocks and
    set_modules_to_backward_prefetch the previous --ahead: their all-gathers start before block i
    computes (asserted for every block); the peak grows to --ahead + 2 blocks (asserted exactly). The
    same collectives and bytes per step (within 2%), and bitwise the same weights after --steps steps.
A TorchDispatchMode (Timeline) watches the step after a warm-up: before every operation it notes
which blocks hold whole weights and which all-gather buffers are alive, and a pre-hook on each block
which block runs; from that it writes the step as events (gather, whole, compute, reshard, free), each
with the index of the operation where it was seen. At world size 1 FSDP gathers nothing: no
all-gather and no buffer, only whole weights swapped in (asserted).
"""

import argparse
import weakref

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import lessonlib
from lessonlib.sharding import Traffic

blocks = lessonlib.load_lesson("13_fsdp_practice").blocks

ROWS, LR = 4, 0.1  # rows per rank and step; SGD's rate
TOL = 0.02  # bytes sent, prefetch against default: gloo's headers, the same messages in another order


# [start: prefetch]
def build(n_blocks, width, world_size, ahead):
    net = blocks(n_blocks, width)  # chapter 13's blocks: Linear + ReLU each
    mesh = init_device_mesh("cpu", (world_size,))
    for block in net:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    if ahead:  # explicit prefetching: the blocks whose all-gathers start when this block starts
        for i, block in enumerate(net):
            block.set_modules_to_forward_prefetch(list(net[i + 1 : i + 1 + ahead]))
            block.set_modules_to_backward_prefetch([net[j] for j in range(i - 1, max(i - 1 - ahead, -1), -1)])
    return net, torch.optim.SGD(net.parameters(), lr=LR)


# [end: prefetch]


# [start: timeline]
class Timeline(TorchDispatchMode):
    """The step as events, (op index, pass, what, block), and the peak of gathered bytes, in blocks.

    Before every operation: a block whose Linear weight is no longer a DTensor holds whole weights (FSDP
    swapped them in), and an all-gather output still referenced is a live flat buffer. The gathered
    bytes are those buffers' and the whole weights' storages (0 bytes once FSDP frees them; run a step
    first, so that the whole tensors are known before FSDP fills them). The k-th
    all-gather is the k-th block to become whole after it: FSDP copies out in the order it gathers.
    "compute i" is the first matrix product while block i runs (its forward or backward pre-hook).
    """

    GATHERS = ("_allgather_base_", "allgather_into_tensor_coalesced_")

    def __init__(self, blocks, unit):
        super().__init__()
        self.blocks, self.unit, self.tensors = blocks, unit, {}  # the whole tensors FSDP reuses, step after step
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, a, i=i: self.runs(i, "forward"))
            block.register_full_backward_pre_hook(lambda m, g, i=i: self.runs(i, "backward"))
        self.reset()

    def reset(self):
        self.events, self.op, self.peak, self.pass_, self.running = [], 0, 0, "forward", None
        self.whole, self.buffers, self.unclaimed, self.gathers, self.computed = set(), {}, [], [], set()

    def runs(self, block, pass_):
        self.running, self.pass_ = block, pass_

    def note(self, what, block):
        self.events.append((self.op, self.pass_, what, block))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        whole = {i for i, b in enumerate(self.blocks) if not isinstance(b[0].weight, DTensor)}
        for i in sorted(whole - self.whole):
            self.note("whole", i)
            self.computed.discard(i)
            if self.unclaimed:  # the oldest all-gather not yet copied out was this block's
                self.buffers[i] = self.unclaimed.pop(0)
                k = self.gathers.pop(0)
                self.events[k] = (*self.events[k][:3], i)
        for i in sorted(self.whole - whole):
            self.note("reshard", i)
        for i, ref in list(self.buffers.items()):
            if ref() is None:  # FSDP dropped its last reference: the buffer is freed
                self.note("free", i)
                del self.buffers[i]
        self.whole = whole
        alive = [t for t in (r() for r in [*self.buffers.values(), *self.unclaimed]) if t is not None]
        for i in whole:  # FSDP allocates their storage again while it copies out, before it swaps them in
            self.tensors.update({(i, k): p for k, p in self.blocks[i][0].named_parameters()})
        gathered = sum(t.untyped_storage().nbytes() for t in [*self.tensors.values(), *alive])
        self.peak = max(self.peak, gathered / self.unit)
        name = func.overloadpacket.__name__
        if name in self.GATHERS:
            self.unclaimed.append(weakref.ref(args[0][0] if isinstance(args[0], list) else args[0]))
            self.gathers.append(len(self.events))
            self.note("gather", None)  # whose: the next block to become whole (filled in above)
        if name in ("mm", "addmm") and self.running in whole and self.running not in self.computed:
            self.computed.add(self.running)
            self.note("compute", self.running)
        self.op += 1
        return func(*args, **(kwargs or {}))


# [end: timeline]


def first(events, pass_, what, block):
    """The op index of the first `what` of `block` in `pass_`."""
    return next(op for op, p, w, b in events if p == pass_ and w == what and b == block)


def train(ctx, args, ahead):
    net, opt = build(args.blocks, args.width, ctx.world_size, ahead)
    timeline = Timeline(list(net), unit=4 * (args.width + 1) * args.width)  # a block's float32 bytes
    mine = slice(ROWS * ctx.rank, ROWS * (ctx.rank + 1))
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(ROWS * ctx.world_size, args.width, generator=g) for _ in range(2))
        opt.zero_grad()
        timeline.reset()
        with Traffic() as traffic, timeline:
            F.mse_loss(net(x[mine]), y[mine]).backward()
        opt.step()
        if step == 1:  # the step after the warm-up
            seen = {"events": list(timeline.events), "peak": timeline.peak, "calls": dict(traffic.calls)}
            seen["sent"] = traffic.sent
    seen["weights"] = torch.cat([p.full_tensor().flatten() for p in net.parameters()])
    return seen


def check(ctx, args, default, prefetch):
    n, rank, L, k = ctx.world_size, ctx.rank, args.blocks, args.ahead
    for name, run in (("default", default), ("prefetch", prefetch)):
        gathers = [e for e in run["events"] if e[2] == "gather"]
        if n == 1:
            assert gathers == [] and run["calls"] == {}, f"rank {rank}: {name}: one rank gathered {gathers}"
            assert run["peak"] == 1, f"rank {rank}: {name}: {run['peak']} blocks whole at once"
            continue
        assert len(gathers) == 2 * L and run["calls"] == {"all_gather": 2 * L, "reduce_scatter": L}, run["calls"]
    if n == 1:
        return
    ev = default["events"]
    for i in range(1, L):
        # forward: block i is gathered after block i-1 computed; block i-1's buffer goes when i is copied out
        assert first(ev, "forward", "gather", i) > first(ev, "forward", "compute", i - 1), f"rank {rank}: early {i}"
        assert first(ev, "forward", "free", i - 1) == first(ev, "forward", "whole", i), f"rank {rank}: buffer {i - 1}"
        # backward: block i-1 is gathered before block i computes; each buffer is freed once copied out
        assert first(ev, "backward", "gather", i - 1) < first(ev, "backward", "compute", i), f"rank {rank}: {i - 1}"
        assert first(ev, "backward", "free", i) == first(ev, "backward", "whole", i), f"rank {rank}: kept {i}"
    assert default["peak"] == 3, f"rank {rank}: default: {default['peak']} blocks gathered at the peak"
    ev = prefetch["events"]
    for i in range(L):
        for j in range(i + 1, min(i + 1 + k, L)):
            assert first(ev, "forward", "gather", j) < first(ev, "forward", "compute", i), f"rank {rank}: fwd {j}"
        for j in range(max(i - k, 0), i):
            assert first(ev, "backward", "gather", j) < first(ev, "backward", "compute", i), f"rank {rank}: bwd {j}"
    want = min(k, L - 1) + 2
    assert prefetch["peak"] == want, f"rank {rank}: prefetch: {prefetch['peak']} blocks gathered, want {want}"
    if default["sent"] is not None:
        ratio = prefetch["sent"] / default["sent"]
        assert abs(ratio - 1) <= TOL, f"rank {rank}: prefetching sent {ratio:.3f}x the default's bytes"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--blocks", type=int, default=4, choices=range(2, 17), metavar="2..16")
    parser.add_argument("--width", type=int, default=96, choices=range(12, 1025, 12), metavar="12..1024 (x12)")
    parser.add_argument("--ahead", type=int, default=2, choices=range(1, 16), metavar="1..15")
    parser.add_argument("--steps", type=int, default=3, choices=range(2, 51), metavar="2..50")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective may wait (default 30)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout or 30)
    default, prefetch = train(ctx, args, 0), train(ctx, args, args.ahead)
    assert torch.equal(default["weights"], prefetch["weights"]), f"rank {ctx.rank}: prefetching changed the weights"
    check(ctx, args, default, prefetch)
    for name, run in (("default", default), ("prefetch", prefetch)):
        row = {"run": name, "rank": ctx.rank, "peak blocks gathered": run["peak"], "calls": run["calls"]}
        row.update(events=run["events"], sent=run["sent"], ahead=args.ahead if name == "prefetch" else 0)
        lessonlib.report("timeline", row)
        print(f"rank {ctx.rank} {name}: peak {run['peak']:g} blocks gathered, {run['calls']}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
