"""torchrun --nproc_per_node=2 lessons/12_debug_one_rank.py

Debugging one rank of several: a breakpoint on one rank, a log file per rank, a debugger on every rank.

Options: --steps 3, --pdb-rank R, --dist-breakpoint R, --log-dir DIR, --debugpy-port P, --pg-timeout SECONDS
(default 30, or 1800 with --pdb-rank or --debugpy-port: time for a person in the debugger).

Every step, each rank takes its 4 values of the step's global batch, drops the ones that are NaN, and
all-reduces [sum, count]; the mean must equal the mean of every valid value (asserted). At step 1 the
last value of the batch, which belongs to the last rank, is NaN.
--pdb-rank R: rank R calls breakpoint() at step 1, just before the all_reduce, with `rank` and `tensor`
in scope; the other ranks go on into the all_reduce and wait there, for at most --pg-timeout seconds.
PYTHONBREAKPOINT=0 turns breakpoint() into a no-op without touching the code.
--dist-breakpoint R: every rank calls torch.distributed.breakpoint(rank=R) at step 1 instead: rank R stops
in pdb, the others wait in a barrier, and every group's timeout is first raised to an hour (and stays
there: each rank prints its timeout after the last step), so the short --pg-timeout does not end the session.
--log-dir DIR: Python logging to DIR/rank{r}.log, one file per rank, rank 0 at INFO and the others at
WARNING, as scripts commonly set it up. The NaN warning is only in the last rank's file (asserted).
--debugpy-port P: rank r listens for a debugger on 127.0.0.1, port P + r, and waits until one attaches
(VS Code's "attach to rank r" in .vscode/launch.json), for at most --pg-timeout seconds.
"""

import argparse
import logging
import os

import torch
import torch.distributed as dist

import lessonlib

PER_RANK = 4  # values of the global batch per rank
DEBUG_TIMEOUT = 1800.0  # seconds: the default --pg-timeout while a person may sit in a debugger


def batch(step, world_size):
    """The step's global batch, the same on every rank; at step 1 its last value is NaN."""
    values = torch.arange(PER_RANK * world_size, dtype=torch.float64) + 10 * step
    if step == 1:
        values[-1] = float("nan")
    return values


# [start: logging]
def rank_logger(log_dir, rank):
    """A logger writing to log_dir/rank{rank}.log (or stderr): INFO on rank 0, WARNING and worse on the others."""
    log = logging.getLogger(f"rank{rank}")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        handler = logging.FileHandler(os.path.join(log_dir, f"rank{rank}.log"), mode="w")
    else:
        handler = logging.StreamHandler()  # stderr, which torchrun mixes with the other ranks'
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.propagate = False  # only the handler above: no second copy through the root logger
    return log


# [end: logging]


# [start: debugpy]
def wait_for_debugger(port, rank, timeout):
    import threading

    import debugpy  # ships with ipykernel, which requirements.txt installs

    debugpy.listen(("127.0.0.1", port + rank))  # one port per rank: VS Code attaches to each
    print(f"rank {rank}: debugpy listening on 127.0.0.1:{port + rank}, waiting for a debugger", flush=True)
    bound = threading.Timer(timeout, debugpy.wait_for_client.cancel)  # this wait has a bound too
    bound.start()
    debugpy.wait_for_client()
    bound.cancel()
    if not debugpy.is_client_connected():
        raise TimeoutError(f"rank {rank}: no debugger attached to port {port + rank} within {timeout:g} s")
    print(f"rank {rank}: debugger attached", flush=True)


# [end: debugpy]


def step_mean(step, ctx, log, pdb_rank, dist_rank=None):
    values = batch(step, ctx.world_size)
    mine = values[ctx.rank * PER_RANK : (ctx.rank + 1) * PER_RANK]
    bad = mine.isnan()
    if bad.any():
        log.warning("step %d: %d of my %d values are NaN, skipped", step, int(bad.sum()), len(mine))
    rank = ctx.rank
    # [start: dist_breakpoint]
    if dist_rank is not None and step == 1:
        dist.breakpoint(rank=dist_rank)  # on every rank: rank dist_rank stops in pdb, the others wait for it
    # [end: dist_breakpoint]
    # [start: pdb]
    tensor = torch.stack([mine[~bad].sum(), (~bad).sum().double()])  # [sum, count] of my valid values
    if rank == pdb_rank and step == 1:
        breakpoint()  # this rank stops here; the others wait in the all_reduce below
    dist.all_reduce(tensor)
    # [end: pdb]
    log.info("step %d: sum %g over %d values", step, tensor[0].item(), int(tensor[1].item()))
    return (tensor[0] / tensor[1]).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=3, choices=range(2, 11), metavar="2..10")
    parser.add_argument("--pdb-rank", type=int, help="the rank that stops at breakpoint() at step 1")
    parser.add_argument("--dist-breakpoint", type=int, help="the rank that stops at dist.breakpoint() at step 1")
    parser.add_argument("--log-dir", help="write DIR/rank{r}.log, one file per rank")
    parser.add_argument("--debugpy-port", type=int, help="rank r waits for a debugger on 127.0.0.1:PORT+r")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective may wait (30; 1800 when debugging)")
    args = parser.parse_args()
    debugging = args.pdb_rank is not None or args.debugpy_port is not None
    timeout = args.pg_timeout if args.pg_timeout is not None else DEBUG_TIMEOUT if debugging else 30.0
    ctx = lessonlib.setup(device="cpu", timeout=timeout)
    if args.debugpy_port is not None:
        wait_for_debugger(args.debugpy_port, ctx.rank, timeout)
    log = rank_logger(args.log_dir, ctx.rank)
    log.info("world size %d, collectives wait at most %g s", ctx.world_size, timeout)
    for step in range(args.steps):
        got = step_mean(step, ctx, log, args.pdb_rank, args.dist_breakpoint)
        valid = batch(step, ctx.world_size)
        expected = valid[~valid.isnan()].mean().item()
        assert got == expected, f"rank {ctx.rank}: step {step}: mean {got} != {expected}"
    if args.dist_breakpoint is not None:  # dist.breakpoint set every group's timeout to its timeout_s, for good
        now = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
        print(f"rank {ctx.rank}: after dist.breakpoint, collectives wait at most {now.total_seconds():g} s")
    for handler in log.handlers:
        handler.close()
    if args.log_dir:
        path = os.path.join(args.log_dir, f"rank{ctx.rank}.log")
        with open(path) as f:
            text = f.read()
        warns = "NaN, skipped" in text
        assert warns == (ctx.rank == ctx.world_size - 1), f"rank {ctx.rank}: NaN warning in {path}: {warns}"
        assert ("INFO" in text) == ctx.is_main, f"rank {ctx.rank}: INFO lines in {path}: {'INFO' in text}"
        lessonlib.report("log", {"file": path, "lines": text.splitlines()})
    if ctx.is_main:
        print(f"{args.steps} steps on {ctx.world_size} ranks: every mean skips the NaN and matches")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
