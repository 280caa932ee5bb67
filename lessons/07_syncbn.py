"""torchrun --nproc_per_node=4 lessons/07_syncbn.py

BatchNorm over the global batch: what per-rank statistics get wrong, and SyncBatchNorm by hand.

Options: --rows 4, --features 3 (the defaults).

Rank r holds rows + r rows centred near r. Plain BatchNorm1d on each rank normalises with its own rows'
statistics, so it differs from BatchNorm over all ranks' rows (rebuilt on every rank from gathered data).
torch's SyncBatchNorm fixes that on GPUs only: converting works on CPU, the training forward raises. So
the lesson all-reduces sums, sums of squares and row counts by hand, and asserts the result equal to the
global-batch BatchNorm (float64): output, running stats, and input gradients through an autograd-aware
all_reduce. With NCCL and a GPU per rank the real SyncBatchNorm is checked too; else it reports why not.
"""

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce as all_reduce_with_grad

import lessonlib

TOL = 1e-10


def my_rows(rank, rows, features, device):
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(rows + rank, features, generator=g, dtype=torch.float64) + rank).to(device)


def gather_rows(x):
    """All ranks' rows in rank order, and each rank's row count. all_gather needs equal shapes, so pad."""
    counts = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(x)], device=x.device))
    counts = [c.item() for c in counts]
    padded = torch.zeros(max(counts), x.shape[1], dtype=x.dtype, device=x.device)
    padded[: len(x)] = x
    out = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(out, padded)
    return torch.cat([o[:c] for o, c in zip(out, counts)]), counts


def batchnorm(features, weight, bias):
    bn = torch.nn.BatchNorm1d(features).to(weight.device, torch.float64)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    return bn


# [start: by_hand]
def sync_batch_norm(x, weight, bias, running_mean, running_var, momentum=0.1, eps=1e-5):
    """BatchNorm1d in training mode over every rank's rows together; updates the running buffers."""
    local = torch.stack([x.sum(0), (x * x).sum(0), torch.full_like(x[0], len(x))])
    total = all_reduce_with_grad(local)  # sums, not means: ranks hold different numbers of rows
    count = total[2]
    mean = total[0] / count
    var = total[1] / count - mean * mean  # biased: what BatchNorm normalises with
    with torch.no_grad():
        running_mean.lerp_(mean, momentum)
        running_var.lerp_(var * count / (count - 1), momentum)  # the running var is the unbiased one
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


# [end: by_hand]


