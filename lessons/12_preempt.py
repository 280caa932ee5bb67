"""torchrun --nproc_per_node=2 lessons/12_preempt.py

Preemption: the scheduler sends SIGTERM, waits a grace period, then sends SIGKILL. What a rank must do in between.

Options: --steps 8, --every 4 (a checkpoint every N steps), --step-time S (seconds each step sleeps, so
that a signal lands inside a step; default 0), --save-time S (extra seconds the save takes; default 0),
--no-handler (leave SIGTERM's default action: the process dies at once), --dir DIR, --pg-timeout 30.

The float64 DDP run of 12_elastic.py (chapter 5's model and data, a global batch of 12 rows, SGD with
momentum) saves every --every steps and resumes from the checkpoint on every start. torchrun forwards
the SIGTERM it gets (from Slurm, Kubernetes, a spot-instance notice, or you) to every rank, waits
--shutdown-timeout seconds (30 by default), then sends SIGKILL. The handler here only sets a flag: the
step in progress finishes, then the ranks all-reduce the flag (MAX) at the step's end, so every rank
stops after the same step even if the signal reached them at different moments; rank 0 saves (write a
temporary file, then rename it), a barrier, and every rank prints "preempted" and exits 0. Saving inside
the handler instead would save in the middle of a step, and a collective inside a handler can wait
forever on the one the handler interrupted. With --no-handler a SIGTERM ends the rank at once, and the
next start resumes from the last periodic checkpoint: the steps since then are lost. A run that ends
normally asserts on every rank that its weights equal one uninterrupted process's (within 1e-12),
however many times it was stopped and resumed. Without --dir the checkpoint lives in a temporary folder
removed at the end, so nothing can resume: give --dir to resume. The world size must divide 12.
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.exercises import load_function
from lessonlib.training import flat_params, global_batch, max_gap, mlp, my_rows

HERE = os.path.dirname(os.path.abspath(__file__))
atomic_save, shared_folder = (
    load_function(os.path.join(HERE, "10_save.py"), n) for n in ("atomic_save", "shared_folder")
)
uninterrupted = load_function(os.path.join(HERE, "12_elastic.py"), "uninterrupted")  # one process, same run
ROWS, LR, MOMENTUM, TOL = 12, 0.1, 0.9, 1e-12

# [start: handler]
STOP = {"signal": None}


def on_sigterm(signum, frame):
    STOP["signal"] = signum  # only a flag: the step in progress finishes first


def stop_requested():
    """True on every rank if any rank has been signalled: the same answer everywhere, at the same step."""
    flag = torch.tensor([0.0 if STOP["signal"] is None else 1.0], dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


# [end: handler]


def say(line):
    # One write per line: torchrun starts ranks unbuffered (python -u), where print writes the text and
    # its newline apart, and the lines of two ranks that share a terminal can run together.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def save(ddp, opt, step, path, save_time, ctx):
    t = time.monotonic()
    if ctx.is_main:  # one writer; "step" is the next step to run
        time.sleep(save_time)  # stands for a large model's checkpoint
        atomic_save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "step": step}, path)
    dist.barrier()  # the checkpoint is complete before anyone goes on (or leaves)
    return time.monotonic() - t


def resume(ddp, opt, path):
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu")
    ddp.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return state["step"]


# [start: train]
def train(ddp, opt, start, args, path, ctx):
    """Steps start..steps-1; returns the step it stopped before, and whether a SIGTERM stopped it."""
    for step in range(start, args.steps):
        x, y = global_batch(step, ROWS)
        mine = my_rows([ROWS // ctx.world_size] * ctx.world_size, ctx.rank)
        opt.zero_grad()
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        time.sleep(args.step_time)  # a longer step: where a signal usually lands
        say(f"rank {ctx.rank}: step {step} done")
        if not args.no_handler and stop_requested():
            took = save(ddp, opt, step + 1, path, args.save_time, ctx)
            say(f"rank {ctx.rank}: SIGTERM: saved step {step + 1} in {took:.2f} s; exiting 0")
            return step + 1, True
        if (step + 1) % args.every == 0:
            save(ddp, opt, step + 1, path, args.save_time, ctx)
            say(f"rank {ctx.rank}: checkpoint at step {step + 1}")
    return args.steps, False


# [end: train]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=8, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--every", type=int, default=4, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps")
    parser.add_argument("--save-time", type=float, default=0.0, help="extra seconds each save takes")
    parser.add_argument("--no-handler", action="store_true", help="SIGTERM's default action: die at once")
    parser.add_argument("--dir", help="the checkpoint folder (kept, so that the next start resumes)")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="seconds a collective may wait")
    args = parser.parse_args()
    if not (0 <= args.step_time <= 60 and 0 <= args.save_time <= 120):
        parser.error(f"--step-time must be 0 to 60 and --save-time 0 to 120; got {args.step_time}, {args.save_time}")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if ROWS % world_size:
        sizes = ", ".join(str(n) for n in range(1, ROWS + 1) if ROWS % n == 0)
        parser.error(f"{world_size} ranks cannot split the global batch of {ROWS} rows evenly: run at {sizes} ranks")
    if not args.no_handler:
        signal.signal(signal.SIGTERM, on_sigterm)  # before setup: a signal may come at any time
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    ddp = DDP(mlp(seed=0))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        folder = args.dir
        stopped, preempted = run(ddp, opt, args, folder, ctx)
    else:
        with shared_folder(ctx) as folder:
            stopped, preempted = run(ddp, opt, args, folder, ctx)
    lessonlib.report("end", {"step": stopped, "preempted": preempted})
    if not preempted:
        gap = max_gap(flat_params(ddp.module), uninterrupted(args.steps))
        print(f"rank {ctx.rank}: finished {args.steps} steps; gap to one uninterrupted process: {gap:.1e}")
        assert gap <= TOL, f"rank {ctx.rank}: weights differ from the uninterrupted run by {gap}"
    lessonlib.teardown()


def run(ddp, opt, args, folder, ctx):
    path = os.path.join(folder, "checkpoint.pt")
    start = resume(ddp, opt, path)
    say(f"rank {ctx.rank}: starting at step {start}")
    lessonlib.report("start", start)
    return train(ddp, opt, start, args, path, ctx)


if __name__ == "__main__":
    main()
