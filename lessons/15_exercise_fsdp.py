"""torchrun --nproc_per_node=3 lessons/15_exercise_fsdp.py

Checker for the chapter 15 FSDP exercise: HandFSDP's helpers flat_shard and reduce_gradient.

Options: --solution FILE checks your answer, the function named by --function NAME (default: flat_shard;
reduce_gradient checks the other) in FILE.

HandFSDP (lessons/15_hand_fsdp.py) is built on these two, and loads them from here:
flat_shard(tensors, world_size, rank): this rank's piece of `tensors` flattened into one float32 vector that
  is zero-padded to world_size equal pieces. Every piece has ceil(P / N) elements (all_gather_single needs
  equal pieces), the pieces in rank order are the flat vector and then zeros, and each piece has storage of
  its own (a view would keep the whole flat alive on every rank). Checked for every rank's piece, computed
  on this rank, for float32 tensors of P = 1001 elements (padding at 2, 3 and 4 ranks).
reduce_gradient(full_grad, world_size): full_grad is this rank's gradient of a whole padded flat, in the
  compute dtype (bfloat16 here); the answer is this rank's piece of the mean over the ranks, in float32 (the
  dtype of the shard it is the gradient of), with ceil(P / N) elements. Checked against the mean computed in
  float32 from every rank's gradient, within TOL (a sum taken in bfloat16 is off by about 1e-2).
Without --solution the checker tests itself: it accepts the reference solution (the `solution` region, which
the chapter shows) and rejects a shard without padding, a view of the whole flat, gradients left in the compute
dtype, the sum instead of the mean, the full gradient instead of this rank's piece, this rank's own gradient,
and a sum taken in bfloat16 (at world size 1, only the mistakes one rank can make).
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessonlib.exercises import run_checker
from lessonlib.sharding import held

SHAPES = [(10, 7), (31,), (900,)]  # P = 1001: no world size from 2 to 4 divides it
P = sum(math.prod(s) for s in SHAPES)
# torch 2.14's name; torch 2.11 (a GPU machine's, maybe) has only the old one, deprecated since
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
TOL = 1e-6  # float32: the same sum in another order (the reference measured 0 to 2.4e-7 at 1 to 4 ranks)


def tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def gradient(rank, world_size):
    """Rank `rank`'s gradient of the whole padded flat, in bfloat16: any rank can make every rank's."""
    g = torch.Generator().manual_seed(100 + rank)
    grad = torch.randn(P, generator=g).to(torch.bfloat16)
    return F.pad(grad, (0, world_size * math.ceil(P / world_size) - P))  # no gradient for the padding


def check_shard(fn, ctx):
    n, size = ctx.world_size, math.ceil(P / ctx.world_size)
    pieces = [fn(tensors(), n, r) for r in range(n)]  # every rank's piece, here: no collective needed
    sizes = [p.numel() if isinstance(p, torch.Tensor) else None for p in pieces]
    if any(s != size for s in sizes):
        return (
            f"the pieces of ranks 0..{n - 1} have {sizes} elements, not ceil({P} / {n}) = {size} each: pad the "
            f"flat vector with zeros to {n * size} elements first, so that every rank's piece is the same size"
        )
    if {p.dtype for p in pieces} != {torch.float32}:
        return f"the pieces are {pieces[0].dtype}: the shard is what the optimizer updates, keep it in float32"
    flat = torch.cat([t.flatten() for t in tensors()])
    if not torch.equal(torch.cat(pieces)[:P], flat) or torch.cat(pieces)[P:].any():
        return "the pieces in rank order are not the flat vector and then zeros: rank r's is [r * size, (r + 1) * size)"
    if held(pieces[ctx.rank : ctx.rank + 1]) != 4 * size:
        return (
            f"your piece holds {held([pieces[ctx.rank]])} bytes of storage, not {4 * size}: it is a view of the "
            "whole flat, which stays alive as long as the piece does (.clone() it)"
        )
    return None


def check_reduce(fn, ctx):
    n, rank, size = ctx.world_size, ctx.rank, math.ceil(P / ctx.world_size)
    grads = [gradient(r, n) for r in range(n)]
    got = fn(grads[rank].clone(), n)
    if not isinstance(got, torch.Tensor):
        return f"reduce_gradient returned {type(got).__name__}, not a tensor"
    if got.dtype != torch.float32:
        return (
            f"the gradient is {got.dtype}: it belongs to a float32 shard, and the optimizer needs it in float32 "
            "(cast before the reduce-scatter)"
        )
    if got.shape != (size,):
        whole = got.numel() == n * size
        hint = "the whole gradient: keep this rank's piece (reduce_scatter_single)" if whole else "not a piece"
        return f"the gradient has shape {tuple(got.shape)}, not ({size},): {hint}"
    want = (sum(g.float() for g in grads) / n)[rank * size : (rank + 1) * size]
    if (gap := (got - want).abs().max().item()) > TOL:
        ratio = (got @ want / (want @ want)).item()
        own = grads[rank].float()[rank * size : (rank + 1) * size]
        if abs(ratio - n) < 1e-3:
            return "the gradient is the sum over the ranks, not the mean: divide by the world size"
        if torch.allclose(got, own):
            return "the gradient is this rank's own: reduce it over the ranks (reduce_scatter_single)"
        return f"the gradient is {gap:.1e} from the mean over the ranks: sum in float32, cast before the reduce"
    return None


def verdict(fn, ctx):
    """None, or the first problem this rank saw."""
    check = check_shard if fn.__name__ == "flat_shard" else check_reduce
    try:
        return check(fn, ctx)
    except Exception as e:  # a crash is a wrong answer too, with its message
        return f"{fn.__name__} raised {type(e).__name__}: {str(e)[:300]}"


# [start: solution]
def flat_shard(tensors, world_size, rank):
    flat = torch.cat([t.detach().flatten() for t in tensors]).float()
    size = -(-flat.numel() // world_size)  # ceil: the last pieces end in padding
    padded = torch.nn.functional.pad(flat, (0, size * world_size - flat.numel()))
    return padded[rank * size : (rank + 1) * size].clone()  # storage of its own: the whole flat can go


def reduce_gradient(full_grad, world_size):
    grad = full_grad.float()  # the shard's dtype, for the sum too: a bfloat16 sum is rounded at every step
    mine = grad.new_empty(grad.numel() // world_size)  # on the gradient's device: NCCL takes no CPU tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # the older name
    scatter(mine, grad)  # my piece of the sum (gloo: an all-reduce, then my piece)
    return mine / world_size


# [end: solution]


def sharder(pad=True, clone=True):
    """A flat_shard with the mistakes that are switched on."""

    def flat_shard(tensors, world_size, rank):
        flat = torch.cat([t.detach().flatten() for t in tensors]).float()
        if not pad:
            return flat.tensor_split(world_size)[rank].clone()  # sizes differ by one where N does not divide P
        size = -(-flat.numel() // world_size)
        piece = F.pad(flat, (0, size * world_size - flat.numel()))[rank * size : (rank + 1) * size]
        return piece.clone() if clone else piece

    return flat_shard


def reducer(cast=True, mean=True, scatter=True, reduce=True, cast_first=True):
    """A reduce_gradient with the mistakes that are switched on."""

    def reduce_gradient(full_grad, world_size):
        grad = full_grad.float() if cast and cast_first else full_grad
        rank, size = dist.get_rank(), grad.numel() // world_size
        if not scatter:
            dist.all_reduce(grad)  # the whole sum, kept whole
            mine = grad
        elif not reduce:
            mine = grad[rank * size : (rank + 1) * size].clone()  # this rank's own gradient
        else:
            mine = grad.new_empty(size)
            reduce_scatter_single(mine, grad)
        mine = mine.float() if cast and not cast_first else mine
        return mine / world_size if mean and reduce else mine

    return reduce_gradient


WRONG = {
    "a shard without padding": sharder(pad=False),
    "a view of the whole flat": sharder(clone=False),
    "gradients left in the compute dtype": reducer(cast=False),
    "the sum, not the mean": reducer(mean=False),
    "the full gradient, not this rank's piece": reducer(scatter=False),
    "this rank's own gradient": reducer(reduce=False),
    "a sum taken in bfloat16": reducer(cast_first=False),
}
# One rank holds every piece, and its gradient is the mean: these are right at world size 1.
ONE_RANK_CANNOT = set(WRONG) - {"gradients left in the compute dtype"}


def main():
    run_checker(
        __doc__, verdict, [flat_shard, reduce_gradient], WRONG, right_alone=ONE_RANK_CANNOT, passed="passes every check"
    )


if __name__ == "__main__":
    main()
