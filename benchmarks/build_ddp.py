"""python benchmarks/build_ddp.py --world-sizes 2,4 --steps 7 --width 512 --layers 8 --batch 256

Chapter 15's hand-built DDPs timed as ratios to NaiveDDP: step time, and communication exposed after backward.

One float32 model (--layers Linear(width, width) + Tanh; 2.1M parameters, 8 MiB by default), --batch rows
per rank, trained with the chapter's classes, loaded from their lessons: NaiveDDP (all-reduce after
backward), OverlappedDDP (one async all-reduce per tensor, started by a post-accumulate-grad hook) and
BucketedDDP at several bucket sizes (--caps, MiB; 0 means a bucket per tensor), and torch's
DistributedDataParallel with its defaults. The variants alternate step by step (after --warmup steps each),
so that drift in the machine's load hits them alike; each rank starts a step's backward at a barrier.
Per variant, over --steps:
  step      the median ms from the start of backward() to the return of finish_gradient_synchronization()
            (torch's DDP: to the return of backward(), which waits for its buckets);
  exposed   that step's ms after backward() returned: communication not hidden behind backward;
  hidden    (NaiveDDP's step - the variant's step) / the communication alone, where the communication
            alone is the median ms of NaiveDDP's finish_gradient_synchronization() run again after each
            round with every rank starting it at a barrier (no backward beside it, no slower rank to wait
            for): lessons/15_overlap_ddp.py's hidden(), the chapter's definition. For OverlappedDDP, which
            sends NaiveDDP's messages, it is what overlap took off the step; for BucketedDDP and torch's DDP
            it also counts what fewer, larger messages saved. On gloo, time an all-reduce waits in gloo's
            queue during backward, and backward's own slowdown when gloo's threads take its cores, are in it;
            it can pass 1, since NaiveDDP's step also waits for the slower rank, the communication alone not.
Prints the slowest rank's step and exposed times, their ratios to NaiveDDP, and hidden from those. No
threshold: this reports. Under torchrun it runs as one rank of the benchmark.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lessonlib, installed or not

import lessonlib  # noqa: E402

RUN_TIMEOUT = 300  # seconds per launch; the defaults take well under a minute at 4 ranks on 2 cores


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    bucketed = lessonlib.load_lesson("15_bucketed_ddp")
    overlap, naive = bucketed.overlap, bucketed.naive
    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=120)
    build = lambda: overlap.stack(args.layers, args.width)  # noqa: E731
    variants = {"NaiveDDP": naive.NaiveDDP(build()), "OverlappedDDP": overlap.OverlappedDDP(build())}
    for cap in args.caps:
        variants[f"BucketedDDP {cap:g} MiB" if cap else "BucketedDDP per tensor"] = bucketed.BucketedDDP(
            build(), cap or 1e-6
        )
    logs = {name: overlap.watch(ddp) for name, ddp in variants.items()}
    theirs = DDP(build())
    g = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)

    def torch_step():
        theirs.zero_grad()
        loss = F.mse_loss(theirs(x), y)
        dist.barrier()
        start = time.perf_counter()
        loss.backward()  # DDP's buckets are all-reduced, and waited for, in here
        ms = (time.perf_counter() - start) * 1e3
        return {"finish_ms": ms, "backward_ms": ms}

    rows, alone = {name: [] for name in [*variants, "torch DDP"]}, []
    for i in range(args.warmup + args.steps):
        for name, ddp in variants.items():
            s = overlap.timed_step(ddp, logs[name], x, y)
            if i >= args.warmup:
                rows[name].append({"finish_ms": s["finish_ms"], "backward_ms": s["backward_ms"]})
        row = torch_step()
        if i >= args.warmup:
            rows["torch DDP"].append(row)
            alone.append(overlap.communication_alone(variants["NaiveDDP"]))
    lessonlib.report("alone", statistics.median(alone))
    for name, runs in rows.items():
        med = overlap.medians(runs)
        if name == "torch DDP":
            med["exposed"] = med["backward"] = None  # its all-reduces are waited for inside backward()
        buckets = len(variants[name].buckets) if hasattr(variants.get(name), "buckets") else None
        lessonlib.report("measured", {"variant": name, "buckets": buckets, **med})
    lessonlib.teardown()


def summarize(run):
    """Per variant: the slowest rank's median step and exposed ms; and the slowest rank's communication alone."""
    rows = {}
    for _, m in run.reports("measured"):
        row = rows.setdefault(m["variant"], {"step": 0, "exposed": 0, "buckets": m["buckets"]})
        row["step"] = max(row["step"], m["step"])
        row["exposed"] = None if m["exposed"] is None else max(row["exposed"], m["exposed"])
    return rows, max(ms for _, ms in run.reports("alone"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--world-sizes",
        type=lessonlib.comma_list(int, low=1, high=lessonlib.MAX_NPROC),
        default="2,4",
        help=f"comma-separated, each within 1..{lessonlib.MAX_NPROC}",
    )
    parser.add_argument("--steps", type=int, default=7, help="timed steps per variant (at least 3)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps first (at least 2: DDP rebuilds its buckets)"
    )
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument(
        "--caps",
        type=lessonlib.comma_list(float, low=0, high=100),
        default="0,1.5,4,25",
        help="BucketedDDP's bucket_size_mb values (MiB); 0: a bucket per tensor",
    )
    args = parser.parse_args()
    if args.steps < 3 or args.warmup < 2 or min(args.width, args.layers, args.batch) < 1:
        parser.error("need --steps >= 3, --warmup >= 2, and --width, --layers, --batch >= 1")
    if "RANK" in os.environ:  # one rank of the launches below (or of a torchrun by hand)
        return worker(args)

    given = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width)]
    given += ["--layers", str(args.layers), "--batch", str(args.batch), "--caps", ",".join(map(str, args.caps))]
    numel = args.layers * (args.width + 1) * args.width
    print(
        f"{args.layers} x Linear({args.width}, {args.width}) + Tanh: {numel:,} float32 parameters "
        f"({numel * 4 / 2**20:.1f} MiB), {args.batch} rows per rank; median of {args.steps} steps after {args.warmup}"
    )
    overlap = lessonlib.load_lesson("15_overlap_ddp")  # hidden(): the chapter's definition, not a copy
    print(f"{'ranks':>5}  {'variant':24}{'buckets':>8}{'step ms':>9}{'x naive':>8}{'exposed ms':>11}", end="")
    print(f"{'x naive':>8}{'hidden':>8}")
    for n in args.world_sizes:
        run = lessonlib.launch(
            __file__, nproc=n, timeout=RUN_TIMEOUT, show="none", env={"OMP_NUM_THREADS": "1"}, args=given
        ).raise_for_status()
        rows, alone = summarize(run)
        base = rows["NaiveDDP"]
        print(f"{n:>5}  communication alone (NaiveDDP's all-reduces after a barrier): {alone:.2f} ms")
        for name, r in rows.items():
            line = f"{n:>5}  {name:24}{r['buckets'] or '-':>8}{r['step']:9.2f}{r['step'] / base['step']:8.2f}"
            if r["exposed"] is None:
                line += f"{'(inside backward)':>19}"
            else:
                line += f"{r['exposed']:11.2f}{r['exposed'] / base['exposed']:8.2f}"
            hidden = overlap.hidden(base["step"], r["step"], alone)
            print(line + ("" if name == "NaiveDDP" else f"{hidden:8.0%}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
