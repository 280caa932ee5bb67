"""torchrun --nproc_per_node=2 lessons/00_ddp_step.py

One DDP training step, on a clock: the picture on the Start page.

Options: --layers 6, --width 256, --batch 48 (the global batch), --bucket-cap-mb 0.25, --steps 3.

Every rank takes its own rows of one global batch, runs forward and backward through DDP, and steps
its optimizer. A communication hook records when each gradient bucket's all-reduce is launched and
when it finishes, on the machine's monotonic clock, which every process on one machine shares, so the
ranks' timelines can be drawn on one axis. Asserted on every rank, every step:
  1. the gradient DDP leaves in .grad is the gradient of the mean loss over the WHOLE global batch,
     computed here in one process (to 1e-5): each rank saw only its rows;
  2. after the optimizer step every rank holds the same weights (rank 0's, to the bit);
  3. from the second step on (DDP lays out its buckets again after the first), the first bucket's
     all-reduce is launched before backward has computed the last gradient (each parameter's stamped by
     a hook of its own, not DDP's): communication overlaps the backward pass.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib


def build(layers, width):
    torch.manual_seed(0)  # the same starting weights on every rank
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])


def timed_hook(log):
    """allreduce_hook (what DDP does by default), noting each bucket's launch and finish times."""

    def hook(state, bucket):
        entry = {"index": bucket.index(), "tensors": len(bucket.gradients()), "launch": time.monotonic()}
        log.append(entry)

        def done(fut):
            entry["done"] = time.monotonic()
            return fut.value()[0]

        return allreduce_hook(state, bucket).then(done)

    return hook


def stamp_gradients(model):
    """{parameter name: when its gradient was last accumulated}, filled in by hooks on the parameters."""
    ready = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: ready.__setitem__(name, time.monotonic()))
    return ready


def one_step(ddp, opt, x, y, log, ready):
    """Forward, backward, optimizer step; the start and end time of each, and the buckets' times."""
    log.clear()
    ready.clear()
    t = {"start": time.monotonic()}
    loss = F.mse_loss(ddp(x), y)
    t["forward_end"] = time.monotonic()
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DDP's hooks all-reduce the buckets as they fill; it returns when all are done
    t["backward_end"] = time.monotonic()
    t["last_gradient"] = max(ready.values())  # the last gradient backward computed
    grads = [p.grad.clone() for p in ddp.parameters()]
    opt.step()
    t["step_end"] = time.monotonic()
    return t, [dict(b) for b in log], grads


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=48, help="the global batch, split over the ranks")
    p.add_argument("--bucket-cap-mb", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    if args.steps < 2 or args.layers < 1 or args.width < 1 or args.bucket_cap_mb <= 0:
        p.error(
            "need --steps >= 2 (the first step's buckets are provisional), --layers, --width >= 1, --bucket-cap-mb > 0"
        )

    ctx = lessonlib.setup(device="cpu")
    rank, world = ctx.rank, ctx.world_size
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is the global batch: it must be a multiple of the {world} ranks")
    rows = args.batch // world
    reference = build(args.layers, args.width)  # one process's model, for the exact gradient
    ddp = DDP(build(args.layers, args.width), bucket_cap_mb=args.bucket_cap_mb)
    log = []
    ddp.register_comm_hook(None, timed_hook(log))
    ready = stamp_gradients(ddp.module)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)  # the same global batch on every rank
        x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
        mine = slice(rank * rows, (rank + 1) * rows)
        dist.barrier()  # start together, so the timelines line up
        times, buckets, grads = one_step(ddp, opt, x[mine], y[mine], log, ready)

        # 1. DDP's averaged gradient is the whole batch's gradient in one process.
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        for (name, ref), got in zip(reference.named_parameters(), grads):
            assert torch.allclose(got, ref.grad, atol=1e-5, rtol=1e-4), f"rank {rank}, step {step}: grad of {name}"
        ref_opt.step()
        # 2. The same weights everywhere after the step.
        flat = torch.cat([q.detach().flatten() for q in ddp.parameters()])
        zero = flat.clone()
        dist.broadcast(zero, src=0)
        assert torch.equal(flat, zero), f"rank {rank}, step {step}: weights differ from rank 0's"
        # 3. Overlap: the first bucket goes out while backward still has gradients to compute.
        first = min(b["launch"] for b in buckets)
        if step > 0:
            assert first < times["last_gradient"], (
                f"rank {rank}: the first bucket was launched {1000 * (first - times['last_gradient']):.2f} ms after "
                f"backward computed the last gradient: no overlap ({len(buckets)} bucket(s))"
            )

    lessonlib.report("step", {"rows": [mine.start, mine.stop - 1], "times": times, "buckets": buckets})
    ms = {k: 1000 * (v - times["start"]) for k, v in times.items()}
    print(
        f"rank {rank}: rows {mine.start}-{mine.stop - 1} of {args.batch}; forward {ms['forward_end']:.1f} ms, "
        f"backward to {ms['backward_end']:.1f} ms ({len(buckets)} buckets), step to {ms['step_end']:.1f} ms"
    )
    if ctx.is_main:
        print("every rank: the whole batch's gradient, and the same weights after the step (asserted)")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
