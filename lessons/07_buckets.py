"""torchrun --nproc_per_node=2 lessons/07_buckets.py

DDP's gradient buckets, watched from inside backward(): what each one holds, and when it is sent.

Options: --layers 8, --width 64, --bucket-cap-mb 0.03, --steps 3 (the defaults).

DDP does not all-reduce each gradient alone: it packs gradients into buckets of about bucket_cap_mb
(MiB) and all-reduces a bucket once every gradient in it is ready. A communication hook (called once
per bucket) and a post-accumulate-grad hook on every parameter record, on one clock, what each bucket
holds and when. Asserted here (torch 2.14, find_unused_parameters off):
  1. Iteration 1 uses ONE bucket, every parameter in model order, whatever the cap. DDP then rebuilds
     the buckets in the order gradients became ready, bucket 0 holding the LAST layer, and keeps them.
  2. Every iteration, every parameter is in exactly one bucket; buckets go out in index order.
  3. A bucket is closed by the tensor that brings it to the cap: it can pass the cap by up to that
     tensor's size, and every bucket but the last reaches the cap.
  4. Bucket 0's all-reduce starts before any other gradient, layer 0's included, exists: communication
     overlaps the rest of backward.
  5. A bigger cap gives fewer buckets. bucket_cap_mb=25, passed, gives one bucket for a small model;
     left at its default (also 25), the first bucket is capped at 1 MiB.
  6. A bucket is a flat buffer of its own: by default DDP copies each gradient into it and the averaged
     values back into .grad, which keeps its own memory (no .grad lies inside a bucket's buffer).
     With gradient_as_bucket_view=True every .grad is a view into its bucket (all of them lie inside):
     no copies, and one copy of the gradients less in memory. Checked by data pointers.
"""

import argparse
import time
from collections import OrderedDict

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib

MIB = 1024 * 1024  # DDP's "MB" is a mebibyte
SWEEP = (0.01, 0.03, 0.1, 25)


def build(layers, width):
    torch.manual_seed(0)
    pairs = [[(f"fc{i}", torch.nn.Linear(width, width)), (f"act{i}", torch.nn.Tanh())] for i in range(layers)]
    return torch.nn.Sequential(OrderedDict(pair for both in pairs for pair in both))


# [start: hooks]
def watch(model, cap_mb):
    """Wrap `model` in DDP; log each bucket's all-reduce and each gradient's arrival, per iteration."""
    names = {id(p): n for n, p in model.named_parameters()}
    log = {"it": 0, "buckets": [], "ready": []}

    def hook(state, bucket):  # called once per bucket, as soon as it is full and the ones before it have gone
        log["buckets"].append(
            row := {
                "it": log["it"],
                "index": bucket.index(),
                "params": [names[id(p)] for p in bucket.parameters()],
                "bytes": bucket.buffer().numel() * bucket.buffer().element_size(),
                "launch": time.perf_counter(),
            }
        )

        def stamp(fut):  # runs when the all-reduce has finished
            row["done"] = time.perf_counter()
            return fut.value()

        return allreduce_hook(None, bucket).then(stamp)

    ddp = DDP(model) if cap_mb is None else DDP(model, bucket_cap_mb=cap_mb)
    ddp.register_comm_hook(None, hook)
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: log["ready"].append((log["it"], n, time.perf_counter())))
    return ddp, log


# [end: hooks]


def run(ddp, log, steps, width, rank):
    """`steps` forward/backward passes: each iteration's buckets, and its backward's (start, end)."""
    spans = []
    for it in range(1, steps + 1):
        log["it"] = it
        ddp.zero_grad()
        x = torch.randn(16, width, generator=torch.Generator().manual_seed(100 * rank + it))
        loss = ddp(x).square().mean()
        start = time.perf_counter()
        loss.backward()  # the buckets' all-reduces are launched, and waited for, in here
        spans.append((start, time.perf_counter()))
    return [[b for b in log["buckets"] if b["it"] == it] for it in range(1, steps + 1)], spans


def check(model, log, layouts, cap_mb):
    order = [n for n, _ in model.named_parameters()]
    size = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    for it, buckets in enumerate(layouts, start=1):
        ready = {n: t for i, n, t in log["ready"] if i == it}
        assert sorted(n for b in buckets for n in b["params"]) == sorted(order), f"iteration {it}: {buckets}"
        assert [b["index"] for b in buckets] == list(range(len(buckets))), "buckets go out in index order"
        assert all(b["bytes"] == sum(size[n] for n in b["params"]) for b in buckets), "a bucket's bytes"
        assert all(b["launch"] >= max(ready[n] for n in b["params"]) for b in buckets), "sent before it was full"
        assert it < 3 or [b["params"] for b in buckets] == [b["params"] for b in layouts[1]], "rebuilt again"
        later = [t for n, t in ready.items() if n not in buckets[0]["params"]]  # gradients bucket 0 lacks
        if later:  # two or more buckets: bucket 0 is on the wire while backward still computes
            assert buckets[0]["launch"] < min(later) <= ready["fc0.weight"], f"iteration {it}: no overlap"
    assert [b["params"] for b in layouts[0]] == [order], "iteration 1: one bucket, in model order"
    ready_1 = [n for it, n, _ in log["ready"] if it == 1]
    rebuilt, cap = layouts[1], int(cap_mb * MIB)
    assert [n for b in rebuilt for n in b["params"]] == ready_1, "rebuilt in the order gradients arrived"
    assert rebuilt[0]["params"][0].startswith(order[-1].split(".")[0] + "."), "bucket 0 holds the last layer"
    assert all(b["bytes"] - size[b["params"][-1]] < cap for b in rebuilt), "open until its last tensor"
    assert all(b["bytes"] >= cap for b in rebuilt[:-1]), "closed only when full"


