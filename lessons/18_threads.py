"""torchrun --nproc_per_node=2 lessons/18_threads.py

How many threads each rank runs, and what that costs when ranks share cores: a CPU training step, timed.

Options: --steps 5 (timed steps, after one untimed), --width 256 (the model's hidden width), --pg-timeout 30.

Each rank trains a small float32 MLP under DDP (gloo) on a batch of its own, and prints one line: its host,
OMP_NUM_THREADS as it found it, the threads torch runs its operations on (torch.get_num_threads()), the
CPUs the process may run on (its affinity mask), and its median step time. torch takes its thread count
from OMP_NUM_THREADS when it is set, and otherwise from the CPUs in the process's affinity mask: all of the
machine's when nothing binds the rank to fewer. torchrun sets OMP_NUM_THREADS=1 when it starts more than
one rank per node (and says so); srun sets nothing, so several ranks of a node each start a thread per
core, and their threads fight over the same cores (chapter 18). Asserted on every rank: where
OMP_NUM_THREADS is set, torch runs that many threads; after the steps, every rank holds the same weights.
Rank 0 prints the job's slowest median step.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib

BATCH = 256


# [start: threads]
def threads():
    """What decides this rank's threads: the variable, torch's count, and the CPUs it may run on."""
    return {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
        "threads": torch.get_num_threads(),
        "cpus": len(os.sched_getaffinity(0)),
    }


# [end: threads]


def step_times(ddp, opt, rank, steps):
    """Seconds per step for `steps` steps, after one untimed (DDP's first step sets up its buckets)."""
    g = torch.Generator().manual_seed(rank)
    width = ddp.module[0].in_features
    x, y = torch.randn(BATCH, width, generator=g), torch.randn(BATCH, 1, generator=g)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return times[1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=5, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--width", type=int, default=256, choices=range(8, 2049), metavar="8..2048")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="seconds a collective may wait")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    mine = threads()
    if mine["OMP_NUM_THREADS"] != "unset":
        assert mine["threads"] == int(mine["OMP_NUM_THREADS"]), f"rank {ctx.rank}: {mine}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, 4 * args.width), torch.nn.ReLU(), torch.nn.Linear(4 * args.width, 1)
    )
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    median_ms = statistics.median(step_times(ddp, opt, ctx.rank, args.steps)) * 1000
    host = socket.gethostname()
    print(
        f"rank {ctx.rank}: host={host} OMP_NUM_THREADS={mine['OMP_NUM_THREADS']} threads={mine['threads']} "
        f"cpus={mine['cpus']} step_ms={median_ms:.1f}",
        flush=True,
    )
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    first = weights.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(weights, first), f"rank {ctx.rank}: weights differ from rank 0's after {args.steps + 1} steps"
    slowest = torch.tensor([median_ms])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    lessonlib.report("threads", {**mine, "host": host, "step_ms": median_ms})
    if ctx.is_main:
        print(f"{ctx.world_size} ranks: slowest median step {slowest.item():.1f} ms", flush=True)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
