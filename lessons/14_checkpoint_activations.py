"""torchrun --nproc_per_node=2 lessons/14_checkpoint_activations.py

Activation checkpointing under DDP: the bytes autograd keeps for backward, the time recomputing costs.

Options: --width 256 --depth 4 --rows 128 (the model and each rank's batch), --runs 15 (timing), --pg-timeout S.

The model: `depth` transformer-style MLP blocks (Linear W->4W, GELU, Linear 4W->W, Dropout 0.1), then a
Linear W->1 head; float32, under DDP. With --checkpoint each block runs inside
torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False): its forward keeps nothing for
backward but its input, and backward runs it again. Asserted:
  1. Memory: what autograd saves during one forward, recorded with saved_tensors_hooks as chapter 8 does
     (its saved_tensors function). With checkpointing the activations are exactly each block's input
     (rows x W x 4 bytes) plus what lies outside the blocks; without, every block also keeps its two
     4W-wide hidden tensors (GELU's input and output) and dropout's mask, which on CPU is a float32
     tensor the input is multiplied by (4 bytes per element, not a 1-byte boolean).
  2. Recompute: with checkpointing each block's forward starts twice per step (a forward pre-hook counts
     it) but finishes once (a forward hook): the recompute stops as soon as the tensors backward needs
     exist again (torch's "early stop", on by default), so code after them, hooks included, does not run.
  3. Same gradients: after 3 SGD steps the weights are bitwise equal with and without checkpointing,
     dropout included: checkpoint restores the RNG state before recomputing (preserve_rng_state=True).
     With preserve_rng_state=False the recomputed masks differ and the weights do not match (asserted).
Time (the best of --runs, interleaved: other work on the machine only adds time): a forward + backward in
each mode, and the plain model's forward alone (graph recorded, as the recompute's is), reported; chapter
14 bounds the ratio. The default size is large enough for the arithmetic to outweigh checkpoint's fixed
cost per block. Measured on the 2-core build machine (torch 2.14.1, 2 ranks, quiet): checkpointing added
1.0 to 1.5 forwards' time to a step at the default size, 2.8 to 4.4 at --width 64 --rows 64.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import lessonlib
from lessonlib.exercises import load_function

HERE = os.path.dirname(os.path.abspath(__file__))
saved_tensors = load_function(os.path.join(HERE, "08_speed_memory.py"), "saved_tensors")  # chapter 8's


# [start: model]
class Net(torch.nn.Module):
    def __init__(self, width, depth, mode="plain"):
        super().__init__()
        torch.manual_seed(0)
        mlp = lambda: torch.nn.Sequential(  # noqa: E731
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width), torch.nn.Dropout(0.1)
        )
        self.blocks = torch.nn.ModuleList(mlp() for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)
        self.mode = mode  # "plain", "checkpoint", or "no RNG restore"

    def forward(self, h):
        for block in self.blocks:
            if self.mode == "plain":
                h = block(h)
            else:  # keep only h; run block again in backward, with the same dropout masks by default
                h = checkpoint(block, h, use_reentrant=False, preserve_rng_state=self.mode == "checkpoint")
        return self.head(h)


# [end: model]


def data(ctx, rows, width):
    g = torch.Generator().manual_seed(ctx.rank)  # each rank its own rows
    return torch.randn(rows, width, generator=g), torch.randn(rows, 1, generator=g)


def train(ctx, mode, width, depth, rows, steps=3):
    net = Net(width, depth, mode)
    calls = {"started": [0] * depth, "finished": [0] * depth}  # forward calls per block, by two hooks
    for i, block in enumerate(net.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls["started"].__setitem__(i, calls["started"][i] + 1))
        block.register_forward_hook(lambda *_, i=i: calls["finished"].__setitem__(i, calls["finished"][i] + 1))
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    x, y = data(ctx, rows, width)
    torch.manual_seed(1)  # the dropout masks: the same sequence in every mode
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    per_step = {k: [c // steps for c in v] for k, v in calls.items()}
    return torch.cat([p.detach().flatten() for p in net.parameters()]), per_step


# [start: memory]
def saved_bytes(ctx, mode, width, depth, rows):
    """Bytes of the activations autograd keeps during one forward, chapter 8's way."""
    ddp = DDP(Net(width, depth, mode))
    x, y = data(ctx, rows, width)
    saved = saved_tensors(ddp, x, y, None)  # [(kind, dtype, bytes)], each storage once; runs backward too
    return sum(b for kind, _, b in saved if kind == "activation")


