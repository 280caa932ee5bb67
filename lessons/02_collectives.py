"""torchrun --nproc_per_node=4 lessons/02_collectives.py

Every collective, run once: what each rank holds before and after, checked against a closed form.

Options: --ops OP,OP,... (default: all), --numel N (1..9; default: the world size), --absent-rank R,
--pg-timeout SECONDS.

Rank r starts from x_r = [10r + 1, 10r + 2, ..., 10r + n] (n = world size): the tens digit says
which rank a number came from, the units digit its position. Each op prints every rank's tensor
before and after, reports both to the notebook, and asserts the result against an expected value
computed with plain Python, not torch. `--ops` picks a comma-separated subset (default: all).
`--numel N` gives every rank N elements instead (1..9, so that the units digit stays the position):
scatter, reduce_scatter_single and all_to_all_single cut a tensor into n contiguous chunks of N / n
elements, one per rank, so for them N must be a multiple of n.

`--absent-rank R` makes rank R skip the barriers, to see a barrier that one rank never reaches
(chapter 2, "Barriers"): `barrier` fails with the process-group timeout and does not say who is
missing; `monitored_barrier` names the missing rank.
"""

import argparse
import datetime
import math
import time

import torch
import torch.distributed as dist

import lessonlib

OPS = [
    "broadcast",
    "scatter",
    "reduce",
    "gather",
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
]
REDUCE_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
SPLIT_OPS = ["scatter", "reduce_scatter_single", "all_to_all_single"]  # one chunk of the tensor per rank


def start(ctx, rank, numel, dtype=torch.int64):
    """Rank `rank`'s starting tensor, on this process's device (a GPU under NCCL)."""
    return torch.tensor([10 * rank + j + 1 for j in range(numel)], dtype=dtype, device=ctx.device)


def value(r, j):
    """Element j of rank r's starting tensor, without torch: the closed forms below use only this."""
    return 10 * r + j + 1


def show(ctx, op, before, after, expected, note=""):
    """Print and report one rank's view of one op; assert it got what the closed form says."""
    print(f"{op:<24} before {before}  after {after}{'  ' + note if note else ''}")
    lessonlib.report("op", {"op": op, "before": before, "after": after, "note": note})
    if expected is not None:
        assert after == expected, f"rank {ctx.rank}: {op} gave {after}, expected {expected}"


# [start: one_to_many]
def run_broadcast(ctx, n, numel):
    x = start(ctx, ctx.rank, numel)
    before = x.tolist()
    dist.broadcast(x, src=0)  # every rank ends with rank 0's tensor
    show(ctx, "broadcast", before, x.tolist(), [value(0, j) for j in range(numel)])


def run_scatter(ctx, n, numel):
    c = numel // n  # one chunk of c elements per rank (main() has checked that n divides numel)
    out = torch.zeros(c, dtype=torch.int64, device=ctx.device)
    chunks = list(start(ctx, 0, numel).chunk(n)) if ctx.is_main else None  # only the source holds the list
    dist.scatter(out, chunks, src=0)  # rank k receives chunk k
    show(
        ctx,
        "scatter",
        start(ctx, 0, numel).tolist() if ctx.is_main else None,
        out.tolist(),
        [value(0, ctx.rank * c + i) for i in range(c)],
    )


# [end: one_to_many]


# [start: many_to_one]
def run_reduce(ctx, n, numel):
    x = start(ctx, ctx.rank, numel)
    before = x.tolist()
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)
    total = [sum(value(r, j) for r in range(n)) for j in range(numel)]
    if ctx.is_main:
        show(ctx, "reduce (SUM to 0)", before, x.tolist(), total)
    else:  # the result is only defined on dst; here the buffer may hold partial sums
        show(
            ctx,
            "reduce (SUM to 0)",
            before,
            x.tolist(),
            None,
            "unchanged" if x.tolist() == before else "changed: scratch space, not a result",
        )


def run_gather(ctx, n, numel):
    x = start(ctx, ctx.rank, numel)
    out = [torch.zeros(numel, dtype=torch.int64, device=ctx.device) for _ in range(n)] if ctx.is_main else None
    dist.gather(x, out, dst=0)
    expected = [value(r, j) for r in range(n) for j in range(numel)] if ctx.is_main else None
    show(ctx, "gather (to 0)", x.tolist(), torch.cat(out).tolist() if ctx.is_main else None, expected)


# [end: many_to_one]


# [start: all_reduce]
def run_all_reduce(ctx, n, numel):
    closed_form = {
        "SUM": lambda j: sum(value(r, j) for r in range(n)),
        "PRODUCT": lambda j: math.prod(value(r, j) for r in range(n)),
        "MIN": lambda j: value(0, j),
        "MAX": lambda j: value(n - 1, j),
        "AVG": lambda j: sum(value(r, j) for r in range(n)) / n,
    }
    for name in REDUCE_OPS:
        dtype = torch.float64 if name == "AVG" else torch.int64  # AVG divides: see 02_gloo_support.py
        x = start(ctx, ctx.rank, numel, dtype)
        before = x.tolist()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, name))
        show(ctx, f"all_reduce {name}", before, x.tolist(), [closed_form[name](j) for j in range(numel)])


# [end: all_reduce]


# [start: all_to_all]
def run_all_gather(ctx, n, numel):
    x = start(ctx, ctx.rank, numel)
    out = [torch.zeros(numel, dtype=torch.int64, device=ctx.device) for _ in range(n)]
    dist.all_gather(out, x)  # a list with one tensor per rank
    show(ctx, "all_gather", x.tolist(), torch.cat(out).tolist(), [value(r, j) for r in range(n) for j in range(numel)])


