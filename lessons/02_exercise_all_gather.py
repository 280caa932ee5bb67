"""torchrun --nproc_per_node=3 lessons/02_exercise_all_gather.py

Checker for the chapter 2 exercise: all_gather built from dist.broadcast alone.

Options: --solution FILE checks your answer, the function named by --function NAME (default:
all_gather_from_broadcast) in FILE.

A solution is a function `f(tensor_list, tensor)` that, like dist.all_gather, fills tensor_list[k]
with rank k's `tensor` on every rank, and leaves `tensor` unchanged. While it runs, every other
collective raises, so it really has to use broadcast. It is checked on several shapes and dtypes with
values that say which rank they came from. The ranks agree on the verdict before anyone reports it.

Without --solution the checker tests itself: the reference solution (the `solution` region, which the
chapter shows) must pass, and a plausible wrong answer, broadcasting `tensor` itself (broadcast writes
into its argument), must fail. The tensors live on ctx.device, so the checker also runs on GPUs (nccl).
"""

import contextlib

import torch
import torch.distributed as dist

from lessonlib.exercises import run_checker

# Everything that could stand in for broadcast; the checker's own bookkeeping runs after they are back.
OTHERS = [
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather",
    "gather_object",
    "all_reduce",
    "reduce",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter",
    "reduce_scatter_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
]


@contextlib.contextmanager
def only_broadcast():
    """Make every collective but broadcast raise while a solution runs (restored afterwards)."""
    saved = {name: getattr(dist, name) for name in OTHERS}

    def refuse(*args, **kwargs):
        raise RuntimeError("this exercise builds all_gather from dist.broadcast alone: other collectives are off")

    for name in OTHERS:
        setattr(dist, name, refuse)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def verdict(fn, ctx):
    """None if fn behaves like all_gather on every rank, else the first problem this rank saw."""
    n, r = ctx.world_size, ctx.rank
    problem = None
    for shape, dtype in [((3,), torch.int64), ((2, 2), torch.float32), ((1,), torch.float64)]:
        tensor = torch.full(shape, 10 * r + 1, dtype=dtype, device=ctx.device)  # tens digit: the rank
        original = tensor.clone()
        out = [torch.full(shape, -1, dtype=dtype, device=ctx.device) for _ in range(n)]
        with only_broadcast():
            fn(out, tensor)
        for k in range(n):
            if problem is None and not torch.equal(out[k].cpu(), torch.full(shape, 10 * k + 1, dtype=dtype)):
                problem = f"shape {shape}: tensor_list[{k}] is {out[k].flatten().tolist()}, rank {k} sent {10 * k + 1}"
        if problem is None and not torch.equal(tensor, original):
            problem = f"shape {shape}: the input tensor changed to {tensor.flatten().tolist()}"
    return problem


# [start: solution]
def all_gather_from_broadcast(tensor_list, tensor):
    for k in range(dist.get_world_size()):
        if dist.get_rank() == k:
            tensor_list[k].copy_(tensor)  # broadcast into the output slot, never into `tensor` itself
        dist.broadcast(tensor_list[k], src=k)


# [end: solution]


def broadcast_in_place(tensor_list, tensor):
    """Wrong: broadcast overwrites `tensor` on the receivers, so later rounds send rank 0's data."""
    for k in range(dist.get_world_size()):
        dist.broadcast(tensor, src=k)
        tensor_list[k].copy_(tensor)


def main():
    run_checker(
        __doc__,
        verdict,
        all_gather_from_broadcast,
        wrong=[broadcast_in_place],
        right_alone=[broadcast_in_place],  # one rank: broadcasting in place is harmless
        passed="gathers like dist.all_gather",
        device=None,
    )  # device=None: GPUs (nccl) where there are


if __name__ == "__main__":
    main()
