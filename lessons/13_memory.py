"""torchrun --nproc_per_node=3 lessons/13_memory.py

What each rank holds: the bytes of parameters, gradients and Adam's state, measured from the tensors.

Options: --variants ddp,zero1,fsdp (default: all three); --steps 3 (Adam steps before measuring).

One float32 MLP (36 -> 131 -> 197 -> 5: P = 31841 parameters; no layer's rows, nor P, divide by 2, 3, 4) and
Adam train for --steps steps on the same global batch of 12 rows per step, each rank on its 12/N rows.
Then every rank measures the storage behind its own tensors (lessonlib.sharding.held) and asserts it
equals the formula, exactly, in bytes (Adam also keeps a 4-byte `step` tensor per parameter it updates):
  ddp:   DDP + Adam. Parameters 4P, gradients 4P (gradient_as_bucket_view: the buckets are the .grad), state 8P.
  zero1: DDP + ZeroRedundancyOptimizer(Adam). Parameters and gradients as ddp; state 8 x the elements of
         the whole parameter tensors this rank was assigned (greedy, largest first): uneven by design.
  fsdp:  fully_shard per Linear, then the root. Each parameter is cut along dim 0 into N chunks of
         ceil(rows/N) rows; parameters and gradients are stored padded to that, Adam's state is not.
Against lessonlib.sharding.per_rank_bytes (the calculator): ddp exact (plus the step tensors); fsdp's
parameters and gradients within one row per parameter of ceil(P/N), the state summed over ranks exactly
8P plus the step tensors. And every variant's full weights equal one process's on the whole batch, within TOL
(exactly, at one rank).
"""

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.sharding import held, optimizer_state, per_rank_bytes

WIDTHS = (36, 131, 197, 5)
ROWS, LR = 12, 1e-2  # 12 rows per step: 1, 2, 3 and 4 ranks all get equal slices
# float32: the ranks' gradients are summed in another order than one process's. Measured: 1.7e-7, 2.2e-7
# and 3.5e-7 at 2, 3 and 4 ranks (3 steps; 20 steps stay below 4e-7), 0 at one. Adam divides each
# element's step by that element's running gradient size, so where a gradient nearly cancels over the
# batch (|g| near eps = 1e-8) the same rounding moves a weight by up to ~1e-4: widths (36, 121, 181, 5)
# do that. This bound is this model's, not every model's.
TOL = 1e-6
VARIANTS = ("ddp", "zero1", "fsdp")
STEP_BYTES = 4  # Adam's step counter, a float32 scalar tensor per parameter


def model():
    torch.manual_seed(0)
    layers = []
    for n_in, n_out in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def shapes():
    return [p.shape for p in model().parameters()]


