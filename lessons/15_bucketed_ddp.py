"""torchrun --nproc_per_node=2 lessons/15_bucketed_ddp.py

BucketedDDP(module, bucket_size_mb): gradients sent in buckets, each as soon as its last gradient is ready.

Options: --layers 6, --width 128, --batch 1024 (the timed model), --steps 3 (timed steps), --pg-timeout S.

OverlappedDDP (lessons/15_overlap_ddp.py) sends one message per tensor; every message pays a fixed
cost. BucketedDDP groups the trainable parameters, in reverse registration order (the order backward
usually finishes them), into buckets of at most bucket_size_mb MiB (a tensor larger than that gets one
of its own; a bucket holds one dtype). Each hook counts a bucket's gradients down; the last one flattens
the bucket and starts its all-reduce. finish_gradient_synchronization() waits for each, divides, copies
back; on_train_batch_start() resets the counts. Asserted, on every rank:
1. On TiedNet (float64, tied, frozen, buffers; each rank its own seed), at three caps (a bucket per
   tensor, a few, one), gradients at every step and weights after 3 SGD steps equal one process and
   torch's DDP within TOL.
2. On a float32 stack of Linear + Tanh layers, NaiveDDP and BucketedDDP at the three caps alternating
   step by step: as many buckets as tensors, a few, one; no bucket over the cap; each launched after
   its last gradient is ready; with several buckets the first is launched before the last gradient
   exists, with one bucket nothing can start before backward has produced everything.
3. The assignment against torch's DDP, read from a comm hook at iteration 2 (chapter 7: iteration 1
   is one bucket, then DDP rebuilds them in the order the gradients came), on 4 x Linear(64, 64) with a
   0.03 MiB cap: the same parameters in the same order (reverse registration is the order backward
   produced them, here), cut elsewhere: ours never passes the cap, torch closes a bucket only once it
   reaches the cap, so its last tensor may pass it. And on a 1.3 MB model, bucket_cap_mb left at its
   default (25 MiB): torch's first bucket closes at 1 MiB (a small first bucket, so that communication
   starts early; passed explicitly, 25 gives one bucket: chapter 7), ours at 25 MiB is one bucket.
Measured, not asserted: ms per step (from the start of backward() to the return of
finish_gradient_synchronization()) and communication exposed after backward(), against NaiveDDP's.
"""

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import max_gap

MIB = 1024 * 1024  # "MB" in bucket_size_mb and torch's bucket_cap_mb is a mebibyte


# Its timeline (watch, timed_step, overlap), and through it lessons/15_naive_ddp.py
overlap = lessonlib.load_lesson("15_overlap_ddp")
naive = overlap.naive
NaiveDDP, TiedNet, TOL = naive.NaiveDDP, naive.TiedNet, naive.TOL


def nbytes(t):
    return t.numel() * t.element_size()


# [start: bucketed]
def assign_buckets(params, cap):
    """Trainable `params` in reverse order, in buckets of at most `cap` bytes and one dtype each."""
    buckets, size = [], 0
    for p in reversed([p for p in params if p.requires_grad]):
        if not buckets or size + nbytes(p) > cap or p.dtype != buckets[-1][0].dtype:
            buckets.append([])  # a new bucket; a tensor over the cap gets one of its own
            size = 0
        buckets[-1].append(p)
        size += nbytes(p)
    return buckets


