"""torchrun --nproc_per_node=2 lessons/06_accumulation.py

Gradient accumulation under DDP: the 1/k scale, no_sync(), and how many all-reduces each costs.

Options: --micro 4, --rows 3, --steps 3, --timing-steps 10 (the defaults).

Each rank runs k micro-batches of m rows per optimizer step. Scaling each micro-batch's mean loss by
1/k and stepping after the k-th equals one process on all N x k x m rows at once (asserted after every
step, to 1e-12). Forget the 1/k and the gradient is k times too big (asserted: an exact factor).
DDP all-reduces in every backward(); inside `with ddp.no_sync():` it only accumulates locally, and the
backward() after the block all-reduces the accumulated sum. A communication hook counts the calls and
bytes: k per step without no_sync, 1 with it, and the same update either way (asserted). Leaving the
last backward inside no_sync too means no all-reduce at all: the replicas drift apart (asserted). The
time saved is measured on a larger model and reported, not asserted.
"""

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import flat_grads, flat_params, gather, global_batch, max_gap, mlp, my_rows

TOL = 1e-12


def counting_hook(counter, bucket):
    """DDP's own all-reduce (mean over ranks), counted."""
    counter["all-reduces"] += 1
    counter["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)


def counted_ddp(model):
    ddp, counter = DDP(model), {"all-reduces": 0, "bytes": 0}
    ddp.register_comm_hook(counter, counting_hook)
    return ddp, counter


# [start: accumulate]
def accumulate_step(ddp, opt, micro_batches, scale=True, sync_last=True, use_no_sync=True):
    """One optimizer step over k micro-batches (the keyword arguments switch the mistakes on)."""
    k = len(micro_batches)
    opt.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        skip_sync = use_no_sync and (not last or not sync_last)
        with ddp.no_sync() if skip_sync else contextlib.nullcontext():  # forward AND backward inside
            loss = F.mse_loss(ddp(x), y)
            (loss / k if scale else loss).backward()  # gradients add up in .grad
    opt.step()


# [end: accumulate]


def micro_batches(step, ctx, k, m):
    """This rank's k micro-batches of m rows, and the whole global batch for the reference."""
    x, y = global_batch(step, ctx.world_size * k * m)
    mine = my_rows([k * m] * ctx.world_size, ctx.rank)
    xs, ys = x[mine].split(m), y[mine].split(m)
    return list(zip(xs, ys)), (x, y)


def timing(ctx, k, steps):
    """ms per optimizer step on a bigger model, with and without no_sync."""
    result = {}
    for use_no_sync in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        ddp, counter = counted_ddp(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        batches = [(torch.randn(8, 256), torch.randn(8, 256)) for _ in range(k)]
        accumulate_step(ddp, opt, batches, use_no_sync=use_no_sync)  # warm-up
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            accumulate_step(ddp, opt, batches, use_no_sync=use_no_sync)
        elapsed = torch.tensor([time.perf_counter() - start])
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        result["no_sync" if use_no_sync else "sync every micro-batch"] = {
            "ms per step": 1e3 * elapsed.item() / steps,
            "MB sent per step": counter["bytes"] / (steps + 1) / 1e6,
        }
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--micro", type=int, default=4, choices=range(1, 17), metavar="1..16", help="k")
    parser.add_argument("--rows", type=int, default=3, choices=range(1, 65), metavar="1..64", help="m")
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--timing-steps", type=int, default=10, choices=range(1, 201), metavar="1..200")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    k, m, n = args.micro, args.rows, ctx.world_size

    cases = {
        "1/k, no_sync": {},
        "1/k, sync every micro-batch": dict(use_no_sync=False),
        "no 1/k": dict(scale=False),
        "no_sync on all k": dict(sync_last=False),
    }
    for case, mistakes in cases.items():
        reference, (ddp, counter) = mlp(seed=0), counted_ddp(mlp(seed=0))
        opts = [torch.optim.SGD(mod.parameters(), lr=0.1) for mod in (reference, ddp)]
        gaps = []  # after every step
        for step in range(args.steps):
            mine, (x, y) = micro_batches(step, ctx, k, m)
            opts[0].zero_grad()
            F.mse_loss(reference(x), y).backward()
            grad_ref = flat_grads(reference)
            opts[0].step()
            accumulate_step(ddp, opts[1], mine, **mistakes)
            if step == 0:
                factor = (flat_grads(ddp.module) @ grad_ref / (grad_ref @ grad_ref)).item()
            gaps.append(max_gap(flat_params(ddp.module), flat_params(reference)))
        gap = gaps[-1]
        replicas = gather(flat_params(ddp.module))
        in_sync = all(torch.equal(c, replicas[0]) for c in replicas)
        calls = counter["all-reduces"] / args.steps
        if case.startswith("1/k"):
            assert max(gaps) < TOL and in_sync, f"rank {ctx.rank}: {case}: gaps {gaps}, replicas equal: {in_sync}"
            assert calls == (1 if "no_sync" in case else k), f"rank {ctx.rank}: {case}: {calls} all-reduces/step"
        elif case == "no 1/k":
            assert abs(factor - k) < TOL * k, f"rank {ctx.rank}: without 1/k the gradient is {factor}x, not {k}x"
        elif n > 1:
            assert calls == 0 and not in_sync, f"rank {ctx.rank}: {case}: {calls} all-reduces, in sync: {in_sync}"
        lessonlib.report(
            "cases",
            {
                "case": case,
                "all-reduces per step": calls,
                "first-step gradient factor": factor,
                "gap to reference": gap,
                "replicas equal": in_sync,
            },
        )
        if ctx.is_main:
            print(
                f"{case:28} all-reduces/step {calls:4.1f}  gradient x{factor:.3f}  gap to one process "
                f"{gap:.1e}  replicas equal: {in_sync}"
            )

    times = timing(ctx, k, args.timing_steps)
    if ctx.is_main:
        lessonlib.report("timing", times)
        for name, t in times.items():
            print(f"{name:24} {t['ms per step']:7.1f} ms per step, {t['MB sent per step']:.2f} MB all-reduced per step")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