def batch(step):
    """The global batch of `step`, the same on every rank whatever the world size."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, WIDTHS[0], generator=g), torch.randn(ROWS, WIDTHS[-1], generator=g)


def train(net, opt, steps, rows=slice(None)):
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(net(x[rows]), y[rows]).backward()
        opt.step()


# [start: variants]
def build(variant, world_size):
    """(the module to train, the optimizer) for one variant; every rank starts from the same weights."""
    net = model()
    if variant == "fsdp":
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)  # one unit per layer: gathered whole only while it runs
        fully_shard(net, mesh=mesh)
        return net, torch.optim.Adam(net.parameters(), lr=LR)
    ddp = DDP(net, gradient_as_bucket_view=True)  # no second copy of the gradients in the buckets
    if variant == "ddp":
        return ddp, torch.optim.Adam(ddp.parameters(), lr=LR)
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LR)


# [end: variants]


# [start: measure]
def holds(net, opt):
    """The bytes this rank holds, from the storage behind its tensors (a shard's padding included)."""
    params = list(net.parameters())  # under FSDP, DTensors: held() counts this rank's piece
    adam = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt  # ZeRO's Adam for this rank
    out = {
        "parameters": held(params),
        "gradients": held([p.grad for p in params]),
        "optimizer state": held(optimizer_state(adam)),
    }
    return {**out, "total": sum(out.values())}


# [end: measure]


# [start: formulas]
def expected(variant, shapes, world_size, rank, assigned=()):
    """The same bytes from the shapes alone. Adam keeps two float32 moments per element (8 bytes) and a
    4-byte step per tensor; `assigned`: the shapes ZeroRedundancyOptimizer gave this rank."""
    P = sum(s.numel() for s in shapes)
    if variant == "ddp":
        return {"parameters": 4 * P, "gradients": 4 * P, "optimizer state": 8 * P + 4 * len(shapes)}
    if variant == "zero1":
        return {"parameters": 4 * P, "gradients": 4 * P, "optimizer state": sum(8 * s.numel() + 4 for s in assigned)}
    padded = visible = 0  # fsdp: dim-0 chunks of ceil(rows/N) rows, the last ones shorter (or empty)
    for s in shapes:
        chunk, row = math.ceil(s[0] / world_size), s[1:].numel()
        padded += chunk * row
        visible += min(chunk, max(0, s[0] - rank * chunk)) * row
    return {"parameters": 4 * padded, "gradients": 4 * padded, "optimizer state": 8 * visible + 4 * len(shapes)}


# [end: formulas]


def full_weights(net):
    """The whole weights on every rank: FSDP's shards gathered (full_tensor), DDP's replicas as they are."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in net.parameters()]
    return torch.cat([p.detach().flatten() for p in full])


def gap_to_one_process(net, steps):
    """Largest difference from one process that trained on the whole batch, from the same start."""
    alone = model()
    train(alone, torch.optim.Adam(alone.parameters(), lr=LR), steps)
    return (full_weights(net) - torch.cat([p.detach().flatten() for p in alone.parameters()])).abs().max().item()


def against_calculator(variant, got, states, P, tensors, world_size, rank):
    """What lessonlib.sharding.per_rank_bytes predicts, and how far the measured bytes are from it."""
    calc = per_rank_bytes(P, world_size, variant)
    steps = STEP_BYTES * tensors  # the calculator counts no step tensors
    if variant == "ddp":
        assert got["total"] == calc["total"] + steps, f"rank {rank}: ddp holds {got}, the calculator says {calc}"
    if variant == "zero1":  # the calculator's split is of elements; ZeRO's of whole tensors (reported)
        assert got["parameters"] == calc["parameters"] and got["gradients"] == calc["gradients"], (got, calc)
    if variant == "fsdp":  # shards of ceil(rows/N) rows: at most one row per parameter above ceil(P/N)
        one_row = sum(4 * s[1:].numel() for s in shapes())
        for part in ("parameters", "gradients"):
            over = got[part] - calc[part]
            assert 0 <= over < one_row, f"rank {rank}: fsdp {part} {over} B over the calculator (a row: {one_row})"
    if variant != "ddp":  # each element's two moments are kept once, somewhere: 8P in all, not 8P per rank
        owners = 1 if variant == "zero1" else world_size  # FSDP keeps a step per shard, ZeRO per whole tensor
        assert sum(states) == 8 * P + steps * owners, f"rank {rank}: {variant}'s states {states} do not add to 8P"
    return calc


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--variants", type=lessonlib.comma_list(choices=VARIANTS), default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective waits (default: 30)")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout or 30)
    n, rank = ctx.world_size, ctx.rank
    P, tensors = sum(s.numel() for s in shapes()), len(shapes())
    share = ROWS // n
    for variant in args.variants:
        net, opt = build(variant, n)
        train(net, opt, args.steps, slice(rank * share, (rank + 1) * share))
        got = holds(net, opt)
        mine = [p for group in opt.optim.param_groups for p in group["params"]] if variant == "zero1" else []
        want = expected(variant, shapes(), n, rank, [p.shape for p in mine])
        for part, value in want.items():
            assert got[part] == value, f"rank {rank}: {variant} holds {got[part]} B of {part}, the formula {value}"
        states = [None] * n
        dist.all_gather_object(states, got["optimizer state"])
        calc = against_calculator(variant, got, states, P, tensors, n, rank)
        gap = gap_to_one_process(net, args.steps)
        assert gap < TOL, f"rank {rank}: {variant}'s weights are {gap:.1e} from one process's (tolerance {TOL})"
        assert n > 1 or gap == 0, f"rank 0: alone, {variant} is {gap:.1e} from one process: the same sums differ"
        row = {"variant": variant, "rank": rank, **got, "calculator": calc, "weights gap": gap}
        if variant == "zero1":  # the whole tensors this rank updates
            row["assigned"] = [name for name, p in net.module.named_parameters() if any(p is q for q in mine)]
        if variant == "fsdp":  # the same bytes without the padding: the elements this rank's shards show
            row["visible"] = {
                "parameters": sum(4 * p.to_local().numel() for p in net.parameters()),
                "gradients": sum(4 * p.grad.to_local().numel() for p in net.parameters()),
            }
            unpadded = (got["optimizer state"] - 4 * tensors) // 2  # two moments per visible element
            assert row["visible"] == {"parameters": unpadded, "gradients": unpadded}, f"rank {rank}: {row}"
        lessonlib.report("holds", row)
        print(
            f"rank {rank} {variant:5}: parameters {got['parameters']:6} B, gradients {got['gradients']:6} B, "
            f"state {got['optimizer state']:6} B; weights {gap:.0e} from one process"
        )
    if ctx.is_main:
        print(f"P = {P} parameters; every variant's measured bytes equal its formula at {n} rank(s)")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