class BucketedDDP(NaiveDDP):  # NaiveDDP's __init__ broadcasts rank 0's parameters and buffers, and no_sync()
    def __init__(self, module, bucket_size_mb):
        super().__init__(module)
        self.buckets = assign_buckets(module.parameters(), bucket_size_mb * MIB)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.names = {id(p): k for k, p in module.named_parameters()}
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._ready)
        self.on_train_batch_start()

    def on_train_batch_start(self):
        self.waiting = [len(bucket) for bucket in self.buckets]  # gradients each bucket still waits for
        self.counted = set()  # the parameters counted down this step: each once, so no count goes below zero
        self.handles = []  # (bucket index, flat gradients, work) for every bucket started this step

    def _ready(self, p):
        if not self.require_sync:
            return  # inside no_sync(): the gradient only adds up on this rank
        if id(p) in self.counted:  # a second backward(): its count would go below zero
            overlap.refuse_second_backward(self, self.names[id(p)])
        self.counted.add(id(p))
        i = self.bucket_of[id(p)]
        self.waiting[i] -= 1
        if self.waiting[i] == 0:  # the bucket's last gradient: flatten the bucket and send it
            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])
            self.handles.append((i, flat, dist.all_reduce(flat, async_op=True)))

    def finish_gradient_synchronization(self):
        if len(self.handles) != len(self.buckets):  # an error, not a wait for a gradient that will never come
            missing = [
                self.names[id(p)] for p in self.module.parameters() if p.requires_grad and id(p) not in self.counted
            ]
            for *_, work in self.handles:  # nothing left in flight
                work.wait()
            self.on_train_batch_start()
            raise RuntimeError(
                f"rank {dist.get_rank()}: {len(self.buckets) - len(self.handles)} of {len(self.buckets)} buckets never"
                f" started: {', '.join(missing)} got no gradient in this backward(): every rank must use every"
                " trainable parameter; freeze the unused ones (requires_grad_(False))"
            )
        for i, flat, work in self.handles:
            work.wait()  # bounded by the process group's timeout
            flat /= dist.get_world_size()
            for p, part in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]])):
                p.grad.copy_(part.view_as(p.grad))
        self.on_train_batch_start()  # ready for the next step, whether it calls this or not


# [end: bucketed]


def check_tied(ctx, caps):
    """BucketedDDP on TiedNet at each cap against one process and torch's DDP: the largest gaps."""
    n, rank = ctx.world_size, ctx.rank
    want = {"one process": naive.reference(3, n), "torch DDP": naive.train(DDP(TiedNet(seed=rank)), 3, n, rank)}
    rows = []
    for name, cap in caps.items():
        ddp = BucketedDDP(TiedNet(seed=rank), cap)

        def sync(ddp=ddp):
            ddp.finish_gradient_synchronization()
            ddp.on_train_batch_start()  # train() calls sync after each backward: ready for the next step

        grads, weights = naive.train(ddp, 3, n, rank, sync)
        row = {"cap": name, "bucket_size_mb": cap, "buckets": len(ddp.buckets)}
        for other, (g, w) in want.items():
            row[f"gap to {other}"] = max(max_gap(weights, w), *map(naive.grad_gap, grads, g))
            assert row[f"gap to {other}"] < TOL, f"rank {rank}: BucketedDDP({cap:.2g} MiB) vs {other}: {row}"
        rows.append(row)
    return rows


# [start: torch_buckets]
def torch_buckets(model, cap_mb):
    """The parameter names in each of torch DDP's buckets, as rebuilt after its first iteration."""
    names, seen = {id(p): n for n, p in model.named_parameters()}, {}

    def hook(state, bucket):
        seen[bucket.index()] = [names[id(p)] for p in bucket.parameters()]
        return allreduce_hook(None, bucket)

    ddp = DDP(model) if cap_mb is None else DDP(model, bucket_cap_mb=cap_mb)
    ddp.register_comm_hook(None, hook)
    for _ in range(2):  # iteration 1 uses one bucket; DDP then rebuilds them in the order gradients came
        seen.clear()
        ddp(torch.randn(2, model[0].in_features)).square().mean().backward()
    return [seen[i] for i in sorted(seen)]


# [end: torch_buckets]


def compare_with_torch(width=64, cap_mb=0.03):
    stack = overlap.stack
    model = stack(4, width)
    names = {id(p): n for n, p in model.named_parameters()}
    size = {n: nbytes(p) for n, p in model.named_parameters()}
    ours = [[names[id(p)] for p in b] for b in assign_buckets(model.parameters(), cap_mb * MIB)]
    theirs = torch_buckets(model, cap_mb)
    cap = cap_mb * MIB
    assert all(sum(map(size.get, b)) <= cap for b in ours), f"ours over the cap: {ours}"
    assert all(sum(map(size.get, b)) >= cap > sum(map(size.get, b[:-1])) for b in theirs[:-1]), theirs
    assert sum(ours, []) == sum(theirs, []) and len(theirs) < len(ours), f"same order, fewer: {ours} {theirs}"
    model = stack(5, 256)  # 1.3 MB
    mine = assign_buckets(model.parameters(), 25 * MIB)
    big = torch_buckets(model, None)  # bucket_cap_mb left at its default, 25
    first = sum(nbytes(p) for n, p in model.named_parameters() if n in big[0])
    assert len(mine) == 1 and len(big) == 2 and first >= MIB > first - 256 * 256 * 4, (len(mine), big)
    return {
        "cap_mb": cap_mb,
        "ours": [[n, sum(map(size.get, n))] for n in ours],
        "torch": [[n, sum(map(size.get, n))] for n in theirs],
        "torch's first bucket at its default cap": first,
        "buckets, torch default vs ours at 25 MiB": [len(big), len(mine)],
    }


