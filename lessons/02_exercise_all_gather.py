"""torchrun --nproc_per_node=3 lessons/02_exercise_all_gather.py

Checker for the chapter 2 exercise: all_gather built from dist.broadcast alone.

Options: --solution FILE checks your answer, the function named by --function NAME (default:
all_gather_from_broadcast) in FILE.

A solution is a function `f(tensor_list, tensor)` that, like dist.all_gather, fills tensor_list[k]
with rank k's `tensor` on every rank, and leaves `tensor` unchanged. While it runs, every other
collective raises, so it really has to use broadcast. It is checked on several shapes and dtypes with
values that say which rank they came from. The ranks agree on the verdict before anyone reports it.

Without --solution the checker tests itself: dist.all_gather must pass (run unguarded), and a
plausible wrong answer, broadcasting `tensor` itself (broadcast writes into its argument), must fail.
"""

import argparse
import contextlib

import torch
import torch.distributed as dist

import lessonlib
from lessonlib.exercises import load_function

# Everything that could stand in for broadcast; the checker's own bookkeeping runs after they are back.
OTHERS = ["all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object", "gather",
          "gather_object", "all_reduce", "reduce", "scatter", "all_to_all", "all_to_all_single",
          "reduce_scatter", "reduce_scatter_single", "send", "recv", "isend", "irecv", "batch_isend_irecv"]


@contextlib.contextmanager
def only_broadcast():
    """Make every collective but broadcast raise while a solution runs (restored afterwards)."""
    saved = {name: getattr(dist, name) for name in OTHERS}

    def refuse(*args, **kwargs):
        raise RuntimeError("this exercise builds all_gather from dist.broadcast alone: "
                           "other collectives are off")

    for name in OTHERS:
        setattr(dist, name, refuse)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def verdict(fn, ctx, guard=True):
    """None if fn behaves like all_gather on every rank, else the first problem this rank saw."""
    n, r = ctx.world_size, ctx.rank
    problem = None
    for shape, dtype in [((3,), torch.int64), ((2, 2), torch.float32), ((1,), torch.float64)]:
        tensor = torch.full(shape, 10 * r + 1, dtype=dtype, device=ctx.device)  # tens digit: the rank
        original = tensor.clone()
        out = [torch.full(shape, -1, dtype=dtype, device=ctx.device) for _ in range(n)]
        with only_broadcast() if guard else contextlib.nullcontext():
            fn(out, tensor)
        for k in range(n):
            if problem is None and not torch.equal(out[k].cpu(), torch.full(shape, 10 * k + 1, dtype=dtype)):
                problem = f"shape {shape}: tensor_list[{k}] is {out[k].flatten().tolist()}, rank {k} sent {10 * k + 1}"
        if problem is None and not torch.equal(tensor, original):
            problem = f"shape {shape}: the input tensor changed to {tensor.flatten().tolist()}"
    return problem


def agreed(ctx, problem):
    """True on every rank iff no rank saw a problem (so all ranks reach the same verdict)."""
    ok = torch.tensor([0 if problem else 1], device=ctx.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def broadcast_in_place(tensor_list, tensor):
    """Wrong: broadcast overwrites `tensor` on the receivers, so later rounds send rank 0's data."""
    for k in range(dist.get_world_size()):
        dist.broadcast(tensor, src=k)
        tensor_list[k].copy_(tensor)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--solution", help="Python file defining the solution")
    parser.add_argument("--function", default="all_gather_from_broadcast", help="its name")
    args = parser.parse_args()
    fn = load_function(args.solution, args.function) if args.solution else None
    ctx = lessonlib.setup(timeout=20)  # a wrong solution may leave ranks waiting: fail in 20 s, not 30

    if fn is not None:
        problem = verdict(fn, ctx)
        assert agreed(ctx, problem), f"rank {ctx.rank}: {problem or 'another rank saw a problem'}"
        print(f"rank {ctx.rank}: {args.function} gathers like dist.all_gather")
    else:
        assert agreed(ctx, verdict(dist.all_gather, ctx, guard=False)), "the checker rejects dist.all_gather"
        caught = not agreed(ctx, verdict(broadcast_in_place, ctx))
        if ctx.world_size > 1:
            assert caught, "the checker accepted broadcast_in_place"
            print(f"rank {ctx.rank}: checker self-test: accepts dist.all_gather, rejects broadcast_in_place")
        else:  # with one rank, broadcasting in place is harmless: nothing to reject
            print("world size 1: broadcast_in_place is correct here, so only the accepting half is tested")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
