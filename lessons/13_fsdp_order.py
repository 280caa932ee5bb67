"""torchrun --nproc_per_node=2 lessons/13_fsdp_order.py

The order of an FSDP2 build: what an optimizer made before fully_shard does, and checkpointing applied after it.

Options: --blocks 4, --width 64, --steps 3, --pg-timeout S.

The model: --blocks residual blocks (Linear W->4W, GELU, Linear 4W->W), float32, each block and the root
under fully_shard, SGD; rank r trains on its own rows. Asserted:
  optimizer: built before fully_shard, the optimizer holds the nn.Parameters that fully_shard then replaces
    with sharded DTensor parameters (none of its tensors is among model.parameters()). The backward fills
    the new parameters' gradients; step() finds no gradient on the tensors it holds and skips them. No
    error, no warning: after --steps steps the model's weights are bitwise the initial ones and the loss
    on the same batch is the same every step. Built after fully_shard, the loss falls.
  checkpointing: torch's checkpoint_wrapper on each block before fully_shard (the order torch's FSDP2
    examples use) or after it. Measured on torch 2.14.1 with gloo: the same collectives per step, the same
    bytes saved for backward (each block's input only, against every hidden tensor without checkpointing),
    and bitwise the same weights after a step. So on this torch the order of these two is free; the
    optimizer's is not.
At world size 1 nothing is sent; every assertion still holds.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard

import lessonlib
from lessonlib.sharding import Traffic

ROWS, LR = 8, 0.1  # rows per rank; SGD's rate


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(h)))


def blocks(n, width):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(width) for _ in range(n)])


def data(rank, width):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(ROWS, width, generator=g)
    return x, torch.sin(x)


def whole(net):
    return torch.cat([p.full_tensor().detach().flatten() for p in net.parameters()])


# [start: optimizer]
def optimizer_first(n, width):
    net = blocks(n, width)
    opt = torch.optim.SGD(net.parameters(), lr=LR)  # the mistake: before fully_shard
    for block in net:
        fully_shard(block)  # replaces each nn.Parameter with a new, sharded one
    fully_shard(net)
    return net, opt


def optimizer_last(n, width):
    net = blocks(n, width)
    for block in net:
        fully_shard(block)
    fully_shard(net)
    return net, torch.optim.SGD(net.parameters(), lr=LR)  # holds the sharded parameters


# [end: optimizer]


def train(net, opt, steps, x, y):
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def part_optimizer(ctx, args):
    x, y = data(ctx.rank, args.width)
    rows = {}
    for name, build in (("before fully_shard", optimizer_first), ("after fully_shard", optimizer_last)):
        net, opt = build(args.blocks, args.width)
        start = whole(net)
        held = {id(p) for group in opt.param_groups for p in group["params"]}
        in_model = sum(id(p) in held for p in net.parameters())
        losses = train(net, opt, args.steps, x, y)
        changed = (whole(net) - start).abs().max().item()
        rows[name] = {"optimizer's tensors in the model": in_model, "losses": losses, "largest change": changed}
        print(f"rank {ctx.rank}: optimizer {name}: losses {[f'{v:.4f}' for v in losses]}, weights moved {changed:.1e}")
    wrong, right = rows["before fully_shard"], rows["after fully_shard"]
    n_params = 4 * args.blocks
    assert wrong["optimizer's tensors in the model"] == 0 and right["optimizer's tensors in the model"] == n_params
    assert wrong["largest change"] == 0 and len(set(wrong["losses"])) == 1, f"rank {ctx.rank}: {wrong}"
    assert right["largest change"] > 0 and right["losses"][-1] < right["losses"][0], f"rank {ctx.rank}: {right}"
    lessonlib.report("optimizer", rows)


# [start: checkpointing]
def with_checkpointing(n, width, where):
    net = blocks(n, width)
    for i, block in enumerate(net):
        if where == "before fully_shard":
            block = checkpoint_wrapper(block)  # the forward keeps only the block's input; backward recomputes
        fully_shard(block)
        if where == "after fully_shard":
            block = checkpoint_wrapper(block)
        net[i] = block
    fully_shard(net)
    return net


# [end: checkpointing]


def saved_bytes(net, x, y):
    """The loss, and the bytes autograd saves for backward during the forward (each storage once)."""
    found = {}

    def pack(t):
        found.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.mse_loss(net(x), y)
    return loss, sum(found.values())


def part_checkpointing(ctx, args):
    x, y = data(ctx.rank, args.width)
    rows, weights = {}, {}
    for where in ("none", "before fully_shard", "after fully_shard"):
        net = with_checkpointing(args.blocks, args.width, where)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        with Traffic() as t:
            loss, saved = saved_bytes(net, x, y)
            loss.backward()
        opt.step()
        weights[where] = whole(net)
        rows[where] = {"calls": dict(sorted(t.calls.items())), "saved": saved}
        print(f"rank {ctx.rank}: checkpointing {where}: {rows[where]['calls']}, {saved} bytes saved for backward")
    before, after, none = rows["before fully_shard"], rows["after fully_shard"], rows["none"]
    inputs = args.blocks * ROWS * args.width * 4  # each block's input, float32
    assert before == after, f"rank {ctx.rank}: {before} vs {after}"
    assert torch.equal(weights["before fully_shard"], weights["after fully_shard"]), f"rank {ctx.rank}: weights"
    assert torch.equal(weights["none"], weights["before fully_shard"]), f"rank {ctx.rank}: recompute changed them"
    assert inputs <= before["saved"] < none["saved"] / 3, f"rank {ctx.rank}: {before['saved']}, {none['saved']}"
    if ctx.world_size > 1:  # per block: forward and backward all-gathers, one reduce-scatter
        want = {"all_gather": 2 * args.blocks, "reduce_scatter": args.blocks}
        assert before["calls"] == none["calls"] == want, f"rank {ctx.rank}: {before['calls']} vs {want}"
    lessonlib.report("checkpointing", {**rows, "block inputs": inputs})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--blocks", type=int, default=4, choices=range(1, 33), metavar="1..32")
    parser.add_argument("--width", type=int, default=64, choices=range(2, 1025), metavar="2..1024")
    parser.add_argument("--steps", type=int, default=3, choices=range(2, 21), metavar="2..20")
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    part_optimizer(ctx, args)
    part_checkpointing(ctx, args)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
