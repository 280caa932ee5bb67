"""torchrun --nproc_per_node=2 lessons/05_by_hand.py

Data-parallel SGD written by hand, then with DistributedDataParallel, against one process.

Options: --batch 4, --steps 5 (the defaults).

Every step has a global batch of N x b rows (N ranks, b rows each). Rank r takes its own b rows,
computes the mean loss over them, calls backward(), averages the gradients over the ranks with
all_reduce, and steps. DDP does the same averaging inside backward(). The reference is one process
that trains the same model on all N x b rows at once. With the loss a mean, the three take the same
steps: after every SGD step (with momentum) the parameters of both data-parallel versions are
asserted equal to the reference's to 1e-12 (float64; the sums only add in another order), and the
replicas are asserted bitwise identical across ranks.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import flat_params, gather, global_batch, max_gap, mlp, my_rows

TOL = 1e-12


# [start: average_gradients]
def average_gradients(model, world_size):
    """What DDP does for us: after backward(), every rank gets the mean of all ranks' gradients."""
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size


# [end: average_gradients]


# [start: step]
def step(model, opt, x, y, sync=None):
    """One SGD step on this rank's rows; `sync` averages the gradients when the model is not DDP."""
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)  # the MEAN over this rank's rows
    loss.backward()  # under DDP, the all-reduce happens in here
    if sync:
        sync(model)
    opt.step()
    return loss.item()


# [end: step]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--batch", type=int, default=4, choices=range(1, 257), metavar="1..256", help="rows per rank per step (b)"
    )
    parser.add_argument("--steps", type=int, default=5, choices=range(1, 101), metavar="1..100")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    n, r, b = ctx.world_size, ctx.rank, args.batch

    # [start: three_runs]
    reference = mlp(seed=0)  # one process, all N x b rows
    by_hand = mlp(seed=0)  # this rank's b rows, gradients averaged by average_gradients
    ddp = DDP(mlp(seed=0))  # this rank's b rows, gradients averaged by DDP
    # [end: three_runs]
    opts = {
        name: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for name, m in [("reference", reference), ("by hand", by_hand), ("DDP", ddp)]
    }
    mine = my_rows([b] * n, r)
    for s in range(args.steps):
        x, y = global_batch(s, n * b)
        ref_loss = step(reference, opts["reference"], x, y)
        step(by_hand, opts["by hand"], x[mine], y[mine], sync=lambda m: average_gradients(m, n))
        step(ddp, opts["DDP"], x[mine], y[mine])
        want = flat_params(reference)
        row = {"step": s + 1, "reference loss": ref_loss}
        for name, model in [("by hand", by_hand), ("DDP", ddp.module)]:
            got = flat_params(model)
            row[name] = max_gap(got, want)
            assert row[name] < TOL, f"rank {r}, step {s + 1}: {name} is {row[name]:.2e} from the reference"
            replicas = gather(got)
            assert all(torch.equal(c, replicas[0]) for c in replicas), f"rank {r}: {name} replicas differ"
        lessonlib.report("gaps", row)
        if ctx.is_main:
            print(
                f"step {s + 1}: reference loss {ref_loss:.5f}; largest gap to the reference: "
                f"by hand {row['by hand']:.1e}, DDP {row['DDP']:.1e}"
            )
    if ctx.is_main:
        print(
            f"{n} rank(s) x {b} rows == 1 process x {n * b} rows, after {args.steps} steps "
            f"(to {TOL:g}), for the hand-written loop and for DDP; replicas bitwise equal across ranks"
        )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