def sweep(ctx, args):
    """NaiveDDP and BucketedDDP at three caps on the float32 stack, alternating: each one's steps."""
    model_bytes = sum(nbytes(p) for p in overlap.stack(args.layers, args.width).parameters())
    caps = {"a bucket per tensor": 1e-6, "a few": model_bytes / 3 / MIB, "one bucket": 25}
    variants = {"NaiveDDP": NaiveDDP(overlap.stack(args.layers, args.width))}
    variants |= {name: BucketedDDP(overlap.stack(args.layers, args.width), cap) for name, cap in caps.items()}
    return caps, variants, overlap.alternate(variants, args, ctx.rank)


def check_sweep(caps, variants, steps, rank):
    tensors = len(list(variants["NaiveDDP"].parameters()))
    counts = {name: len(variants[name].buckets) for name in caps}
    assert counts["a bucket per tensor"] == tensors and counts["one bucket"] == 1, f"rank {rank}: {counts}"
    assert 1 < counts["a few"] < tensors, f"rank {rank}: {counts}"
    for name, cap in caps.items():
        ddp = variants[name]
        assert all(len(b) == 1 or sum(map(nbytes, b)) <= cap * MIB for b in ddp.buckets), (
            f"rank {rank}: {name}: over the cap"
        )
        for step in steps[name]:
            ready = dict(step["ready"])  # parameter index -> ms
            index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
            last = max(ready.values())
            for launch, _, i in step["comm"]:
                assert launch >= max(ready[index[id(p)]] for p in ddp.buckets[i]), (
                    f"rank {rank}: {name}: sent before full"
                )
            first = min(a for a, _, _ in step["comm"])
            assert (first < last) == (len(ddp.buckets) > 1), f"rank {rank}: {name}: first launch {first}, last {last}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    overlap.timing_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    tied_bytes = naive.trainable_bytes(TiedNet())
    gaps = check_tied(ctx, {"a bucket per tensor": 1e-6, "a few": tied_bytes / 4 / MIB, "one bucket": 25})
    caps, variants, steps = sweep(ctx, args)
    check_sweep(caps, variants, steps, ctx.rank)
    assignment = compare_with_torch()
    rows = []
    for name, runs in steps.items():
        ov = [overlap.overlap(s) for s in runs]
        rows.append(
            {
                "variant": name,
                "buckets": len(variants[name].buckets) if name in caps else None,
                "step ms": statistics.median(s["finish_ms"] for s in runs),
                "backward ms": statistics.median(s["backward_ms"] for s in runs),
                "exposed ms": statistics.median(o["exposed"] for o in ov),
                "in flight ms": statistics.median(o["in flight"] for o in ov),
                "inside backward ms": statistics.median(o["inside backward"] for o in ov),
            }
        )
    naive_exposed = rows[0]["exposed ms"]
    for row in rows:
        row["exposed vs NaiveDDP"] = row["exposed ms"] / naive_exposed
    lessonlib.report("sweep", rows)
    if ctx.is_main:
        lessonlib.report("tied", gaps)
        lessonlib.report("timeline", {name: runs[-1] for name, runs in steps.items()})
        lessonlib.report("assignment", assignment)
        print(f"{'variant':20} {'buckets':>7} {'step ms':>8} {'exposed ms':>10} {'x naive':>7} {'inside backward':>15}")
        for r in rows:
            print(
                f"{r['variant']:20} {r['buckets'] or '-':>7} {r['step ms']:8.2f} {r['exposed ms']:10.2f} "
                f"{r['exposed vs NaiveDDP']:7.2f} {r['inside backward ms'] / r['in flight ms']:15.0%}"
            )
        for who in ("ours", "torch"):
            print(
                f"{who:5} at {assignment['cap_mb']} MiB: "
                + " | ".join(f"{' '.join(n)} ({b} B)" for n, b in assignment[who])
            )
        first = assignment["torch's first bucket at its default cap"]
        print(f"a 1.3 MB model, torch's default cap: its first bucket holds {first} B, then the rest")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
