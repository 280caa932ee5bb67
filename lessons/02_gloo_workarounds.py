"""torchrun --nproc_per_node=3 lessons/02_gloo_workarounds.py

What gloo refuses (lessons/02_gloo_support.py), done another way, each result checked.

  PREMUL_SUM(f)        scale locally, then SUM;
  AVG of integers      a float copy, SUM, divide by the size of the group that was summed over
                       (the widely copied `reduce_mean` breaks on integer tensors);
  all_gather, sizes    share the lengths, pad to the longest, gather, trim.
And the averaging mistake next to it: when ranks hold different numbers of samples, the mean of
the per-rank means is not the mean over all samples. All-reduce the sum and the count instead.
Rank r holds r + 1 values here, so the two differ for any world size above 1 (asserted).
"""

import argparse

import torch
import torch.distributed as dist

import lessonlib


# [start: workarounds]
def premul_sum_by_hand(x, factor, group=None):
    """What PREMUL_SUM(factor) computes, on a backend without it: scale locally, then SUM."""
    y = x * factor
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


def reduce_mean(x, group=None):
    """Mean over the ranks of `group`, for any dtype, leaving x untouched (all_reduce works in place)."""
    y = x.double()  # a copy; AVG or `/=` on an int64 tensor fails: the mean is not an integer
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y / dist.get_world_size(group)  # the group's size, not a number passed in by hand


def all_gather_uneven(x, group=None):
    """all_gather for tensors whose first dimension differs per rank: share lengths, pad, gather, trim."""
    n = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(n)]
    dist.all_gather(lengths, torch.tensor([x.shape[0]], device=x.device), group=group)
    longest = max(int(t) for t in lengths)
    padded = torch.zeros(longest, *x.shape[1:], dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return [t[: int(length)] for t, length in zip(out, lengths)]


# [end: workarounds]


# [start: global_mean]
def mean_of_means(values):
    return reduce_mean(values.mean().reshape(1)).item()  # wrong when ranks hold different counts


def global_mean(values):
    count = torch.tensor(float(values.numel()), dtype=values.dtype, device=values.device)
    totals = torch.stack([values.sum(), count])
    dist.all_reduce(totals)  # [sum over all samples, number of samples]
    return (totals[0] / totals[1]).item()


# [end: global_mean]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.parse_args()
    ctx = lessonlib.setup()
    n, r = ctx.world_size, ctx.rank

    x = torch.tensor([r + 1, 10 * (r + 1)], device=ctx.device)
    scaled = premul_sum_by_hand(x.double(), 0.5).tolist()
    assert scaled == [0.5 * n * (n + 1) / 2, 5.0 * n * (n + 1) / 2], f"rank {r}: premul_sum_by_hand {scaled}"
    mean = reduce_mean(x).tolist()
    assert mean == [(n + 1) / 2, 10 * (n + 1) / 2] and x.tolist() == [r + 1, 10 * (r + 1)], f"rank {r}: {mean}"
    parts = all_gather_uneven(torch.full((r + 1,), r, device=ctx.device))  # r + 1 copies of r
    assert [p.tolist() for p in parts] == [[k] * (k + 1) for k in range(n)], f"rank {r}: {parts}"

    values = torch.full((r + 1,), float(r), dtype=torch.float64, device=ctx.device)  # r + 1 samples of r
    every_sample = [k for k in range(n) for _ in range(k + 1)]  # the same data, in one list
    right, wrong = global_mean(values), mean_of_means(values)
    assert abs(right - sum(every_sample) / len(every_sample)) < 1e-12, f"rank {r}: global mean {right}"
    assert n == 1 or abs(wrong - right) > 1e-6, f"rank {r}: the mean of means matched by chance"
    row = lessonlib.report(
        "means",
        {
            "samples per rank": [k + 1 for k in range(n)],
            "mean over all samples": right,
            "mean of per-rank means": wrong,
        },
    )
    if ctx.is_main:
        print(
            f"PREMUL_SUM(0.5) by hand: {scaled}; reduce_mean: {mean}; uneven all_gather: {[p.tolist() for p in parts]}"
        )
        print(
            f"mean over all samples {row['mean over all samples']:.4f}, "
            f"mean of per-rank means {row['mean of per-rank means']:.4f}"
        )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
