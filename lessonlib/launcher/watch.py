"""Watching a launch's ranks while they run, and ending the run: which rank's process is gone and when, each
hung rank's stack asked for, then every process of the run killed by its mark (chapter 1).

The run's id is its mark (lessonlib.processes.marks): every process of the run carries it, the agents,
the ranks and whatever they started in sessions of their own.
"""

import contextlib
import os
import signal
import time

import psutil

from ..processes.bounded import poll_until
from ..processes.marks import kill_all, marked_processes
from . import runfolder

STACK_DUMP_GRACE = 2.0  # seconds a hung rank gets to print its stack before it is killed


def run_processes(run_id):
    """Every live process of the run `run_id` (children of children too), this one aside."""
    return marked_processes(run_id)


class RankWatch:
    """Notes when each rank's process disappears: the end time of a rank that left no exit record.

    A rank that torchrun starts again (launch(max_restarts=...), chapter 12) writes a new start record
    with a new pid: the watch then follows the new process, and its end is the last attempt's.
    """

    def __init__(self, run_dir, world):
        self.run_dir, self.world = run_dir, world
        self.procs, self.ended, self.pids = {}, {}, {}

    def poll(self):
        now = time.time()
        for rank in range(self.world):
            if rank in self.ended and not self._restarted(rank):
                continue
            if rank not in self.pids:
                start = runfolder.read_start(self.run_dir, rank)
                if start is None:
                    continue
                self.pids[rank] = start["pid"]
                try:
                    self.procs[rank] = psutil.Process(start["pid"])
                except psutil.NoSuchProcess:
                    self.ended[rank] = now
                    continue
            try:
                gone = self.procs[rank].status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                self.ended[rank] = now

    def _restarted(self, rank):
        """True, and the rank watched afresh, when its start record names a process other than the one
        that ended (torchrun started it again)."""
        start = runfolder.read_start(self.run_dir, rank)
        if start is None or start["pid"] == self.pids.get(rank):
            return False
        self.procs.pop(rank, None)
        del self.pids[rank], self.ended[rank]
        return True

    def running(self):
        """Ranks whose process has started and not yet ended."""
        self.poll()
        return [rank for rank in self.procs if rank not in self.ended]


def dump_stacks_then_kill(run_id, watch):
    """Ask every rank still running for its Python stack, give it a moment to print, then kill all."""
    signalled = []
    for rank in watch.running():
        try:
            watch.procs[rank].send_signal(signal.SIGUSR1)  # psutil refuses if the pid was reused
            signalled.append(runfolder.output_file(watch.run_dir, rank, "stderr"))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    # faulthandler writes from its signal handler at once; wait until the stderr files stop growing.
    sizes = []  # at each look, 0.1 s apart; the first, at the signal itself, says nothing yet

    def stopped_growing():
        sizes.append([os.path.getsize(p) if os.path.exists(p) else 0 for p in signalled])
        return len(sizes) > 2 and sizes[-1] == sizes[-2]

    if signalled:
        with contextlib.suppress(TimeoutError):  # then they are killed as they are
            poll_until(stopped_growing, STACK_DUMP_GRACE, 0.1)
    kill_all(run_processes(run_id))
