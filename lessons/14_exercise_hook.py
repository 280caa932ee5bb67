"""torchrun --nproc_per_node=3 lessons/14_exercise_hook.py

Checker for the chapter 14 exercise: fp16_hook(state, bucket), a DDP communication hook that averages in float16.

Options: --solution FILE checks your answer, the function named by --function NAME (default: fp16_hook) in FILE.

The hook is registered on a DDP model in 2 buckets (bucket_cap_mb=CAP_MB) whose `scale` parameter gets a
gradient of about 40000 on every rank: a sum of N such float16 values passes 65504, float16's largest.
Its second parameter must be named `bucket` (DDP reads the hook's signature). Three backward passes each
check, on every rank, after the hook:
  - it returned a torch.futures.Future, whose value is ONE tensor of the bucket's shape (a list, as
    all_reduce's own future holds, or another shape is refused, with the fix named);
  - every gradient is finite and, tensor by tensor, within TOL (relative) of plain DDP's average;
  - at N > 1, the bytes this rank sent (lessonlib.sharding.Traffic) are at most 0.6 of what plain DDP
    sends for the same step: the bucket went over the wire in 16 bits.
Without --solution the checker tests itself: it accepts the reference solution (the `solution` region,
which the chapter shows) and rejects a hook that returns a tensor, one that returns all_reduce's own
future, one whose second parameter has another name, one that sums without dividing, one that divides
after the sum (it overflows), one that all-reduces in float32, and one that never communicates (at world
size 1, only the first three are wrong).
"""

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lessonlib.exercises import run_checker
from lessonlib.sharding import Traffic

TOL = 1e-2  # relative, per gradient tensor: float16 keeps 11 significant bits (about 5e-4 per rounding)
CAP_MB = 0.03  # two buckets from step 1 on
BIG = 40_000.0  # each rank's gradient of `scale`: below 65504, but twice it is not


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 128),
            torch.nn.Tanh(),
            torch.nn.Linear(128, 128),
            torch.nn.Tanh(),
            torch.nn.Linear(128, 4),
        )  # 73 kB of gradients: gloo's message headers are then a small share of the bytes sent
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.body(x) * self.scale