# [end: memory]


def step_times(ctx, width, depth, rows, runs):
    """{mode: best ms per forward + backward, and the forward alone}, the modes interleaved on every rank."""
    models = {mode: DDP(Net(width, depth, mode)) for mode in ("plain", "checkpoint")}
    x, y = data(ctx, rows, width)
    times = {mode: [] for mode in [*models, "forward alone"]}
    for _ in range(runs + 1):  # the first round warms up
        for mode, ddp in models.items():
            start = time.perf_counter()
            F.mse_loss(ddp(x), y).backward()
            times[mode].append(1e3 * (time.perf_counter() - start))
        start = time.perf_counter()
        models["plain"].module(x)  # the model's forward, graph recorded as the recompute's is, no DDP, no backward
        times["forward alone"].append(1e3 * (time.perf_counter() - start))
    return {mode: round(min(t[1:]), 3) for mode, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--width", type=int, default=256, choices=range(4, 1025), metavar="4..1024")
    parser.add_argument("--depth", type=int, default=4, choices=range(1, 33), metavar="1..32")
    parser.add_argument("--rows", type=int, default=128, choices=range(1, 4097), metavar="1..4096")
    parser.add_argument("--runs", type=int, default=15, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    w, d, b = args.width, args.depth, args.rows

    kept = {mode: saved_bytes(ctx, mode, w, d, b) for mode in ("plain", "checkpoint")}
    f32, outside = 4 * b * w, 4 * b * w + 2 * 4 * b  # the head's input; the loss's input and target
    # plain: the block's input, its two 4W-wide hidden tensors, and dropout's mask (float32 on CPU)
    per_block = {"plain": f32 + 2 * 4 * f32 + f32, "checkpoint": f32}
    for mode, got in kept.items():
        want = d * per_block[mode] + outside
        assert got == want, f"rank {ctx.rank}: {mode}: autograd kept {got} bytes, expected {want}"

    weights, calls = {}, {}
    for mode in ("plain", "checkpoint", "no RNG restore"):
        weights[mode], calls[mode] = train(ctx, mode, w, d, b)
    assert calls["plain"] == {"started": [1] * d, "finished": [1] * d}, f"rank {ctx.rank}: {calls}"
    # Recomputed once more in backward, and stopped early: once the tensors backward needs exist again.
    assert calls["checkpoint"] == {"started": [2] * d, "finished": [1] * d}, f"rank {ctx.rank}: {calls}"
    assert torch.equal(weights["checkpoint"], weights["plain"]), f"rank {ctx.rank}: checkpointing changed them"
    assert not torch.equal(weights["no RNG restore"], weights["plain"]), f"rank {ctx.rank}: masks matched"
    gap = (weights["no RNG restore"] - weights["plain"]).abs().max().item()

    ms = step_times(ctx, w, d, b, args.runs)
    if ctx.is_main:
        row = {
            "width": w,
            "depth": d,
            "rows": b,
            "activation bytes": kept,
            "bytes per block": per_block,
            "bytes outside the blocks": outside,
            "block forwards per step": calls,
            "weights equal to plain": {m: bool(torch.equal(v, weights["plain"])) for m, v in weights.items()},
            "no RNG restore: largest weight gap": gap,
            "ms per step": ms,
        }
        lessonlib.report("checkpoint", row)
        print(f"activations kept: {kept['plain']} bytes plain, {kept['checkpoint']} with checkpointing")
        print(f"ms, best of {args.runs}: {ms} ('forward alone': the plain model's forward, no backward)")
        print(f"preserve_rng_state=False: weights {gap:.1e} away from the run without checkpointing")
    print(f"rank {ctx.rank}: every assertion held at world size {ctx.world_size}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
