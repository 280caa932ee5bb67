"""torchrun --nproc_per_node=3 lessons/13_exercise_zero1.py

Checker for the chapter 13 exercises: zero1_step(flat_params, flat_grads, mine, opt) and predict_state_bytes.

Options: --solution FILE checks your answer, the function named by --function NAME (default: zero1_step;
a predict_... name checks the prediction) in FILE.

zero1_step runs on every rank, after backward. flat_params: the whole weights, flat, zero-padded to
N * ceil(P/N) elements; flat_grads: this rank's own gradient, same layout; mine: this rank's slice of
the weights, its own tensor; opt: torch.optim.Adam([mine]). Afterwards every rank's flat_params must
hold the whole weights after one Adam step with the mean of the ranks' gradients, as one process
would take it (P = 1001 float32 elements, two steps, TOL), and Adam's first moment must be built from
the mean (Adam's step hardly changes when every gradient is N times too large, its moment does).
predict_state_bytes(shapes, world_size, rank) returns the bytes of Adam's state that fully_shard leaves
on `rank` for float32 parameters of `shapes`; it is compared with the bytes measured on every rank
(lessonlib.sharding.held) for three models and every world size from 1 to N (subgroups of the first ranks).
Without --solution the checker tests itself: it accepts the reference solution (the `solution` region,
which the chapter shows) and the all-reduce-and-broadcast write-up, and rejects a sum instead of a
mean, the own gradient, no all-gather, the all-gather before the step, padded shards, P/N, the
calculator's ceil(P/N), and no step tensors (at world size 1, only the mistakes one rank can make).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lessonlib.exercises import run_checker
from lessonlib.sharding import held, optimizer_state

P, STEPS, LR = 1001, 2, 1e-2  # 1001: padding at 2, 3 and 4 ranks
TOL = 1e-6  # float32, the mean summed in another order: the reference measured 0 to 6e-8 at 1 to 4 ranks
MODELS = [  # parameter shapes: lessons/13_memory.py's model; 3-D and fewer rows than ranks; all even
    [(131, 36), (131,), (197, 131), (197,), (5, 197), (5,)],
    [(10, 3, 3), (2, 5), (1,)],
    [(12, 4), (12,)],
]


def gradient(step, rank):
    """Rank `rank`'s gradient at `step`: any rank can make every rank's, so each can build the mean."""
    return torch.randn(P, generator=torch.Generator().manual_seed(100 * step + rank))


def check_step(fn, ctx):
    n, rank = ctx.world_size, ctx.rank
    pad = torch.zeros(n * -(-P // n) - P)  # to N * ceil(P / N)
    start = torch.randn(P, generator=torch.Generator().manual_seed(0))
    flat_params = torch.cat([start, pad])
    mine = flat_params.view(n, -1)[rank].clone().requires_grad_()
    opt = torch.optim.Adam([mine], lr=LR)
    alone = start.clone().requires_grad_()  # one process, the mean gradient
    alone_opt = torch.optim.Adam([alone], lr=LR)
    for step in range(STEPS):
        fn(flat_params, torch.cat([gradient(step, rank), pad]), mine, opt)
        alone.grad = sum(gradient(step, r) for r in range(n)) / n
        alone_opt.step()
        want = torch.cat([alone.detach(), pad]).view(n, -1)  # row r: rank r's slice
        if mine not in opt.state:
            return f"step {step}: Adam holds no state for `mine`: set mine.grad, then call opt.step()"
        moment, ref = opt.state[mine]["exp_avg"], torch.cat([alone_opt.state[alone]["exp_avg"], pad]).view(n, -1)[rank]
        if (moment - ref).abs().max() > TOL:
            ratio = (moment @ ref / (ref @ ref)).item()
            hint = "the sum over ranks: divide by the world size" if abs(ratio - n) < 1e-3 else "reduce-scatter them"
            return f"step {step}: Adam's first moment is not the one the ranks' mean gradient gives ({hint})"
        if (mine.detach() - want[rank]).abs().max() > TOL:
            return f"step {step}: your slice `mine` is not one Adam step with the mean gradient of the ranks"
        for owner, (got, expected) in enumerate(zip(flat_params.view(n, -1), want)):
            if (gap := (got - expected).abs().max()) > TOL:
                return (
                    f"step {step}: flat_params' slice of rank {owner} is {gap:.1e} from the updated "
                    "weights: all-gather the slices after opt.step()"
                )
    return None


MEASURED = {}  # (model, world size) -> the bytes on this rank; measured once, for every function checked


class Params(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes)

    def forward(self):
        return sum(p.square().sum() for p in self.params)


def measure(ctx):
    """Adam's state bytes after one fully_shard step, at every world size k <= N (the first k ranks)."""
    for k in range(1, ctx.world_size + 1):
        group = dist.new_group(list(range(k)), timeout=ctx.timeout)  # every rank makes every group
        if ctx.rank >= k:
            continue
        for i, shapes in enumerate(MODELS):
            net = Params(shapes)
            fully_shard(net, mesh=DeviceMesh.from_group(group, "cpu"))
            opt = torch.optim.Adam(net.parameters())
            net().backward()
            opt.step()
            MEASURED[(i, k)] = held(optimizer_state(opt))
    MEASURED["done"] = True


