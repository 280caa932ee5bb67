"""torchrun --nproc_per_node=2 lessons/09_save_results.py

Saving inference results: one file per rank, merged on rank 0 after a barrier.

Options: --out-dir DIR (default: a temporary folder, removed at the end).

Processes share no memory, so each rank's predictions live in its own process. Here every rank writes
its share of the fixed classifier's results (index, prediction, label, loss) as JSON lines to a file of
its own, rank{r}.jsonl, in a folder that rank 0 creates (a fresh temporary one unless --out-dir names
one) and sends to the others with broadcast_object_list. After a barrier every file is complete;
rank 0 reads them all, removes the sampler's padding duplicates by index, writes the merged
predictions.jsonl in dataset order, and checks it against one process: the same predictions and
bit-identical losses (JSON keeps a float64 exactly). Then it deletes what this run wrote.
"""

import argparse
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

import lessonlib


def classifier(n, classes=4, seed=0):
    """Logits and labels of a fixed random classifier on n items: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (n,), generator=g)
    logits = torch.randn(n, classes, generator=g, dtype=torch.float64)
    logits[torch.arange(n), labels] += 1.0
    return logits, labels


def results(logits, labels, idx):
    """One record per item: what an inference pass would keep."""
    loss = F.cross_entropy(logits[idx], labels[idx], reduction="none")
    return [
        {"index": i, "pred": p, "label": y, "loss": lo}
        for i, p, y, lo in zip(idx.tolist(), logits[idx].argmax(1).tolist(), labels[idx].tolist(), loss.tolist())
    ]


# [start: shared_folder]
def shared_folder(ctx, out_dir=None):
    """A folder every rank knows: rank 0 makes it and broadcasts its path."""
    box = [None]
    if ctx.is_main:
        box[0] = out_dir or tempfile.mkdtemp(prefix="ch9-results-")
        os.makedirs(box[0], exist_ok=True)
    dist.broadcast_object_list(box, src=0)  # every rank, or the others wait here
    return box[0]


# [end: shared_folder]


# [start: save_and_merge]
def save_share(folder, rank, records):
    with open(os.path.join(folder, f"rank{rank}.jsonl"), "w") as f:  # a file per rank: no shared writes
        f.writelines(json.dumps(rec) + "\n" for rec in records)


def merge(folder, world_size):
    """Rank 0, after the barrier: every rank's records, padding duplicates removed by index."""
    merged = {}
    for rank in range(world_size):
        with open(os.path.join(folder, f"rank{rank}.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                assert merged.get(rec["index"], rec) == rec, f"item {rec['index']}: two different results"
                merged[rec["index"]] = rec
    out = [merged[i] for i in sorted(merged)]
    with open(os.path.join(folder, "predictions.jsonl"), "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in out)
    return out


# [end: save_and_merge]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--size", type=int, default=101, choices=range(1, 100001), metavar="1..100000")
    parser.add_argument("--out-dir", default=None, help="folder for the files (default: a new temporary one)")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    n, r, w = args.size, ctx.rank, ctx.world_size
    logits, labels = classifier(n)
    reference = results(logits, labels, torch.arange(n))  # one process, every item once, in order

    folder = shared_folder(ctx, args.out_dir)
    sampler = DistributedSampler(range(n), shuffle=True, seed=0)
    mine = results(logits, labels, torch.tensor(list(sampler)))
    written = [f"rank{k}.jsonl" for k in range(w)] + ["predictions.jsonl"]
    try:
        # [start: run]
        save_share(folder, r, mine)
        dist.barrier()  # every rank's file is closed before rank 0 reads any
        if ctx.is_main:
            merged = merge(folder, w)
            # [end: run]
            assert merged == reference, "rank 0: the merged file differs from one process"
            with open(os.path.join(folder, "predictions.jsonl")) as f:
                assert [json.loads(line) for line in f] == reference, "rank 0: predictions.jsonl != one process"
            lines = {}
            for k in range(w):
                with open(os.path.join(folder, f"rank{k}.jsonl")) as f:
                    lines[f"rank{k}.jsonl"] = sum(1 for _ in f)
            assert sum(lines.values()) == sampler.total_size, f"rank 0: {lines} lines, {sampler.total_size} slots"
            lessonlib.report(
                "files",
                {
                    "folder": folder,
                    "lines per file": lines,
                    "merged": len(merged),
                    "duplicates removed": sampler.total_size - len(merged),
                },
            )
            print(
                f"rank 0: {lines} -> predictions.jsonl with {len(merged)} items "
                f"({sampler.total_size - len(merged)} duplicate(s) removed), equal to one process"
            )
    finally:
        if ctx.is_main:  # only rank 0 deletes, and only after it has read everything
            for name in written:
                if os.path.exists(os.path.join(folder, name)):
                    os.remove(os.path.join(folder, name))
            if args.out_dir is None:
                shutil.rmtree(folder, ignore_errors=True)
    if ctx.is_main:
        left = os.listdir(folder) if os.path.isdir(folder) else []
        assert not set(written) & set(left), f"rank 0: files left behind in {folder}: {left}"
        assert args.out_dir or not os.path.exists(folder), f"rank 0: the temporary folder {folder} is still there"
        print(f"rank 0: removed {len(written)} files" + ("" if args.out_dir else f" and {folder}"))
    lessonlib.teardown()


if __name__ == "__main__":
    main()
