"""torchrun --nproc_per_node=2 lessons/12_hang.py

A rank that skips a collective: the others wait for it, and only a bound turns the wait into an error.

Options: --bug barrier-in-if or --bug eval-in-if (make the mistake; default: none), --pg-timeout S (default 30),
--watchdog S (print every thread's stack when an epoch takes longer than S seconds), --monitored (rank 0 waits
in monitored_barrier, which names the ranks that never arrive), --epochs N (default 2), --flight-recorder DIR
(with --watchdog S: at S+1 seconds also write this rank's flight-recorder trace to DIR/rank_<rank>).

Every epoch, each rank trains (an all_reduce of its loss), rank 0 saves a checkpoint while the others wait
for it, and every rank evaluates its share of the data and sends its count of correct answers to rank 0
(dist.reduce). Both waits are collectives: every rank must call them, in the same order. The two mistakes
people commonly make put a collective inside `if rank == 0`: the barrier after the save
(--bug barrier-in-if), or the whole evaluation, reduce included (--bug eval-in-if). Rank 0 then waits in a
collective that no other rank calls, while the others are already in the next one: nothing moves until the
process group's timeout. Each rank prints its pid first, so `kill -USR1 PID` (the script registers
faulthandler for it) or `py-spy dump --pid PID` shows where it is stuck.
"""

import argparse
import datetime
import faulthandler
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import lessonlib

BUGS = ("none", "barrier-in-if", "eval-in-if")


def train_step(epoch, rank):
    loss = torch.tensor([float(epoch + rank)])
    dist.all_reduce(loss)  # every rank: the gradients' all-reduce, in miniature
    return loss.item()


def save_checkpoint(epoch):
    """Stands for rank 0's torch.save (chapter 10): what matters here is who waits for it."""


def evaluate(rank, world_size):
    """This rank's correct answers on its share of 100 samples (every third one counts as wrong)."""
    mine = range(rank, 100, world_size)
    return torch.tensor([float(sum(1 for i in mine if i % 3))])


def epoch_end(ctx, epoch, bug, monitored, timeout):
    # [start: checkpoint]
    if bug == "barrier-in-if":
        if ctx.is_main:
            save_checkpoint(epoch)
            if monitored:  # the same mistake, with a barrier that says who never came
                dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
            else:
                dist.barrier()  # only rank 0 gets here: it waits for ranks that never will
    else:
        if ctx.is_main:
            save_checkpoint(epoch)
        dist.barrier()  # every rank: nobody goes on before the checkpoint is written
    # [end: checkpoint]
    # [start: evaluate]
    if bug == "eval-in-if":
        if ctx.is_main:  # a popular tutorial evaluates "on rank 0 only", reduce included
            correct = evaluate(ctx.rank, ctx.world_size)
            dist.reduce(correct, dst=0)  # a collective: the other ranks never call it
    else:
        correct = evaluate(ctx.rank, ctx.world_size)  # every rank scores its share
        dist.reduce(correct, dst=0)  # every rank sends, rank 0 receives the sum
    # [end: evaluate]
    return correct.item() if ctx.is_main else None


def dump_flight_recorder(folder, rank):
    # [start: flight_recorder]
    # The flight recorder keeps each rank's last collectives (TORCH_FR_BUFFER_SIZE of them), gloo's too in
    # torch 2.14.1; NCCL writes them out by itself on a timeout, gloo does not, so write them here.
    Path(folder, f"rank_{rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    # [end: flight_recorder]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--bug", choices=BUGS, default="none", help="the mistake to make (default: none)")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="init_process_group's timeout, seconds")
    parser.add_argument("--watchdog", type=float, default=0.0, help="dump stacks if an epoch takes this long")
    parser.add_argument("--monitored", action="store_true", help="rank 0 waits in monitored_barrier instead")
    parser.add_argument("--epochs", type=int, default=2, choices=range(1, 11), metavar="1..10")
    parser.add_argument("--flight-recorder", type=Path, help="with --watchdog, write the recorder's trace here")
    args = parser.parse_args()
    if args.flight_recorder and not args.watchdog:
        parser.error("--flight-recorder writes the trace when --watchdog fires: give --watchdog S too")
    if args.flight_recorder:  # read when the process group is made, so set before setup
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")

    # [start: stacks]
    # Where is each rank stuck? `kill -USR1 PID` prints every thread's Python stack to stderr, at once,
    # even while the rank is blocked inside a collective (faulthandler writes from C).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # [end: stacks]
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    print(f"rank {ctx.rank}: pid {os.getpid()}", flush=True)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    if args.monitored:  # what monitored_barrier costs when every rank comes, against barrier: 20 of each
        cost = {}
        for name, wait in (
            ("barrier", dist.barrier),
            ("monitored_barrier", lambda: dist.monitored_barrier(timeout=timeout)),
        ):
            wait()  # once before timing
            start = time.perf_counter()
            for _ in range(20):
                wait()
            cost[name] = round((time.perf_counter() - start) / 20 * 1e6)  # microseconds each
        lessonlib.report("barrier cost", cost)
    expected_correct = sum(1 for i in range(100) if i % 3)
    for epoch in range(args.epochs):
        # [start: watchdog]
        if args.watchdog:  # a watchdog: print every stack if this epoch is not over in time
            faulthandler.dump_traceback_later(args.watchdog, exit=False)
        # [end: watchdog]
        if args.flight_recorder:  # a thread (the main one waits in a collective): a second after the stacks
            recorder = threading.Timer(args.watchdog + 1, dump_flight_recorder, (args.flight_recorder, ctx.rank))
            recorder.start()
        loss = train_step(epoch, ctx.rank)
        correct = epoch_end(ctx, epoch, args.bug, args.monitored, timeout)
        if args.watchdog:
            faulthandler.cancel_dump_traceback_later()
        if args.flight_recorder:
            recorder.cancel()
        expected_loss = sum(epoch + r for r in range(ctx.world_size))
        assert loss == expected_loss, f"rank {ctx.rank}: epoch {epoch} loss {loss}, expected {expected_loss}"
        if ctx.is_main:
            assert correct == expected_correct, f"epoch {epoch}: {correct} correct, expected {expected_correct}"
            print(f"epoch {epoch}: loss {loss:g}, checkpoint saved, {correct:g}/100 correct")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
