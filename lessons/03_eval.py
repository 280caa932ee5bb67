"""torchrun --nproc_per_node=3 lessons/03_eval.py

Evaluating on W ranks: padding duplicates bias the metric; uneven shards need equal collective calls.

Options: --log-every-batch (the pitfall), best with --pg-timeout 3 (the process-group timeout in seconds;
lessonlib's default is 30), which bounds the longer rank's wait.

The "model" here is a fixed answer sheet: sample i is classified correctly unless i % 3 == 0, so the
true accuracy over the n samples is known exactly, computed in one process. Three evaluations:
  DistributedSampler     pads to a multiple of W, so a few samples count twice: accuracy is off;
  unpadded shards        indices[rank::W], lengths differ by at most one; sum and count are
                         all-reduced once after the loop: exactly the one-process accuracy;
  agreed step count      the same shards, for a metric logged every batch: the ranks first agree on
                         the longest shard's number of batches, and a rank out of data joins each
                         remaining all_reduce with zeros.
With --log-every-batch the middle evaluation also all-reduces each batch's counts, the way a progress
line is often logged. Ranks with a shorter shard make that call once less: their final all_reduce
pairs with the longer rank's last per-batch one (collectives match by order, not by purpose), so they
return a wrong accuracy without any error and leave; the longer rank waits in its final all_reduce
for partners that are gone, which fails (peer gone, or the process-group timeout).
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler

import lessonlib


def is_correct(indices):
    return (indices % 3 != 0).long()  # the fixed answer sheet


# [start: shards]
class ShardSampler(Sampler):
    """Evaluation sampler: rank r gets indices[r::W], no padding, so shard lengths may differ by one."""

    def __init__(self, n, rank, world_size):
        self.indices = list(range(rank, n, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def evaluate(loader, log_every_batch=False):
    """Accuracy over every rank's shard: all-reduce the sum and the count once, after the loop."""
    totals = torch.zeros(2, dtype=torch.long)  # [correct, seen]
    for batch in loader:
        this_batch = torch.stack([is_correct(batch).sum(), torch.tensor(len(batch))])
        totals += this_batch
        if log_every_batch:  # wrong with uneven shards: not every rank makes this call equally often
            dist.all_reduce(this_batch)  # e.g. for a progress line: this batch's accuracy, all ranks
    dist.all_reduce(totals)
    return totals[0].item() / totals[1].item(), totals.tolist()


# [end: shards]


# [start: agreed]
def evaluate_logging_every_batch(loader):
    """A per-batch collective made safe: every rank runs the same number of steps."""
    steps = torch.tensor(len(loader))
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    batches, totals = iter(loader), torch.zeros(2, dtype=torch.long)
    for _ in range(int(steps)):
        batch = next(batches, torch.zeros(0, dtype=torch.long))  # out of data: contribute nothing
        totals += torch.stack([is_correct(batch).sum(), torch.tensor(len(batch))])
        running = totals.clone()
        dist.all_reduce(running)  # every rank calls this `steps` times
    return running[0].item() / running[1].item(), running.tolist()


# [end: agreed]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--size",
        type=int,
        default=13,
        choices=range(1, 10001),
        metavar="1..10000",
        help="samples (default 13: divisible by none of 2, 3, 4)",
    )
    parser.add_argument("--batch-size", type=int, default=2, choices=range(1, 1001), metavar="1..1000")
    parser.add_argument("--log-every-batch", action="store_true", help="the pitfall: a collective per batch")
    parser.add_argument("--pg-timeout", type=float, default=None, help="process-group timeout in seconds")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)  # CPU tensors: gloo, GPUs or not
    n, b, w = args.size, args.batch_size, ctx.world_size
    truth = is_correct(torch.arange(n)).sum().item() / n  # one process, every sample once

    padded_sampler = DistributedSampler(range(n), shuffle=False)
    padded, padded_totals = evaluate(DataLoader(range(n), batch_size=b, sampler=padded_sampler))
    shards = DataLoader(range(n), batch_size=b, sampler=ShardSampler(n, ctx.rank, w))
    if args.log_every_batch:  # the pitfall alone: show where each rank gets to, then leave
        print(f"rank {ctx.rank}: {len(shards)} batch(es), so {len(shards)} per-batch all_reduce call(s)")
        exact, exact_totals = evaluate(shards, log_every_batch=True)
        print(f"rank {ctx.rank}: evaluation returned {exact:.4f} from totals {exact_totals}")
        lessonlib.report("pitfall", {"accuracy": exact, "totals": exact_totals})
        # Leave the way most scripts do, without a closing barrier: a barrier here would be one more
        # mismatched collective, and every rank would then time out together, whichever first.
        dist.destroy_process_group()
        return
    exact, exact_totals = evaluate(shards)
    agreed, agreed_totals = evaluate_logging_every_batch(shards)

    # The padded list is range(n) followed by its first (total - n) indices again.
    total = len(padded_sampler) * w
    padded_list = torch.tensor((list(range(n)) * (total // n + 1))[:total])
    assert padded_totals == [is_correct(padded_list).sum().item(), total], padded_totals
    assert exact_totals == agreed_totals == [round(truth * n), n], (exact_totals, agreed_totals)
    assert exact == agreed == truth, f"rank {ctx.rank}: {exact}, {agreed} != {truth}"
    lessonlib.report(
        "eval",
        {
            "truth": truth,
            "padded": padded,
            "padded_counts": padded_totals,
            "shards": exact,
            "agreed": agreed,
            "shard_length": len(shards.sampler),
            "batches": len(shards),
            "padding": total - n,
        },
    )
    print(f"rank {ctx.rank}: {len(shards.sampler)} samples in {len(shards)} batch(es)")
    if ctx.is_main:
        print(
            f"accuracy over {n} samples: one process {truth:.4f} | DistributedSampler {padded:.4f} "
            f"({total - n} padding duplicate(s)) | unpadded shards {exact:.4f} | agreed steps {agreed:.4f}"
        )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