def on_gpu(ctx, x, w, weight, bias):
    """The real SyncBatchNorm's output, input gradient and running var, or the reason it cannot run here."""
    if not torch.cuda.is_available():
        return (
            None,
            "skipped: SyncBatchNorm needs CUDA tensors and this machine has no GPU "
            "(torch.cuda.is_available() is False)",
        )
    if ctx.backend != "nccl":
        return None, (
            f"skipped: backend is {ctx.backend} ({torch.cuda.device_count()} GPU(s) for "
            f"{ctx.local_world_size} local ranks); SyncBatchNorm needs a GPU per rank and NCCL"
        )
    # [start: convert]
    bn = torch.nn.SyncBatchNorm.convert_sync_batchnorm(batchnorm(x.shape[1], weight, bias)).to(ctx.device)
    # [end: convert]
    xg = x.detach().clone().requires_grad_()
    out = bn(xg)
    (out * w).sum().backward()
    alone = " (one rank: nothing to sync, so it runs plain BatchNorm)" if ctx.world_size == 1 else ""
    return (out.detach(), xg.grad, bn.running_var), f"ran on {torch.cuda.get_device_name()}{alone}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--rows",
        type=int,
        default=4,
        choices=range(2, 65),
        metavar="2..64",
        help="rows on rank 0; rank r holds rows + r",
    )
    parser.add_argument("--features", type=int, default=3, choices=range(1, 17), metavar="1..16")
    args = parser.parse_args()
    ctx = lessonlib.setup()
    n, r, f = ctx.world_size, ctx.rank, args.features
    like = dict(dtype=torch.float64, device=ctx.device)  # nccl (GPU per rank) reduces only GPU tensors
    weight, bias = torch.linspace(0.5, 1.5, f, **like), torch.linspace(-1, 1, f, **like)

    # 1. Per-rank statistics against the global batch, which every rank rebuilds from the gathered rows.
    x = my_rows(r, args.rows, f, ctx.device)
    everyone, counts = gather_rows(x)
    mine = slice(sum(counts[:r]), sum(counts[: r + 1]))
    reference = batchnorm(f, weight, bias)
    want = reference(everyone.requires_grad_())
    w = torch.linspace(-1, 2, everyone.numel(), **like).reshape(everyone.shape)  # fixed per row
    (want * w).sum().backward()  # the loss of the whole global batch
    local = batchnorm(f, weight, bias)(x)  # what each rank gets without SyncBatchNorm
    gap = (local - want[mine]).abs().max().item()
    assert gap > 0.1 if n > 1 else gap < TOL, f"rank {r}: per-rank BatchNorm is {gap:.3g} from the global one"
    lessonlib.report(
        "per_rank_bn",
        {
            "rows": len(x),
            "local mean": x.mean(0)[0].item(),
            "global mean": everyone.mean(0)[0].item(),
            "max gap to global": gap,
        },
    )
    print(
        f"rank {r}: {len(x)} rows, feature 0 mean {x.mean(0)[0].item():.3f} here, "
        f"{everyone.mean(0)[0].item():.3f} over all {len(everyone)}; per-rank BatchNorm is off by {gap:.3f}"
    )

    # 2. torch's SyncBatchNorm: the conversion works on CPU, the training forward does not.
    # [start: cpu_error]
    model = torch.nn.Sequential(torch.nn.Linear(f, f), torch.nn.BatchNorm1d(f), torch.nn.ReLU()).double()
    before = [type(m).__name__ for m in model]  # read now: the conversion changes `model` in place
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    after = [type(m).__name__ for m in converted]
    assert converted is model and after[1] == "SyncBatchNorm", f"rank {r}: conversion gave {after}"
    try:
        converted(x.cpu())  # training mode, CPU tensor
    except ValueError as e:
        error = {"type": type(e).__name__, "message": str(e)}
    else:
        raise AssertionError(f"rank {r}: SyncBatchNorm ran on a CPU tensor; this lesson expects it to refuse")
    # [end: cpu_error]
    assert "SyncBatchNorm" in error["message"] and "GPU" in error["message"], f"rank {r}: {error}"
    lessonlib.report("cpu_error", {"before": before, "after": after, **error})

    # 3. By hand, with gradients flowing through the all-reduced statistics.
    xs = x.clone().requires_grad_()
    running_mean, running_var = torch.zeros(f, **like), torch.ones(f, **like)
    with warnings.catch_warnings(record=True) as caught:  # torch 2.14 marks it deprecated: show it once
        warnings.simplefilter("always")
        out = sync_batch_norm(xs, weight, bias, running_mean, running_var)
    (out * w[mine]).sum().backward()  # each rank its rows' share; the all_reduce's backward adds the rest
    biased = everyone.detach().var(0, unbiased=False)  # BatchNorm starts at running var 1, momentum 0.1
    gaps = {
        "max gap output": (out - want[mine]).abs().max().item(),
        "max gap grad": (xs.grad - everyone.grad[mine]).abs().max().item(),
        "max gap running mean": (running_mean - reference.running_mean).abs().max().item(),
        "max gap running var": (running_var - reference.running_var).abs().max().item(),
        "running var gap if biased": (0.9 + 0.1 * biased - reference.running_var).abs().max().item(),
    }
    assert max(v for k, v in gaps.items() if k.startswith("max")) < TOL, f"rank {r}: by hand differs: {gaps}"
    assert gaps["running var gap if biased"] > TOL, f"rank {r}: BatchNorm's running var looks biased"
    assert any(issubclass(w.category, FutureWarning) and "deprecated" in str(w.message) for w in caught), caught
    lessonlib.report("by_hand", gaps)

    # 4. The real SyncBatchNorm against the hand version, where there is a GPU per rank.
    got, reason = on_gpu(ctx, x, w[mine], weight, bias)
    if got is not None:
        for name, a, b in zip(["output", "input grad", "running var"], got, (out, xs.grad, running_var)):
            assert (a - b.detach()).abs().max().item() < TOL, f"rank {r}: SyncBatchNorm's {name} differs"
    lessonlib.report("gpu", {"ran": got is not None, "reason": reason})

    if ctx.is_main:
        print(
            f"convert_sync_batchnorm: {before} -> {after}; training forward on CPU: {error['type']}: {error['message']}"
        )
        print("by hand: " + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))
        if caught:
            print(f"note: {caught[0].category.__name__}: {caught[0].message}")
        print(f"torch's SyncBatchNorm on the GPU: {reason}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
