"""torchrun --nproc_per_node=3 lessons/09_averages.py

Averaging a metric over ranks: the mean of means against all-reducing (sum, count).

Options: --size 101, --batch-size 8 (the defaults).

The "model" is a fixed random classifier: every item's logits and label come from one seeded
generator, so every rank builds the same table and one process can compute the true mean loss and
accuracy over all n items. Rank r evaluates the unpadded shard indices[r::W] (chapter 3) in batches
of b. With n = 101 (a prime) nothing divides evenly: the shards differ in length and each rank's last
batch is shorter. Four averages, each asserted against a one-process computation:
  (sum, count) all-reduced once        equals the true mean (to float64 rounding);
  mean of per-batch means              differs: a short last batch weighs as much as a full one;
  mean of per-rank means (reduce_mean) differs: the shorter shard weighs as much as a longer one;
  reduce_mean on equal shards          equals the mean over those items: the case it was written for.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lessonlib

TOL = 1e-12


def classifier_outputs(n, classes=4, seed=0):
    """Logits and labels of a fixed random classifier on n items: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (n,), generator=g)
    logits = torch.randn(n, classes, generator=g, dtype=torch.float64)
    logits[torch.arange(n), labels] += 1.0  # better than chance, far from perfect
    loss = F.cross_entropy(logits, labels, reduction="none")
    correct = (logits.argmax(1) == labels).double()
    return loss, correct


# [start: averages]
def reduce_mean(tensor, nprocs):
    """The widely copied reduce_mean helper, as written: the sum over ranks divided by the number of ranks."""
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= nprocs
    return rt


def global_mean(batches):
    """Right: all-reduce (sum, count) once, divide once."""
    totals = torch.tensor([sum(b.sum().item() for b in batches), sum(len(b) for b in batches)], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def mean_of_rank_means(batches, world_size):
    """Wrong with uneven shards: every rank's mean counts once, whatever its number of items."""
    return reduce_mean(torch.cat(batches).mean(), world_size).item()


def mean_of_batch_means(batches):
    """Wrong with a short batch: every batch's mean counts once, whatever its length."""
    totals = torch.tensor([sum(b.mean().item() for b in batches), len(batches)], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


# [end: averages]


def expected_in_one_process(values, n, w, b):
    """What each average should give, from every rank's shard, in one process without collectives."""
    shards = [values[r:n:w] for r in range(w)]  # indices[r::W]
    batches = [chunk for s in shards for chunk in s.split(b)]
    return {
        "truth": values.mean().item(),
        "mean of per-rank means": sum(s.mean().item() for s in shards) / w,
        "mean of per-batch means": sum(c.mean().item() for c in batches) / len(batches),
        "uneven shards": len({len(s) for s in shards}) > 1,
        "uneven batches": len({len(c) for c in batches}) > 1,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--size",
        type=int,
        default=101,
        choices=range(2, 100001),
        metavar="2..100000",
        help="items (default 101, a prime: no world size or batch size divides it)",
    )
    parser.add_argument("--batch-size", type=int, default=8, choices=range(1, 1001), metavar="1..1000")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    n, b, r, w = args.size, args.batch_size, ctx.rank, ctx.world_size
    if n < w * b:
        raise SystemExit(f"--size {n} is too small: the equal-shard case needs {w} x {b} items")
    rows = []
    for name, values in zip(("loss", "accuracy"), classifier_outputs(n)):
        batches = [values[i] for i in torch.arange(r, n, w).split(b)]  # this rank's shard, batches of b
        got = {
            "(sum, count) all-reduced": global_mean(batches),
            "mean of per-rank means": mean_of_rank_means(batches, w),
            "mean of per-batch means": mean_of_batch_means(batches),
        }
        want = expected_in_one_process(values, n, w, b)
        truth = want["truth"]
        assert abs(got["(sum, count) all-reduced"] - truth) < TOL, f"rank {r}: {name} {got} != {truth}"
        for wrong, uneven in (
            ("mean of per-rank means", "uneven shards"),
            ("mean of per-batch means", "uneven batches"),
        ):
            assert abs(got[wrong] - want[wrong]) < TOL, f"rank {r}: {name} {wrong} {got[wrong]} != {want[wrong]}"
            # Equal lengths make it right; unequal ones make it wrong unless the means match by chance.
            assert (abs(got[wrong] - truth) > 1e-9) == want[uneven], (
                f"rank {r}: {name} {wrong} {got[wrong]} vs {truth} with {uneven} = {want[uneven]}"
            )
        rows += [{"metric": name, "average": k, "value": v, "error": v - truth} for k, v in got.items()]

        # What reduce_mean is right for: one training step, every rank a full batch of b items.
        step_mean = values[: w * b].mean().item()  # one process on the W x b items of the step
        equal = reduce_mean(values[r * b : (r + 1) * b].mean(), w).item()
        assert abs(equal - step_mean) < TOL, f"rank {r}: {name} reduce_mean on equal shards {equal} != {step_mean}"
        rows.append(
            {
                "metric": name,
                "average": f"reduce_mean, {w} equal batches of {b}",
                "value": equal,
                "error": equal - step_mean,
            }
        )

    lengths = [len(range(k, n, w)) for k in range(w)]
    lessonlib.report(
        "shape", {"items per rank": lengths, "batch lengths": [len(c) for c in torch.arange(r, n, w).split(b)]}
    )
    if ctx.is_main:
        lessonlib.report("averages", rows)
        print(f"{n} items on {w} rank(s): {lengths} per rank, batches of {b}")
        for row in rows:
            print(f"  {row['metric']:8} {row['average']:32} {row['value']:.6f} ({row['error']:+.1e})")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