def run_all_gather_single(ctx, n, numel):
    x = start(ctx, ctx.rank, numel)
    out = torch.zeros(n * numel, dtype=torch.int64, device=ctx.device)
    # One flat output tensor instead of a list of n. torch 2.14 renamed all_gather_into_tensor to this.
    dist.all_gather_single(out, x)
    show(ctx, "all_gather_single", x.tolist(), out.tolist(), [value(r, j) for r in range(n) for j in range(numel)])


def run_reduce_scatter_single(ctx, n, numel):
    c = numel // n
    x = start(ctx, ctx.rank, numel)
    out = torch.zeros(c, dtype=torch.int64, device=ctx.device)
    # Rank k gets the sum of everyone's chunk k (formerly reduce_scatter_tensor; reduce_scatter takes lists).
    dist.reduce_scatter_single(out, x, op=dist.ReduceOp.SUM)
    show(
        ctx,
        "reduce_scatter_single",
        x.tolist(),
        out.tolist(),
        [sum(value(r, ctx.rank * c + i) for r in range(n)) for i in range(c)],
    )


def run_all_to_all_single(ctx, n, numel):
    c = numel // n
    x = start(ctx, ctx.rank, numel)
    out = torch.zeros(numel, dtype=torch.int64, device=ctx.device)
    dist.all_to_all_single(out, x)  # rank k sends its chunk j to rank j: a transpose across ranks
    show(
        ctx,
        "all_to_all_single",
        x.tolist(),
        out.tolist(),
        [value(r, ctx.rank * c + i) for r in range(n) for i in range(c)],
    )


# [end: all_to_all]


# [start: barriers]
def run_barrier(ctx, n, monitored=False, absent_rank=-1, gloo=None):
    time.sleep(0.2 * ctx.rank)  # ranks arrive at different times
    arrived = time.time()
    if ctx.rank == absent_rank:
        print(f"rank {ctx.rank}: not going to the barrier (--absent-rank)", flush=True)
        time.sleep(60)
    if monitored:  # gloo only: rank 0 checks in every rank and names any that does not arrive in time
        dist.monitored_barrier(group=gloo, timeout=datetime.timedelta(seconds=5))
    else:
        dist.barrier()
    left = time.time()
    stamps = [None] * n
    dist.all_gather_object(stamps, (arrived, left))
    last_arrival = max(a for a, _ in stamps)
    # Nobody leaves a barrier before the last rank has arrived (one clock: all ranks are on this machine).
    assert left >= last_arrival - 1e-3, f"rank {ctx.rank} left {last_arrival - left:.3f} s before the last arrival"
    op = "monitored_barrier" if monitored else "barrier"
    show(ctx, op, f"arrived at +{arrived - stamps[0][0]:.2f} s", f"left at +{left - stamps[0][0]:.2f} s", None)


# [end: barriers]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--ops",
        type=lessonlib.comma_list(choices=OPS),
        default=",".join(OPS),
        help=f"comma-separated subset of: {', '.join(OPS)}",
    )
    # At most 9, so that the units digit stays the position: with 10 or more, rank 0's eleventh number
    # would be 11, like rank 1's first.
    parser.add_argument(
        "--numel",
        type=int,
        default=None,
        choices=range(1, 10),
        metavar="1..9",
        help="elements in each rank's tensor (default: the world size)",
    )
    parser.add_argument("--absent-rank", type=int, default=-1, help="this rank never reaches the barriers")
    parser.add_argument("--pg-timeout", type=float, default=None, help="process-group timeout, seconds")
    args = parser.parse_args()
    ops = args.ops

    ctx = lessonlib.setup(timeout=args.pg_timeout)
    n = ctx.world_size
    numel = n if args.numel is None else args.numel
    split = [op for op in ops if op in SPLIT_OPS]
    if split and numel % n:
        lessonlib.teardown()  # leave the group together before exiting: see its docstring
        allowed = ", ".join(str(v) for v in range(n, 10, n)) or "none of 1..9: omit --numel"
        one = len(split) == 1
        parser.error(
            f"--numel {numel}: {', '.join(split)} {'cuts' if one else 'cut'} each tensor into {n} equal "
            f"chunks, one per rank, so at {n} ranks --numel must be a multiple of {n} ({allowed}); "
            f"or leave {'it' if one else 'them'} out with --ops"
        )
    # monitored_barrier exists on gloo only: under NCCL it runs on a gloo group of all ranks.
    gloo = dist.group.WORLD if ctx.backend == "gloo" else dist.new_group(backend="gloo", timeout=ctx.timeout)
    runs = {
        "broadcast": run_broadcast,
        "scatter": run_scatter,
        "reduce": run_reduce,
        "gather": run_gather,
        "all_reduce": run_all_reduce,
        "all_gather": run_all_gather,
        "all_gather_single": run_all_gather_single,
        "reduce_scatter_single": run_reduce_scatter_single,
        "all_to_all_single": run_all_to_all_single,
    }
    for op in ops:
        if op in ("barrier", "monitored_barrier"):
            run_barrier(ctx, n, monitored=op == "monitored_barrier", absent_rank=args.absent_rank, gloo=gloo)
        else:
            runs[op](ctx, n, numel)
    if ctx.is_main:
        print(
            f"{len(ops)} ops checked on {n} ranks against their closed forms, backend {ctx.backend}"
            + ("" if args.numel is None else f", {numel} elements per rank")
        )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
