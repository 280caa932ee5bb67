"""torchrun --nproc_per_node=2 lessons/12_mismatch.py

Ranks that call different collectives, or the same one on different shapes: what happens, and how
TORCH_DISTRIBUTED_DEBUG=DETAIL names the difference.

Options: --bug shapes or --bug order (make the mistake; default: none), --pg-timeout S (default 30).
Run with TORCH_DISTRIBUTED_DEBUG=DETAIL in the environment to have every collective checked across ranks.
--time-calls N: first time N all-reduces of one number, and report the mean time per call (what DETAIL costs).

Each rank holds the predictions for its share of an evaluation set and all-reduces a summary of them.
--bug shapes: each rank all-reduces its raw predictions, and the shares differ in length when the set does not
divide evenly (rank r here holds 3 + r of them). gloo does not compare lengths: on 2 ranks, rank 0 gets back
sums for the 3 elements it has and goes on as if nothing were wrong, while rank 1 waits for a fourth element
that never comes, until the timeout.
--bug order: rank 0 logs (a broadcast of its step count) before it reduces its summary, the others after:
every collective pairs with whatever the other ranks call in the same position, so they wait on each other.
The fix for both: every rank calls the same collectives, in the same order, on tensors of the same shape
(here: reduce fixed-size sums, not variable-length lists).
"""

import argparse
import time

import torch
import torch.distributed as dist

import lessonlib

BUGS = ("none", "shapes", "order")


def predictions(rank):
    """This rank's share of the predictions: 3 + rank values (the shares are uneven)."""
    return torch.arange(3 + rank, dtype=torch.float64) + 10 * rank


def summarize(ctx, bug):
    preds = predictions(ctx.rank)
    step = torch.tensor([100.0 + ctx.rank])
    # [start: shapes]
    if bug == "shapes":
        dist.all_reduce(preds)  # a different length on every rank
        return preds
    # [end: shapes]
    # [start: order]
    if bug == "order" and ctx.rank == 0:
        dist.broadcast(step, src=0)  # rank 0 logs first...
        summary = torch.stack([preds.sum(), torch.tensor(float(len(preds)), dtype=torch.float64)])
        dist.all_reduce(summary)  # ...then reduces; the others do it the other way round
        return summary
    # [end: order]
    # [start: fixed]
    summary = torch.stack([preds.sum(), torch.tensor(float(len(preds)), dtype=torch.float64)])
    dist.all_reduce(summary)  # two numbers on every rank: the sum and the count
    dist.broadcast(step, src=0)  # every rank, in the same place
    return summary
    # [end: fixed]


def time_calls(n):
    """Mean seconds per all-reduce of one number, over n calls (after 5 untimed ones)."""
    x = torch.zeros(1)
    for _ in range(5):
        dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    return (time.perf_counter() - start) / n


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--bug", choices=BUGS, default="none", help="the mistake to make (default: none)")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="init_process_group's timeout, seconds")
    parser.add_argument("--time-calls", type=int, default=0, choices=range(0, 100_001), metavar="0..100000")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    if args.time_calls:  # before any mistake, while every rank calls the same collectives
        per_call = time_calls(args.time_calls)
        lessonlib.report("per_call", per_call)
        print(f"rank {ctx.rank}: {per_call * 1e6:.0f} us per all-reduce of one number")
    got = summarize(ctx, args.bug)
    every = [predictions(r) for r in range(ctx.world_size)]
    lessonlib.report("got", got.tolist())
    print(f"rank {ctx.rank}: holds {len(every[ctx.rank])} predictions, got {got.tolist()}")
    if args.bug != "shapes":  # with mismatched shapes there is nothing right to compare with
        want = [sum(p.sum().item() for p in every), float(sum(len(p) for p in every))]
        assert got.tolist() == want, f"rank {ctx.rank}: got {got.tolist()}, expected {want}"
        if ctx.is_main:
            print(f"mean prediction over all {want[1]:g}: {want[0] / want[1]:.4f}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
