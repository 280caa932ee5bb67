"""torchrun --nproc_per_node=2 lessons/15_bucketed_ddp.py

BucketedDDP(module, bucket_size_mb): gradients sent in buckets, each as soon as its last gradient is ready.

Options: --pg-timeout S (default 30). What a bucket costs, and the step it makes: lessons/15_bucket_sizes.py.

OverlappedDDP (lessons/15_overlap_ddp.py) sends one message per tensor; every message pays a fixed
cost. BucketedDDP groups the trainable parameters, in reverse registration order (the order backward
usually finishes them), into buckets of at most bucket_size_mb MiB (a tensor larger than that gets one
of its own; a bucket holds one dtype). Each hook counts a bucket's gradients down; the last one flattens
the bucket and starts its all-reduce, whichever bucket that is. finish_gradient_synchronization() waits
for each, divides, copies back; on_train_batch_start() resets the counts. Asserted, on every rank:
1. On TiedNet (float64, tied, frozen, buffers; each rank its own seed), at three caps (a bucket per
   tensor, a few, one), gradients at every step and weights after 3 SGD steps equal one process and
   torch's DDP within TOL.
2. The assignment against torch's DDP, read from a comm hook at iteration 2 (iteration 1 is one bucket,
   then DDP rebuilds them in the order the gradients came, once: chapter 7), on 4 x Linear(64, 64) with
   a 0.03 MiB cap: the same parameters in the same order (reverse registration is the order backward
   produced them, here), cut elsewhere: ours never passes the cap, torch closes a bucket only once it
   reaches the cap, so its last tensor may pass it. And on a 1.3 MB model, bucket_cap_mb left at its
   default (25 MiB): torch's first bucket closes at 1 MiB (a small first bucket, so that communication
   starts early; passed explicitly, 25 gives one bucket: chapter 7), ours at 25 MiB is one bucket.
3. The launch order, on Swapped, a model whose second layer runs first, so that backward finishes the
   first layer's gradient first, a weight per bucket: torch's DDP (find_unused_parameters=True, so its
   buckets are cut by the cap from the start and never rebuilt) starts bucket 0 (the second layer's)
   first and the first layer's after it, although that one was ready before: its reducer starts
   buckets strictly in index order (mark_bucket_ready in reducer.cpp); BucketedDDP starts whichever
   fills first. Every rank must issue its collectives in the same order, or gloo and NCCL pair one
   rank's bucket with another's bucket on the next rank: an error or a hang if the sizes differ,
   silently mixed gradients if they do not. Torch's order is its buckets' index order, and after the
   rebuild rank 0's assignment is broadcast to every rank (sync_bucket_indices), so the order does not
   depend on how each rank's backward went; BucketedDDP's is the order the gradients come, the same on
   every rank only when every rank's autograd runs the same graph in the same order.
"""

import argparse

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


# [start: launch_order]
class Swapped(torch.nn.Module):
    """`first` registered first but run last: backward finishes its gradients before `second`'s, the
    opposite of what the buckets' reverse registration order expects."""

    def __init__(self, width=64):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(width, width, bias=False), torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        return self.first(torch.tanh(self.second(x)))


def launch_order(cap_mb=0.01):
    """One backward on Swapped, a weight per bucket (16 KiB, over the cap): the layer whose gradient was ready
    first, and the layers in the order torch's DDP and BucketedDDP started their buckets' all-reduces."""
    theirs, ready, torch_order = Swapped(), [], []
    # find_unused_parameters=True: buckets cut by the cap from the first iteration and never rebuilt (see
    # torch_buckets). DDP then warns that it found no unused parameter: true, and not why it is set here.
    ddp = DDP(theirs, bucket_cap_mb=cap_mb, find_unused_parameters=True)
    for layer in ("first", "second"):
        getattr(theirs, layer).weight.register_post_accumulate_grad_hook(lambda p, layer=layer: ready.append(layer))

    def hook(state, bucket):  # called as DDP starts the bucket's all-reduce
        torch_order.append("first" if bucket.parameters()[0] is theirs.first.weight else "second")
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    ddp(torch.randn(2, 64)).square().mean().backward()
    ours = BucketedDDP(Swapped(), cap_mb)
    ours(torch.randn(2, 64)).square().mean().backward()
    our_order = [ours.names[id(ours.buckets[i][0])].split(".")[0] for i, _, _ in ours.handles]
    ours.finish_gradient_synchronization()
    return {"ready first": ready[0], "torch DDP": torch_order, "BucketedDDP": our_order}


# [end: launch_order]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    tied_bytes = naive.trainable_bytes(TiedNet())
    gaps = check_tied(ctx, {"a bucket per tensor": 1e-6, "a few": tied_bytes / 4 / MIB, "one bucket": 25})
    assignment = compare_with_torch()
    order = launch_order()
    # torch starts bucket 0 (second) first although bucket 1 (first) was ready before it; ours, as they fill
    assert order["ready first"] == "first" and order["torch DDP"] == ["second", "first"], f"rank {ctx.rank}: {order}"
    assert order["BucketedDDP"] == ["first", "second"], f"rank {ctx.rank}: {order}"
    if ctx.is_main:
        lessonlib.report("tied", gaps)
        lessonlib.report("assignment", assignment)
        lessonlib.report("launch order", order)
        for r in gaps:
            print(f"{r['cap']} ({r['buckets']} buckets): gap to one process {r['gap to one process']:.1e}")
        for who in ("ours", "torch"):
            print(
                f"{who:5} at {assignment['cap_mb']} MiB: "
                + " | ".join(f"{' '.join(n)} ({b} B)" for n, b in assignment[who])
            )
        first = assignment["torch's first bucket at its default cap"]
        print(f"a 1.3 MB model, torch's default cap: its first bucket holds {first} B, then the rest")
        print(f"Swapped, ready first: {order['ready first']}; started: {order}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
