"""torchrun --nproc_per_node=2 lessons/09_torchmetrics.py

torchmetrics: per-batch update() on every rank, compute() synced across ranks, checked by hand.

Options: --size 101, --batch-size 8 (the defaults).

The fixed random classifier of this chapter, evaluated over DistributedSampler shares in batches.
MulticlassAccuracy (micro: correct / count) and MeanMetric (the mean loss per item) are updated
with every batch on every rank; compute() all-gathers their states over torch.distributed, which
works on gloo. Asserted on every rank:
  synced compute()          equals the hand-written (sum, count) all-reduce over the same shares;
  sync_on_compute=False     equals this rank's own share only;
  padding duplicates        are counted: torchmetrics does not know which items the sampler repeated,
                            so the synced accuracy equals the padded one, not one process's;
  the fix                   update() with the non-padding items only (is_padding of 09_gather):
                            equal to one process;
  average="macro"           the default: the mean of per-class accuracies, not correct / count;
  MeanMetric fed batch means weighs every batch alike: the mean of means again.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

import lessonlib

CLASSES = 4


def classifier(n, seed=0):
    """Logits and labels of a fixed random classifier on n items: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(CLASSES, (n,), generator=g)
    logits = torch.randn(n, CLASSES, generator=g, dtype=torch.float64)
    logits[torch.arange(n), labels] += 1.0
    return logits, labels


def is_padding(sampler, dataset_len):
    positions = torch.arange(sampler.num_samples) * sampler.num_replicas + sampler.rank
    return positions >= dataset_len


# [start: metrics]
def evaluate(logits, labels, batches, skip=None, sync=True, average="micro"):
    """torchmetrics over this rank's batches of indices; `skip` masks items out (the padding)."""
    acc = MulticlassAccuracy(num_classes=CLASSES, average=average, sync_on_compute=sync)  # micro: correct / all
    loss = MeanMetric(sync_on_compute=sync).set_dtype(torch.float64)  # float32 by default
    for b, idx in enumerate(batches):
        keep = ~skip[b] if skip is not None else torch.ones(len(idx), dtype=torch.bool)
        if not keep.any():
            continue  # a batch of padding only
        out, y = logits[idx[keep]], labels[idx[keep]]
        acc.update(out, y)
        loss.update(F.cross_entropy(out, y, reduction="none"))  # one value per item: weighted right
    return acc.compute().item(), loss.compute().item()  # collectives when sync: call on every rank


# [end: metrics]


def by_hand(logits, labels, idx):
    """(sum, count) all-reduced over every rank's idx: accuracy and mean loss."""
    totals = torch.stack(
        [
            (logits[idx].argmax(1) == labels[idx]).double().sum(),
            F.cross_entropy(logits[idx], labels[idx], reduction="sum"),
            torch.tensor(float(len(idx)), dtype=torch.float64),
        ]
    )
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--size", type=int, default=101, choices=range(1, 100001), metavar="1..100000")
    parser.add_argument("--batch-size", type=int, default=8, choices=range(1, 1001), metavar="1..1000")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    n, r, w = args.size, ctx.rank, ctx.world_size
    logits, labels = classifier(n)
    truth = ((logits.argmax(1) == labels).double().mean().item(), F.cross_entropy(logits, labels).item())

    sampler = DistributedSampler(range(n), shuffle=True, seed=0)
    idx = torch.tensor(list(sampler))
    batches, pad = idx.split(args.batch_size), is_padding(sampler, n).split(args.batch_size)
    results = {
        "torchmetrics, synced": evaluate(logits, labels, batches),
        "by hand, (sum, count)": by_hand(logits, labels, idx),
        "torchmetrics, sync_on_compute=False": evaluate(logits, labels, batches, sync=False),
        "this rank's share, by hand": (
            (logits[idx].argmax(1) == labels[idx]).double().mean().item(),
            F.cross_entropy(logits[idx], labels[idx]).item(),
        ),
        "torchmetrics, padding skipped": evaluate(logits, labels, batches, skip=pad),
        "torchmetrics, padding skipped, average='macro'": evaluate(logits, labels, batches, skip=pad, average="macro"),
    }
    # The defaults this lesson overrides: average="macro" (the mean over classes of each class's
    # accuracy, another number than correct / all) and float32 states for MeanMetric.
    assert MulticlassAccuracy(num_classes=CLASSES).average == "macro", "the default average changed"
    assert MeanMetric().mean_value.dtype == torch.float32, "MeanMetric's default state dtype changed"
    right = logits.argmax(1) == labels
    per_class = [right[labels == c].double().mean().item() for c in range(CLASSES)]
    macro = sum(per_class) / CLASSES
    # [start: batch_means]
    of_means = MeanMetric().set_dtype(torch.float64)
    for b in batches:
        of_means.update(F.cross_entropy(logits[b], labels[b]))  # a batch mean, weight 1: wrong
    # [end: batch_means]
    loss_of_means = of_means.compute().item()
    batch_means = torch.cat([F.cross_entropy(logits[b], labels[b]).reshape(1) for b in batches])
    sums = torch.stack([batch_means.sum(), torch.tensor(float(len(batch_means)), dtype=torch.float64)])
    dist.all_reduce(sums)
    assert abs(loss_of_means - (sums[0] / sums[1]).item()) < 1e-12, f"rank {r}: MeanMetric of batch means"

    def close(a, b):  # accuracy: torchmetrics returns float32; loss: float64 states here
        return abs(a[0] - b[0]) < 1e-6 and abs(a[1] - b[1]) < 1e-12

    got = results
    assert close(got["torchmetrics, synced"], got["by hand, (sum, count)"]), f"rank {r}: {got}"
    assert close(got["torchmetrics, sync_on_compute=False"], got["this rank's share, by hand"]), f"rank {r}: {got}"
    assert close(got["torchmetrics, padding skipped"], truth), f"rank {r}: padding skipped {got} vs {truth}"
    macro_acc = got["torchmetrics, padding skipped, average='macro'"][0]
    assert abs(macro_acc - macro) < 1e-6 and abs(macro - truth[0]) > 1e-6, f"rank {r}: macro {macro_acc}, {macro}"
    padded = sampler.total_size > n
    assert (not close(got["torchmetrics, synced"], truth)) == padded, f"rank {r}: padding not seen {got}"
    assert (abs(loss_of_means - truth[1]) > 1e-9) == (w > 1 or n % args.batch_size != 0), (r, loss_of_means)
    rows = [{"how": "one process", "accuracy": truth[0], "mean loss": truth[1]}]
    rows += [{"how": k, "accuracy": a, "mean loss": lo} for k, (a, lo) in got.items()]
    rows.append({"how": "torchmetrics MeanMetric fed batch means", "accuracy": None, "mean loss": loss_of_means})
    lessonlib.report("rows", rows)
    if ctx.is_main:
        print(f"{n} items, {sampler.total_size} slots on {w} rank(s), batches of {args.batch_size}")
        for row in rows:
            acc = "" if row["accuracy"] is None else f"{row['accuracy']:.6f}"
            print(f"  {row['how']:48} accuracy {acc:8}  mean loss {row['mean loss']:.6f}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
