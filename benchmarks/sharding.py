"""python benchmarks/sharding.py [--world-sizes 2,4] [--steps 7] [--width 1024] [--blocks 4]

Chapter 13's measurements as ratios to DDP: step time, bytes each rank holds, bytes each rank sends.

One model (--blocks blocks of Linear(width, width) + ReLU, float32: 4.2M parameters by default), Adam,
16 rows per rank and step, trained three ways at every --world-sizes (one launch each, bounded):
  ddp     DistributedDataParallel (gradient_as_bucket_view=True: the gradients are DDP's buckets)
  zero1   the same DDP, with ZeroRedundancyOptimizer(optimizer_class=Adam): each rank keeps Adam's state
          for its share of the parameter tensors, updates those and broadcasts them to the others
  fsdp    fully_shard per block and at the root (ZeRO-3)
The three alternate step by step (after --warmup steps each), so that drift in the machine's load hits
them alike; a step is timed from a barrier to a barrier, the median is taken. Then, per rank:
  held    bytes of the storage behind the parameters, gradients and optimizer state after a step
          (lessonlib.sharding.held and optimizer_state: a shard's padding counts, the whole tensors
          FSDP gathers for a moment do not);
  whole   the most bytes of whole (not sharded) parameters alive at once, seen at every module's
          forward and backward hooks (DDP and ZeRO-1: always the whole model);
  sent    bytes the rank handed to the kernel during one more step (lessonlib.sharding.Traffic).
Prints the table: time of the slowest rank, held and whole of the rank that holds most, sent averaged
over ranks (a broadcast's root sends more than the others), each also as a ratio to DDP. No threshold:
this reports, it does not pass or fail. Under torchrun it runs as one rank of the benchmark.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lessonlib, installed or not

import lessonlib  # noqa: E402

RUN_TIMEOUT = 300  # seconds per launch; the default sizes take about a minute at 4 ranks on 2 cores
STRATEGIES = ("ddp", "zero1", "fsdp")
ROWS = 16  # per rank and step
MIB = 2**20


def build(strategy, width, blocks, mesh):
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(blocks))
    )
    if strategy == "fsdp":
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    model = DDP(model, gradient_as_bucket_view=True)  # else DDP keeps a second copy of the gradients
    if strategy == "ddp":
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)


class WholeParams:
    """The most bytes of whole parameters alive at once. FSDP swaps a unit's sharded DTensors for plain
    tensors while the unit computes, so the plain ones are the gathered weights. Looked at before and
    after every module's forward, and in backward when each module's output gradient arrives (hooks
    added after fully_shard's own, so they see what it gathered). The all-gather's receive buffer, a
    moment before the copy into those tensors, is not counted (torch's FSDPMemTracker: "All Gather")."""

    def __init__(self, model):
        self.model, self.peak = model, 0
        for m in model.modules():
            m.register_forward_pre_hook(self.look)
            m.register_forward_hook(self.after_forward)

    def after_forward(self, module, args, output):
        self.look()
        if output.requires_grad:
            output.register_hook(self.look)  # runs after FSDP's own hook on it, which gathers for backward

    def look(self, *_):
        from torch.distributed.tensor import DTensor

        now = sum(p.numel() * p.element_size() for p in self.model.parameters() if not isinstance(p, DTensor))
        self.peak = max(self.peak, now)


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lessonlib.sharding import Traffic, held, optimizer_state

    ctx = lessonlib.setup(device="cpu", timeout=120)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    runs = {s: build(s, args.width, args.blocks, mesh) for s in STRATEGIES}
    watch = {s: WholeParams(model) for s, (model, _) in runs.items()}
    g = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(ROWS, args.width, generator=g), torch.randn(ROWS, args.width, generator=g)

    def step(strategy):
        model, opt = runs[strategy]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    times = {s: [] for s in STRATEGIES}
    for i in range(args.warmup + args.steps):
        for s in STRATEGIES:
            dist.barrier()
            t0 = time.perf_counter()
            step(s)
            dist.barrier()  # the step ends when the slowest rank is done
            if i >= args.warmup:
                times[s].append(time.perf_counter() - t0)
    for s, (model, opt) in runs.items():
        local = opt.optim if s == "zero1" else opt  # ZeroRedundancyOptimizer's own Adam, with this rank's state
        dist.barrier()
        with Traffic() as t:  # nothing may print in here: stdout is a pipe, its bytes would count
            step(s)
        m = lessonlib.report(
            "measured",
            {
                "strategy": s,
                "ms": statistics.median(times[s]) * 1e3,
                "parameters": held(model.parameters()),
                "gradients": held(p.grad for p in model.parameters()),
                "optimizer state": held(optimizer_state(local)),
                "whole": watch[s].peak,
                "sent": t.sent,
                "calls": dict(t.calls),
            },
        )
        total = m["parameters"] + m["gradients"] + m["optimizer state"]
        print(f"rank {ctx.rank} {s}: {m['ms']:.1f} ms/step, holds {total / MIB:.1f} MiB, sent {t.sent} B in a step")
    lessonlib.teardown()


def summarize(run):
    """Per strategy: the slowest rank's median step, the largest held and whole bytes, the mean sent."""
    rows = {}
    for rank, m in run.reports("measured"):
        row = rows.setdefault(m["strategy"], {"ms": 0, "held": 0, "whole": 0, "sent": [], "calls": {}})
        row["ms"] = max(row["ms"], m["ms"])
        row["held"] = max(row["held"], m["parameters"] + m["gradients"] + m["optimizer state"])
        row["whole"] = max(row["whole"], m["whole"])
        row["sent"].append(m["sent"])
        row["calls"] = m["calls"] if rank == 0 else row["calls"]
    for row in rows.values():  # sent is None where /proc/self/io does not exist (not Linux)
        row["sent"] = None if None in row["sent"] else statistics.mean(row["sent"])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--world-sizes",
        type=lessonlib.comma_list(int, low=2, high=lessonlib.MAX_NPROC),
        default="2,4",
        help=f"comma-separated, each within 2..{lessonlib.MAX_NPROC}",
    )
    parser.add_argument("--steps", type=int, default=7, help="timed steps per strategy (at least 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 2)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    if args.steps < 5 or args.warmup < 2 or args.width < 1 or args.blocks < 1:
        parser.error(
            "need --steps >= 5 (a median of fewer is noise), --warmup >= 2 (DDP's second step rebuilds its buckets),"
            " --width and --blocks >= 1"
        )
    if "RANK" in os.environ:  # one rank of the launches below (or of a torchrun by hand)
        return worker(args)

    given = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width)]
    given += ["--blocks", str(args.blocks)]
    numel = args.blocks * (args.width + 1) * args.width
    print(
        f"{args.blocks} blocks of Linear({args.width}, {args.width}) + ReLU: {numel:,} float32 parameters "
        f"({numel * 4 / MIB:.1f} MiB), Adam, {ROWS} rows per rank; median of {args.steps} steps after {args.warmup}"
    )
    print(f"{'ranks':>5}  {'':<6}{'ms/step':>9}{'x ddp':>7}{'held MiB':>10}{'x ddp':>7}", end="")
    print(f"{'whole MiB':>11}{'x ddp':>7}{'sent MiB':>10}{'x ddp':>7}  collectives in a step (rank 0)")
    for n in args.world_sizes:
        run = lessonlib.launch(
            __file__, nproc=n, timeout=RUN_TIMEOUT, show="none", env={"OMP_NUM_THREADS": "1"}, args=given
        ).raise_for_status()
        rows = summarize(run)
        for s in STRATEGIES:
            line = f"{n:>5}  {s:<6}"
            for key, unit, width in (("ms", 1, 9), ("held", MIB, 10), ("whole", MIB, 11), ("sent", MIB, 10)):
                value, ddp = rows[s][key], rows["ddp"][key]
                line += (
                    f"{value / unit:>{width}.1f}{value / ddp:>7.2f}" if value is not None else f"{'n/a':>{width + 7}}"
                )
            print(line + "  " + ", ".join(f"{k} {v}" for k, v in sorted(rows[s]["calls"].items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