def timeline(log, buckets, span, it):
    """Iteration `it` for a plot: times in ms from the start of its backward, all on one clock."""
    ms = lambda t: round((t - span[0]) * 1e3, 4)  # noqa: E731
    return {
        "iteration": it,
        "backward_end_ms": ms(span[1]),
        "grad_ready": [
            {"param": n, "layer": int(n.split(".")[0][2:]), "ms": ms(t)} for i, n, t in log["ready"] if i == it
        ],
        "buckets": [
            {
                "index": b["index"],
                "params": b["params"],
                "bytes": b["bytes"],
                "launch_ms": ms(b["launch"]),
                "done_ms": ms(b["done"]),
            }
            for b in buckets
        ],
    }


# [start: views]
def grads_inside_buckets(as_view, steps=2):
    """After `steps` steps: how many parameters' .grad lie inside a bucket's flat buffer, of how many."""
    model = build(2, 8)
    spans = []  # (first byte, end) of each bucket's buffer, this step

    def hook(state, bucket):
        buf = bucket.buffer()
        spans.append((buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()))
        return allreduce_hook(None, bucket)

    ddp = DDP(model, gradient_as_bucket_view=as_view)
    ddp.register_comm_hook(None, hook)
    for _ in range(steps):
        spans.clear()
        ddp(torch.randn(4, 8)).square().mean().backward()
    inside = [any(a <= p.grad.data_ptr() < b for a, b in spans) for p in model.parameters()]
    return sum(inside), len(inside)


# [end: views]


def megabytes(text):
    value = float(text)  # argparse turns a ValueError into "invalid megabytes value"
    if not 0.001 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{value} outside the allowed range 0.001..100")
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--layers", type=int, default=8, choices=range(2, 33), metavar="2..32")
    parser.add_argument("--width", type=int, default=64, choices=range(1, 257), metavar="1..256")
    parser.add_argument("--bucket-cap-mb", type=megabytes, default=0.03, metavar="0.001..100")
    parser.add_argument("--steps", type=int, default=3, choices=range(2, 21), metavar="2..20")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu")

    model = build(args.layers, args.width)
    ddp, log = watch(model, args.bucket_cap_mb)
    layouts, spans = run(ddp, log, args.steps, args.width, ctx.rank)
    check(model, log, layouts, args.bucket_cap_mb)
    last = f"fc{args.layers - 1}"
    assert layouts[1][0]["params"][:2] == [f"{last}.bias", f"{last}.weight"], layouts[1][0]["params"]
    for it, (buckets, (_, end)) in enumerate(zip(layouts, spans), start=1):  # backward waits for them all
        assert all(b["done"] <= end for b in buckets), f"iteration {it}: backward() returned before a bucket"
    if ctx.is_main:
        for it in (1, 2):
            lessonlib.report(
                "buckets",
                {
                    "cap_mb": args.bucket_cap_mb,
                    "iteration": it,
                    "buckets": [{k: b[k] for k in ("index", "params", "bytes")} for b in layouts[it - 1]],
                },
            )
            print(
                f"iteration {it}: {len(layouts[it - 1])} bucket(s): "
                + " | ".join(
                    f"#{b['index']} {b['params'][0]}..{b['params'][-1]} {b['bytes']} B" for b in layouts[it - 1]
                )
            )
        tl = lessonlib.report("timeline", timeline(log, layouts[-1], spans[-1], args.steps))
        b0, ready = tl["buckets"][0], {g["param"]: g["ms"] for g in tl["grad_ready"]}
        print(
            f"iteration {args.steps}, ms into backward: bucket 0 launched {b0['launch_ms']:.3f}, done "
            f"{b0['done_ms']:.3f}; fc0.weight's gradient ready {ready['fc0.weight']:.3f}; "
            f"backward returned {tl['backward_end_ms']:.3f}"
        )

    sweep = {}  # every model here is under 25 MiB (32 layers of 256 x 256 at most)
    for cap in sorted({*SWEEP, args.bucket_cap_mb}):  # the same order on every rank: DDP() is a collective
        sweep[cap] = len(
            layouts[1]
            if cap == args.bucket_cap_mb
            else run(*watch(build(args.layers, args.width), cap), 2, args.width, ctx.rank)[0][1]
        )
    assert list(sweep.values()) == sorted(sweep.values(), reverse=True) and sweep[25] == 1, sweep
    # [start: first_bucket]
    big = {}  # 5 layers of 256 x 256 floats, 1.3 MB: more than DDP's 1 MiB first bucket
    for cap in (None, 25):  # None: leave bucket_cap_mb at its default, which is 25
        big[cap] = [b["bytes"] for b in run(*watch(build(5, 256), cap), 2, 256, ctx.rank)[0][1]]
    assert len(big[None]) == 2 and big[None][0] >= MIB > big[None][0] - 256 * 256 * 4, big  # closed by a weight
    assert len(big[25]) == 1, big  # the same 25, asked for by name: no small first bucket
    # [end: first_bucket]
    views = {flag: grads_inside_buckets(flag) for flag in (False, True)}
    assert views[False][0] == 0 and views[True][0] == views[True][1], views
    if ctx.is_main:
        lessonlib.report(
            "views", {f"gradient_as_bucket_view={k}": f"{n} of {total}" for k, (n, total) in views.items()}
        )
        lessonlib.report("sweep", [{"cap_mb": c, "buckets": n} for c, n in sweep.items()])
        lessonlib.report("first_bucket", {"default": big[None], "cap_25": big[25]})
        print(f"buckets at iteration 2 by bucket_cap_mb: {sweep}")
        print(f"a 1.3 MB model, bucket bytes: default {big[None]}, bucket_cap_mb=25 {big[25]}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
