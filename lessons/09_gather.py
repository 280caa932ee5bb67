"""torchrun --nproc_per_node=3 lessons/09_gather.py

DistributedSampler's padding duplicates skew a metric; gathering (index, prediction) removes them.

Options: --size 101 (the default).

Every rank predicts with the same fixed random classifier on its DistributedSampler share (shuffle
on, the default, as many tutorials' test loaders have it). The sampler pads to a multiple of W by
repeating the first indices of the epoch's order, so a few items are evaluated twice:
  (sum, count) over the padded shares    biased (asserted equal to the padded list's accuracy);
  drop padding by position               rank r's j-th item sits at position j*W + r of the padded
                                         list, padding when that is >= len(dataset): exact;
  all_gather, padded + lengths           the now uneven (index, prediction) pairs, padded to the
                                         longest share, gathered with a lengths tensor, trimmed;
  all_gather_object / gather_object      every share as Python pairs, on every rank / on rank 0,
                                         duplicates removed by index.
Each way gives back all n predictions in dataset order, equal to one process's (asserted).
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import lessonlib


def classifier(n, classes=4, seed=0):
    """Predictions and labels of a fixed random classifier on n items: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (n,), generator=g)
    logits = torch.randn(n, classes, generator=g, dtype=torch.float64)
    logits[torch.arange(n), labels] += 1.0  # better than chance, far from perfect
    return logits.argmax(1), labels


# [start: positions]
def is_padding(sampler, dataset_len):
    """Which of this rank's items are padding duplicates, from the sampler's own arithmetic."""
    w, r = sampler.num_replicas, sampler.rank
    positions = torch.arange(sampler.num_samples) * w + r  # where each item sits in the padded list
    return positions >= dataset_len  # total_size - len(dataset) slots at the end are the padding


# [end: positions]


# [start: pad_and_lengths]
def all_gather_pairs(idx, preds):
    """Every rank's (index, prediction) pairs, shares of any length: lengths first, pad, gather, trim."""
    w = dist.get_world_size()
    pairs = torch.stack([idx, preds], dim=1)  # (k, 2), k may differ per rank
    lengths = [torch.zeros(1, dtype=torch.long) for _ in range(w)]
    dist.all_gather(lengths, torch.tensor([len(pairs)]))
    longest = max(int(k) for k in lengths)
    padded = torch.full((longest, 2), -1, dtype=torch.long)  # all_gather needs equal shapes
    padded[: len(pairs)] = pairs
    out = [torch.empty_like(padded) for _ in range(w)]
    dist.all_gather(out, padded)
    return torch.cat([t[: int(k)] for t, k in zip(out, lengths)])


# [end: pad_and_lengths]


# [start: dedupe]
def by_index(pairs, n):
    """Predictions in dataset order from (index, prediction) pairs; duplicates must agree."""
    preds = torch.full((n,), -1, dtype=torch.long)
    for i, p in pairs:
        assert int(preds[i]) in (-1, p), f"item {i}: two different predictions, {int(preds[i])} and {p}"
        preds[i] = p
    assert (preds >= 0).all(), f"items never predicted: {(preds < 0).nonzero().flatten().tolist()}"
    return preds


# [end: dedupe]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--size",
        type=int,
        default=101,
        choices=range(1, 100001),
        metavar="1..100000",
        help="items (default 101, a prime: no world size divides it)",
    )
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    n, r, w = args.size, ctx.rank, ctx.world_size
    all_preds, labels = classifier(n)
    truth = (all_preds == labels).sum().item() / n  # one process, every item once

    sampler = DistributedSampler(range(n), shuffle=True, seed=0)  # pads: total_size >= n
    idx = torch.tensor(list(sampler), dtype=torch.long)
    preds = all_preds[idx]  # what the model says on this rank's share
    totals = torch.stack([(preds == labels[idx]).sum(), torch.tensor(len(idx))])
    dist.all_reduce(totals)
    padded_acc = totals[0].item() / totals[1].item()  # counts the duplicates twice
    # The same numbers without collectives, from the sampler's recipe (chapter 3).
    total = sampler.total_size
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    padded_list = order.repeat(total // n + 1)[:total]
    assert idx.tolist() == padded_list[r::w].tolist(), f"rank {r}: the sampler did not follow its recipe"
    expected_padded = (all_preds[padded_list] == labels[padded_list]).double().mean().item()
    assert totals[1].item() == total and abs(padded_acc - expected_padded) < 1e-12, (r, padded_acc)
    # n = 101 is prime: c/101 with 0 < c < 101 cannot equal (c + d)/(101 + p) for 0 < p < 101.
    assert (padded_acc != truth) == (total > n), f"rank {r}: padded {padded_acc}, truth {truth}"

    pad = is_padding(sampler, n)
    seen_before = [padded_list[pos].item() in padded_list[:pos].tolist() for pos in range(total)]
    assert pad.tolist() == seen_before[r::w], f"rank {r}: is_padding {pad.tolist()} misses the duplicates"
    kept = torch.stack([(preds[~pad] == labels[idx[~pad]]).sum(), (~pad).sum()])
    dist.all_reduce(kept)
    by_position = kept[0].item() / kept[1].item()

    gathered = all_gather_pairs(idx[~pad], preds[~pad])  # uneven shares now
    from_tensors = by_index(gathered.tolist(), n)

    # [start: objects]
    everyone = [None] * w
    dist.all_gather_object(everyone, list(zip(idx.tolist(), preds.tolist())))  # padding included
    from_objects = by_index([pair for share in everyone for pair in share], n)

    at_root = [None] * w if ctx.is_main else None  # only dst passes a list
    dist.gather_object(list(zip(idx.tolist(), preds.tolist())), at_root, dst=0)
    if ctx.is_main:  # the pairs are on rank 0 alone
        from_root = by_index([pair for share in at_root for pair in share], n)
        # [end: objects]
        assert torch.equal(from_root, all_preds), "rank 0: gather_object + de-duplication != one process"
    else:
        assert at_root is None, f"rank {r}: gather_object gave a non-destination rank {at_root}"

    for name, got in (("all_gather padded + lengths", from_tensors), ("all_gather_object", from_objects)):
        assert torch.equal(got, all_preds), f"rank {r}: {name} predictions differ from one process"
    assert by_position == truth, f"rank {r}: dropping padding by position gave {by_position}, truth {truth}"
    lessonlib.report("share", {"indices": idx.tolist(), "padding": pad.tolist(), "kept": int((~pad).sum())})
    if ctx.is_main:
        rows = [
            {"method": "one process", "items counted": n, "accuracy": truth},
            {"method": "(sum, count) over DistributedSampler shares", "items counted": total, "accuracy": padded_acc},
            {"method": "padding dropped by position", "items counted": int(kept[1]), "accuracy": by_position},
        ]
        rows += [
            {
                "method": f"{name}, de-duplicated by index",
                "items counted": n,
                "accuracy": (got == labels).sum().item() / n,
            }
            for name, got in (
                ("all_gather padded + lengths", from_tensors),
                ("all_gather_object", from_objects),
                ("gather_object to rank 0", from_root),
            )
        ]
        lessonlib.report("methods", rows)
        dups = padded_list[n:].tolist()
        print(f"{n} items, {total} slots on {w} rank(s): padding duplicates of items {dups}")
        for row in rows:
            print(f"  {row['method']:52} {row['items counted']:4} items  accuracy {row['accuracy']:.6f}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
