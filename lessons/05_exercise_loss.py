"""torchrun --nproc_per_node=3 lessons/05_exercise_loss.py

Checker for the chapter 5 exercise: the loss that keeps DDP exact when ranks hold unequal batches.

Options: --solution FILE checks your answer, the function named by --function NAME (default: ddp_loss) in
FILE.

A solution is a function `ddp_loss(pred, target)` returning the scalar that this rank calls
backward() on, under DistributedDataParallel, when the ranks hold different numbers of rows. It must
make the gradient every rank ends up with equal the gradient of one process on all the rows with a
mean squared error. It may call collectives (every rank calls it once per case). Each rank compares
its DDP gradient with that reference on several cases, including a rank with a single row; the
ranks agree on the verdict before anyone reports it.

Without --solution the checker tests itself: a correct answer must pass, and two plausible wrong
answers must fail: the plain per-rank mean, and the summed loss divided by the global row count
(which forgets that DDP divides by the world size once more).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.exercises import load_function
from lessonlib.training import flat_grads, global_batch, mlp, my_rows

TOL = 1e-10


def cases(world_size):
    yield [4] * world_size  # equal rows: the plain mean is right here
    yield [2 + 3 * r for r in range(world_size)]
    yield [1 + (r % 2) * 6 for r in range(world_size)]  # a rank with a single row


def verdict(fn, ctx):
    """None if fn gives the all-rows gradient on every case for this rank, else the first difference."""
    for i, sizes in enumerate(cases(ctx.world_size)):
        x, y = global_batch(i, sum(sizes))
        reference = mlp(seed=i)
        F.mse_loss(reference(x), y).backward()
        model = DDP(mlp(seed=i))
        mine = my_rows(sizes, ctx.rank)
        try:
            fn(model(x[mine]), y[mine]).backward()
        except Exception as e:  # a crash is a wrong answer too, with its message
            return f"rows per rank {sizes}: ddp_loss raised {type(e).__name__}: {e}"
        got, want = flat_grads(model.module), flat_grads(reference)
        gap = (got - want).abs().max().item()
        if gap > TOL:
            ratio = (got @ want / (want @ want)).item()
            return (f"rows per rank {sizes}: the gradient is {gap:.2e} from one process on all rows "
                    f"(about {ratio:.3f} x the right one)")
    return None


def agreed(ctx, problem):
    """True on every rank iff no rank saw a problem (so all ranks reach the same verdict)."""
    ok = torch.tensor([0 if problem else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def ddp_loss(pred, target):
    rows = torch.tensor([float(pred.shape[0])], dtype=pred.dtype)
    dist.all_reduce(rows)  # rows on all ranks
    # DDP will divide by the world size: multiply by it so that the sum over rows / all rows is left.
    return torch.nn.functional.mse_loss(pred, target, reduction="sum") * dist.get_world_size() / rows


def per_rank_mean(pred, target):
    """Wrong: every rank's mean counts the same, whatever its number of rows."""
    return torch.nn.functional.mse_loss(pred, target)


def sum_over_all_rows(pred, target):
    """Wrong: right for an all_reduce SUM, but DDP averages, so this is N times too small."""
    rows = torch.tensor([float(pred.shape[0])], dtype=pred.dtype)
    dist.all_reduce(rows)
    return torch.nn.functional.mse_loss(pred, target, reduction="sum") / rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--solution", help="Python file defining the solution")
    parser.add_argument("--function", default="ddp_loss", help="its name")
    args = parser.parse_args()
    fn = load_function(args.solution, args.function) if args.solution else None
    ctx = lessonlib.setup(device="cpu", timeout=20)

    if fn is not None:
        problem = verdict(fn, ctx)
        assert agreed(ctx, problem), f"rank {ctx.rank}: {problem or 'another rank saw a problem'}"
        print(f"rank {ctx.rank}: {args.function} gives the all-rows gradient on {len(list(cases(ctx.world_size)))} cases")
    else:
        assert agreed(ctx, verdict(ddp_loss, ctx)), "the checker rejects the correct answer"
        rejected = {wrong.__name__: not agreed(ctx, verdict(wrong, ctx)) for wrong in (per_rank_mean, sum_over_all_rows)}
        if ctx.world_size > 1:
            assert all(rejected.values()), f"the checker accepted a wrong answer: {rejected}"
            print(f"rank {ctx.rank}: checker self-test: accepts ddp_loss, rejects {sorted(rejected)}")
        else:  # one rank holds all rows: every answer above is right
            print("world size 1: the wrong answers are right here, so only the accepting half is tested")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