def check_prediction(fn, ctx):
    if "done" not in MEASURED:  # the same on every rank: new_group is collective
        measure(ctx)
    for (i, k), measured in sorted(key_value for key_value in MEASURED.items() if key_value[0] != "done"):
        got = fn([tuple(s) for s in MODELS[i]], k, ctx.rank)
        if got != measured:
            return f"predict_state_bytes({MODELS[i]}, {k}, {ctx.rank}) = {got}, FSDP left {measured} bytes"
    return None


def verdict(fn, ctx):
    """None, or the first problem this rank saw."""
    check = check_prediction if fn.__name__.startswith("predict") else check_step
    try:
        return check(fn, ctx)
    except Exception as e:  # a crash is a wrong answer too, with its message
        return f"{fn.__name__} raised {type(e).__name__}: {str(e)[:300]}"


# [start: solution]
def zero1_step(flat_params, flat_grads, mine, opt):
    n = dist.get_world_size()
    grad = torch.empty_like(mine)
    dist.reduce_scatter_single(grad, flat_grads)  # my slice of the sum over ranks
    mine.grad = grad / n  # the mean: Adam would hardly notice the sum, its state would
    opt.step()  # Adam's moments exist for my slice only
    dist.all_gather_single(flat_params, mine.detach())  # every rank's updated slice, in place


def predict_state_bytes(shapes, world_size, rank):
    import math

    total = 0
    for shape in shapes:
        rows, row = shape[0], math.prod(shape[1:])
        chunk = math.ceil(rows / world_size)  # torch.chunk's rows per rank: the last ranks get fewer, or none
        mine = min(chunk, max(0, rows - rank * chunk))
        total += 8 * mine * row + 4  # exp_avg and exp_avg_sq, not padded; a float32 step per parameter
    return total


# [end: solution]


def zero1_step_broadcast(flat_params, flat_grads, mine, opt):  # the other write-up: right too
    n, rank = dist.get_world_size(), dist.get_rank()
    dist.all_reduce(flat_grads)
    mine.grad = flat_grads.view(n, -1)[rank] / n
    opt.step()
    flat_params.view(n, -1)[rank] = mine.detach()
    for owner in range(n):
        dist.broadcast(flat_params.view(n, -1)[owner], src=owner)


def stepper(mean=True, reduce=True, gather=True, gather_first=False):
    """A zero1_step with the mistakes that are switched on."""

    def step(flat_params, flat_grads, mine, opt):
        n, rank = dist.get_world_size(), dist.get_rank()
        grad = torch.empty_like(mine)
        if reduce:
            dist.reduce_scatter_single(grad, flat_grads)
        else:
            grad = flat_grads.view(n, -1)[rank].clone()  # this rank's own gradient only
        mine.grad = grad / n if mean and reduce else grad
        if gather_first:
            dist.all_gather_single(flat_params, mine.detach())
        opt.step()
        if gather and not gather_first:
            dist.all_gather_single(flat_params, mine.detach())
        elif not gather:
            flat_params.view(n, -1)[rank] = mine.detach()

    return step


def predictor(padded=False, even=False, calculator=False, steps=True):
    """A predict_state_bytes with the mistakes that are switched on."""

    def predict(shapes, world_size, rank):
        import math

        sizes = [math.prod(s) for s in shapes]
        if even or calculator:
            P = sum(sizes)
            elements = math.ceil(P / world_size) if calculator else P / world_size
            return 8 * elements + 4 * len(shapes)
        total = 0
        for shape, size in zip(shapes, sizes):
            chunk = math.ceil(shape[0] / world_size)
            rows = chunk if padded else min(chunk, max(0, shape[0] - rank * chunk))
            total += 8 * rows * (size // shape[0]) + (4 if steps else 0)
        return total

    return predict


WRONG = {
    "the sum, not the mean": stepper(mean=False),
    "the own gradient": stepper(reduce=False),
    "no all-gather": stepper(gather=False),
    "all-gather before the step": stepper(gather_first=True),
    "padded shards": predictor(padded=True),
    "P / N": predictor(even=True),
    "ceil(P / N)": predictor(calculator=True),
    "no step tensors": predictor(steps=False),
}
# One rank holds every slice and every row: these are right at world size 1. The sum of one rank is its mean.
ONE_RANK_CANNOT = {
    "the sum, not the mean",
    "the own gradient",
    "no all-gather",
    "padded shards",
    "P / N",
    "ceil(P / N)",
}


def main():
    run_checker(
        __doc__,
        verdict,
        [zero1_step, predict_state_bytes],
        WRONG,
        right_alone=ONE_RANK_CANNOT,
        also_right=[zero1_step_broadcast],
        passed="passes every check",
    )


if __name__ == "__main__":
    main()
