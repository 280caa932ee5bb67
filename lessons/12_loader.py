"""torchrun --nproc_per_node=2 lessons/12_loader.py

A DataLoader worker that dies, and one that hangs: what each rank sees, and the bound `timeout=` puts on a hang.

Options: --part killed, hung or both (the default); --workers 2; --timeout 2 (seconds: the hung part's bound).

killed: each rank reads a DataLoader with --workers worker processes and, after the first batch, kills one
  of them with SIGKILL, as the kernel's out-of-memory killer does to a worker that holds too much (each
  worker is a process with its own copy of the dataset: chapter 4). The rank's next batch raises a
  RuntimeError that names the worker's pid, in one of two wordings, by whichever check saw the death first:
  the SIGCHLD handler the DataLoader installs ("DataLoader worker (pid N) is killed by signal: Killed.")
  or the check after a wait on the batch queue ("DataLoader worker (pid(s) N) exited unexpectedly").
  Asserted: one of them, with the pid. The items are plain Python numbers: tensors from a dead worker can
  fail a third way, while the rank fetches their shared memory from it (ConnectionRefusedError).
hung: item 5 of the dataset sleeps --timeout + 60 seconds, as a read from a stuck network file system
  would. With timeout=--timeout the rank raises "DataLoader timed out after N seconds" within about N
  seconds (asserted); without it the rank would wait as long as the read, and its peers in their next
  collective until the process group's timeout. Leaving the loop stops the stuck worker.
Either error, uncaught, ends the rank, and its peers then fail in their next collective (section "A rank
that dies"). Here every rank catches its own, prints it and goes on, so the run ends well.
"""

import argparse
import os
import signal
import time

from torch.utils.data import DataLoader, Dataset

import lessonlib


class Items(Dataset):
    """Items 0..n-1 as plain ints; item `stuck` sleeps `seconds` first (a read that hangs)."""

    def __init__(self, n, stuck=None, seconds=0.0):
        self.n, self.stuck, self.seconds = n, stuck, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.stuck:
            time.sleep(self.seconds)
        return i


def as_list(batch):
    return list(batch)  # no tensors: nothing in shared memory to fetch from a dead worker


# [start: killed]
def killed(rank, workers):
    loader = DataLoader(Items(64), batch_size=4, num_workers=workers, collate_fn=as_list)
    batches = iter(loader)
    next(batches)
    victim = batches._workers[0].pid  # a private attribute: the workers' processes
    try:
        os.kill(victim, signal.SIGKILL)  # what the out-of-memory killer sends
        for _ in batches:
            pass
    except RuntimeError as e:
        error = str(e).strip()
    else:
        raise AssertionError(f"rank {rank}: every batch arrived after worker {victim} was killed")
    finally:
        del batches  # shuts the other workers down now, not at exit
    said = (f"DataLoader worker (pid {victim}) is killed by signal: Killed.", f"(pid(s) {victim}) exited unexpectedly")
    assert any(s in error for s in said), f"rank {rank}: {error!r}"
    return error


# [end: killed]


# [start: hung]
def hung(rank, workers, timeout):
    loader = DataLoader(Items(16, stuck=5, seconds=timeout + 60), batch_size=4, num_workers=workers, timeout=timeout)
    start = time.monotonic()
    try:
        for _ in loader:
            pass
    except RuntimeError as e:
        error, waited = str(e), time.monotonic() - start
    else:
        raise AssertionError(f"rank {rank}: the stuck item arrived")
    assert error == f"DataLoader timed out after {timeout} seconds", f"rank {rank}: {error!r}"
    assert timeout <= waited < timeout + 30, f"rank {rank}: raised after {waited:.1f} s"
    return error, waited


# [end: hung]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--part", choices=["killed", "hung", "both"], default="both")
    parser.add_argument("--workers", type=int, default=2, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--timeout", type=int, default=2, choices=range(1, 61), metavar="1..60")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    if args.part in ("killed", "both"):
        error = killed(ctx.rank, args.workers)
        print(f"rank {ctx.rank}: a worker killed -> RuntimeError: {error}")
        lessonlib.report("killed", error)
    if args.part in ("hung", "both"):
        error, waited = hung(ctx.rank, args.workers, args.timeout)
        print(f"rank {ctx.rank}: an item that hangs, timeout={args.timeout} -> RuntimeError: {error} ({waited:.1f} s)")
        lessonlib.report("hung", {"error": error, "waited": waited})
    lessonlib.teardown()


if __name__ == "__main__":
    main()
