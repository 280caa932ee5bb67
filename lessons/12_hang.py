"""torchrun --nproc_per_node=2 lessons/12_hang.py

A rank that skips a collective: the others wait for it, and only a bound turns the wait into an error.

Options: --bug barrier-in-if or --bug eval-in-if (make the mistake; default: none), --pg-timeout S (default 30),
--watchdog S (print every thread's stack when an epoch takes longer than S seconds), --monitored (rank 0 waits
in monitored_barrier, which names the ranks that never arrive), --epochs N (default 2).

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--bug", choices=BUGS, default="none", help="the mistake to make (default: none)")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="init_process_group's timeout, seconds")
    parser.add_argument("--watchdog", type=float, default=0.0, help="dump stacks if an epoch takes this long")
    parser.add_argument("--monitored", action="store_true", help="rank 0 waits in monitored_barrier instead")
    parser.add_argument("--epochs", type=int, default=2, choices=range(1, 11), metavar="1..10")
    args = parser.parse_args()

    # [start: stacks]
    # Where is each rank stuck? `kill -USR1 PID` prints every thread's Python stack to stderr, at once,
    # even while the rank is blocked inside a collective (faulthandler writes from C).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # [end: stacks]
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    print(f"rank {ctx.rank}: pid {os.getpid()}", flush=True)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    expected_correct = sum(1 for i in range(100) if i % 3)
    for epoch in range(args.epochs):
        # [start: watchdog]
        if args.watchdog:  # a watchdog: print every stack if this epoch is not over in time
            faulthandler.dump_traceback_later(args.watchdog, exit=False)
        # [end: watchdog]
        loss = train_step(epoch, ctx.rank)
        correct = epoch_end(ctx, epoch, args.bug, args.monitored, timeout)
        if args.watchdog:
            faulthandler.cancel_dump_traceback_later()
        expected_loss = sum(epoch + r for r in range(ctx.world_size))
        assert loss == expected_loss, f"rank {ctx.rank}: epoch {epoch} loss {loss}, expected {expected_loss}"
        if ctx.is_main:
            assert correct == expected_correct, f"epoch {epoch}: {correct} correct, expected {expected_correct}"
            print(f"epoch {epoch}: loss {loss:g}, checkpoint saved, {correct:g}/100 correct")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
