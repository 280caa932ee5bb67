"""torchrun --nproc_per_node=2 lessons/12_crash.py

One rank dies in the middle of training: what the others see, and how to find the one that started it.

Options: --fail raise, --fail sigkill, --fail exit or --fail abort (how rank --rank dies at step --at-step;
default: no rank fails), --rank R (default: the last rank), --at-step K (default 3), --steps N (default 6),
--pg-timeout S (default 30), --no-record (run main without torch's @record).

Every step, each rank loads a batch and all-reduces its loss. With --fail, one rank goes away at step K
in one of four ways: an exception while it loads its batch (raise), killed by the operating system as the
out-of-memory killer would (sigkill: no Python traceback, no exit record), a clean early exit, as when a
rank believes it has run out of data (exit: exit code 0), or an abort from C++ code (abort: SIGABRT, what
NCCL's watchdog does after a timeout, and gloo after a malformed message; no Python exception). The
surviving ranks are inside the next all_reduce when their peer disappears, and fail there too, with an
error that names only the connection. `main` is wrapped in torch's @record, so an exception is also
written to the file torchrun names in TORCHELASTIC_ERROR_FILE, and torchrun's summary shows its
traceback; @record also turns on Python's faulthandler, which prints every thread's stack when the
process is aborted.
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import lessonlib

FAILURES = ("none", "raise", "sigkill", "exit", "abort")


def load_batch(step, rank, args):
    # [start: fail]
    if rank == args.rank and step == args.at_step:
        if args.fail == "raise":
            raise ValueError(f"rank {rank}: corrupt sample in the batch of step {step}")
        if args.fail == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does: no traceback
        if args.fail == "exit":
            print(f"rank {rank}: no more data at step {step}, leaving", flush=True)
            sys.exit(0)  # a clean exit, too early: exit code 0
        if args.fail == "abort":
            os.abort()  # SIGABRT, as from C++: no exception for Python to catch or @record to write
    # [end: fail]
    return torch.full((4,), float(step + rank))


def main(args):
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    if args.rank is None:
        args.rank = ctx.world_size - 1
    if ctx.is_main:
        where = os.environ.get("TORCHELASTIC_ERROR_FILE", "(not under torchrun)")
        print(f"torchrun's error file for rank 0: {where}")
    for step in range(args.steps):
        batch = load_batch(step, ctx.rank, args)
        loss = batch.mean().reshape(1)
        dist.all_reduce(loss)  # the survivors wait here for the rank that is gone
        expected = sum(step + r for r in range(ctx.world_size))
        assert loss.item() == expected, f"rank {ctx.rank}: step {step} loss {loss.item()}, expected {expected}"
    if ctx.is_main:
        print(f"{args.steps} steps on {ctx.world_size} rank(s), no failure")
    lessonlib.teardown()


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--fail", choices=FAILURES, default="none", help="how the failing rank dies")
    parser.add_argument("--rank", type=int, default=None, help="the rank that fails (default: the last)")
    parser.add_argument("--at-step", type=int, default=3, help="the step at which it fails")
    parser.add_argument("--steps", type=int, default=6, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="init_process_group's timeout, seconds")
    parser.add_argument("--no-record", action="store_true", help="run main without torch's @record")
    return parser.parse_args()


if __name__ == "__main__":
    # [start: record]
    args = parse()
    # @record catches an exception that leaves main, writes it (traceback, time) as JSON to the file named
    # by TORCHELASTIC_ERROR_FILE, which torchrun set for this rank, and raises it again.
    entry = main if args.no_record else record(main)
    entry(args)
    # [end: record]