def loss(model, step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own rows
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    net = model.module if isinstance(model, DDP) else model
    return F.mse_loss(model(x), y) + BIG * net.scale.sum()  # scale's gradient: BIG and a little


def watched(fn, problems):
    """fn as DDP sees it, with what it returned checked; a broken result is replaced so that DDP goes on."""

    def hook(state, bucket):
        shape = bucket.buffer().shape
        fut = fn(state, bucket)
        if not isinstance(fut, torch._C.Future):  # get_future() and then() return this, torch.futures.Future's base
            problems.append(
                f"the hook returned a {type(fut).__name__}, not a torch.futures.Future: return "
                "dist.all_reduce(..., async_op=True).get_future().then(...), whose value is the averaged bucket"
            )
            return allreduce_hook(None, bucket)

        def check(fut):
            value = fut.value()
            if isinstance(value, (list, tuple)):
                problems.append(
                    "the future holds a list (all_reduce's own future does: [tensor]); DDP needs one tensor: "
                    "chain .then(lambda fut: ...) that returns fut.value()[0], cast back into the bucket"
                )
                value = value[0]
            if not isinstance(value, torch.Tensor) or value.shape != shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                problems.append(
                    f"the future's value is {got}; DDP needs one tensor of the bucket's shape {tuple(shape)}"
                )
                return bucket.buffer()
            return value

        return fut.then(check)

    return hook


def verdict(fn, ctx):
    """None if fn averages every bucket in float16 and returns a correct future; else the first problem."""
    try:
        problem = check(fn, ctx)
    except Exception as e:  # a crash is a wrong answer too, with its message
        problem = f"rank {ctx.rank}: training with the hook raised {type(e).__name__}: {str(e)[:300]}"
    if problem is None and "bucket" not in inspect.signature(fn).parameters:  # as register_comm_hook does
        problem = "name the hook's second parameter `bucket`: register_comm_hook looks it up (KeyError: 'bucket')"
    return problem


def check(fn, ctx):
    problems = []
    plain, mine = DDP(Net(), bucket_cap_mb=CAP_MB), DDP(Net(), bucket_cap_mb=CAP_MB)
    mine.register_comm_hook(None, watched(fn, problems))
    for step in range(3):  # step 0: one bucket; then DDP rebuilds them (two)
        sent = {}
        for name, model in (("plain", plain), ("mine", mine)):
            model.zero_grad()
            dist.barrier()
            with Traffic() as t:  # what this rank sends while DDP averages
                loss(model, step, ctx.rank).backward()
            sent[name] = t.sent
        if problems:
            return problems[0]
        for (name, p), q in zip(mine.module.named_parameters(), plain.module.parameters()):
            if not torch.isfinite(p.grad).all():
                return (
                    f"step {step}: {name}'s averaged gradient holds inf or NaN: a sum of N float16 gradients of "
                    f"about {BIG:.0f} passed 65504; divide by the world size before the all-reduce"
                )
            gap = ((p.grad - q.grad).norm() / q.grad.norm()).item()
            if gap > TOL:
                ratio = (p.grad.norm() / q.grad.norm()).item()
                hint = "the sum, not the mean: divide by the world size" if abs(ratio - ctx.world_size) < 0.1 else ""
                return f"step {step}: {name}'s gradient is {gap:.2g} (relative) from plain DDP's average {hint}"
        if ctx.world_size > 1 and sent["plain"] is not None and sent["mine"] > 0.6 * sent["plain"]:
            return (
                f"step {step}: this rank sent {sent['mine']} bytes, plain DDP {sent['plain']}: cast the bucket "
                "to torch.float16 before the all-reduce"
            )
    return None


# [start: solution]
def fp16_hook(state, bucket):
    """Average the bucket in float16: half the bytes on the wire."""
    n = dist.get_world_size()
    half = bucket.buffer().to(torch.float16).div_(n)  # divide first: a sum of N float16 values can pass 65504
    fut = dist.all_reduce(half, async_op=True).get_future()

    def back(fut):  # runs when the all-reduce is done; fut.value() is a list, [half]
        buffer = bucket.buffer()
        buffer.copy_(fut.value()[0])  # back to float32, into DDP's bucket
        return buffer

    return fut.then(back)  # a Future whose value is one tensor of the bucket's shape


# [end: solution]


def returns_tensor(state, bucket):
    half = bucket.buffer().to(torch.float16).div_(dist.get_world_size())
    dist.all_reduce(half)
    return bucket.buffer().copy_(half)


def returns_work_future(state, bucket):
    half = bucket.buffer().to(torch.float16).div_(dist.get_world_size())
    return dist.all_reduce(half, async_op=True).get_future()


def then_back(half, bucket, divide=1):
    fut = dist.all_reduce(half, async_op=True).get_future()
    return fut.then(lambda fut: bucket.buffer().copy_(fut.value()[0].div_(divide)))


def no_division(state, bucket):
    return then_back(bucket.buffer().to(torch.float16), bucket)


def divides_after(state, bucket):
    return then_back(bucket.buffer().to(torch.float16), bucket, divide=dist.get_world_size())


def float32(state, bucket):
    return then_back(bucket.buffer().div(dist.get_world_size()), bucket)


def renamed(state, grads):
    return fp16_hook(state, grads)


def local_only(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer().to(torch.float16).float())
    return fut


WRONG = [returns_tensor, returns_work_future, renamed, no_division, divides_after, float32, local_only]
ONE_RANK_CANNOT = [no_division, divides_after, float32, local_only]  # right when one rank holds everything


def main():
    run_checker(__doc__, verdict, [fp16_hook], WRONG, right_alone=ONE_RANK_CANNOT, passed="passes every check")


if __name__ == "__main__":
    main()
