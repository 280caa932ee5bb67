"""torchrun --nproc_per_node=4 lessons/05_what_breaks.py

What breaks "N ranks x b rows == one process x N*b rows", measured on the first gradient.

Options: --batch 4 (the default).

Each case computes the gradient that every rank ends up with after one backward() under DDP, and
compares it with the gradient of one process on all the rows (mean loss). Scaling mistakes give the
right direction at the wrong size, an exact factor that is asserted: summing the loss (factor b, the
rows per rank), dividing a mean loss by the world size as if DDP summed (1/N), and a hand-written
all_reduce that sums without dividing (N). The rest give a different direction: per-rank batches of
unequal size (DDP weighs every rank alike, not every row), BatchNorm (each rank normalises with its
own rows' statistics) and dropout (each rank draws its own masks). Unequal batches have an exact fix,
asserted too: scale each rank's summed loss by N / (rows on all ranks).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import flat_grads, gather, global_batch, mlp, my_rows

TOL = 1e-12


def reference_grad(x, y, extra=()):
    """One process, every row, mean loss."""
    model = mlp(seed=0, extra=extra)
    torch.manual_seed(1)  # dropout's masks, if any
    F.mse_loss(model(x), y).backward()
    return flat_grads(model)


def ddp_grad(x, y, loss_fn, extra=()):
    """The gradient every rank holds after one backward() under DDP, on this rank's rows x, y."""
    model = DDP(mlp(seed=0, extra=extra))
    torch.manual_seed(1)  # the same seed on every rank, as chapter 4's "same seed" setup
    loss_fn(model(x), y).backward()
    return flat_grads(model.module)


def recording_dropout(p, masks):
    """A Dropout layer that keeps each mask it draws (where its output is not zero) in `masks`."""
    layer = torch.nn.Dropout(p)
    layer.register_forward_hook(lambda module, inputs, out: masks.append(out.detach() != 0))
    return layer


def sum_allreduce_grad(x, y):
    """Averaging by hand, with the division forgotten."""
    model = mlp(seed=0)
    F.mse_loss(model(x), y).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # SUM
    return flat_grads(model)


# [start: unequal_fix]
def global_mean_loss(pred, target, world_size):
    """Under DDP with unequal rows per rank: the loss whose averaged gradient is the all-rows mean."""
    rows = torch.tensor([float(pred.shape[0])], dtype=torch.float64)
    dist.all_reduce(rows)  # rows on all ranks together
    return F.mse_loss(pred, target, reduction="sum") * world_size / rows


# [end: unequal_fix]


def compare(got, want):
    """(factor, gap): the best scale of `want` to match `got`, and what is left after it, relative."""
    factor = (got @ want / (want @ want)).item()
    return factor, ((got - factor * want).abs().max() / want.abs().max()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--batch",
        type=int,
        default=4,
        choices=range(2, 257),
        metavar="2..256",
        help="rows per rank (b); unequal case: rank r gets b + r",
    )
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    n, r, b = ctx.world_size, ctx.rank, args.batch
    x, y = global_batch(0, n * b)
    mine = my_rows([b] * n, r)
    want = reference_grad(x, y)
    mean = F.mse_loss

    # [start: scaling]
    scaling = {  # case: (gradient, the factor it must be off by)
        "mean loss (correct)": (ddp_grad(x[mine], y[mine], mean), 1.0),
        "summed loss": (ddp_grad(x[mine], y[mine], lambda p, t: F.mse_loss(p, t, reduction="sum")), b),
        "mean loss / N (DDP already averages)": (ddp_grad(x[mine], y[mine], lambda p, t: mean(p, t) / n), 1 / n),
        "by hand: all_reduce SUM, no / N": (sum_allreduce_grad(x[mine], y[mine]), n),
    }
    # [end: scaling]
    rows = []
    for case, (got, expected) in scaling.items():
        factor, gap = compare(got, want)
        assert abs(factor - expected) < TOL * max(1, expected) and gap < TOL, (
            f"rank {r}: {case}: factor {factor} (expected {expected}), gap {gap:.1e}"
        )
        rows.append({"case": case, "factor": factor, "gap after rescaling": gap})

    sizes = [b + k for k in range(n)]  # rank k holds b + k rows
    xu, yu = global_batch(1, sum(sizes))
    mine_u = my_rows(sizes, r)
    want_u = reference_grad(xu, yu)
    dropout_p = 0.5
    ddp_masks, ref_masks = [], []  # the dropout masks drawn under DDP (this rank's rows) and by the reference
    direction = {  # case: (gradient, reference, fixed?)
        "unequal rows, mean loss": (ddp_grad(xu[mine_u], yu[mine_u], mean), want_u, False),
        "unequal rows, global_mean_loss": (
            ddp_grad(xu[mine_u], yu[mine_u], lambda p, t: global_mean_loss(p, t, n)),
            want_u,
            True,
        ),
        "BatchNorm": (
            ddp_grad(x[mine], y[mine], mean, extra=[torch.nn.BatchNorm1d(8).double()]),
            reference_grad(x, y, extra=[torch.nn.BatchNorm1d(8).double()]),
            False,
        ),
        "dropout": (
            ddp_grad(x[mine], y[mine], mean, extra=[recording_dropout(dropout_p, ddp_masks)]),
            reference_grad(x, y, extra=[recording_dropout(dropout_p, ref_masks)]),
            False,
        ),
    }
    for case, (got, ref, fixed) in direction.items():
        factor, gap = compare(got, ref)
        if fixed:
            assert abs(factor - 1) < TOL and gap < TOL, f"rank {r}: {case}: factor {factor}, gap {gap:.1e}"
        elif n > 1:  # one rank holds every row: nothing to break
            assert gap > 1e-6, f"rank {r}: {case} should differ from the reference, gap {gap:.1e}"
        rows.append({"case": case, "factor": factor, "gap after rescaling": gap})

    # Dropout's masks, with the same seed on every rank: every rank draws the same masks for its rows,
    # rank 0's equal the reference's for rank 0's rows, and the reference drew different ones for the rest.
    masks = gather(ddp_masks[0].double())
    same_on_all = all(torch.equal(m, masks[0]) for m in masks)
    rank0_is_reference = torch.equal(masks[0].bool(), ref_masks[0][:b])
    others_differ = all(not torch.equal(ref_masks[0][k * b : (k + 1) * b], masks[0].bool()) for k in range(1, n))
    assert same_on_all and rank0_is_reference and others_differ, (same_on_all, rank0_is_reference, others_differ)
    lessonlib.report(
        "dropout masks",
        {
            "same on every rank": same_on_all,
            "rank 0's are the reference's": rank0_is_reference,
            "the reference's for other ranks' rows differ": others_differ,
        },
    )

    for row in rows:
        lessonlib.report("cases", row)
        if ctx.is_main:
            print(
                f"{row['case']:40} factor {row['factor']:8.4f}   gap after rescaling {row['gap after rescaling']:.1e}"
            )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
