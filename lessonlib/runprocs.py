"""Find every process of a run, ask the hung ranks where they are, and kill them all (chapter 1).

Every process of a launch carries the run's marker in its environment (lessonlib._runfolder.RUN_ID_VAR).
torchrun puts its workers in sessions of their own, and a rank's children (DataLoader workers) may
outlive their parent, so neither a process tree nor a session finds them all: the marker does.
"""

import os
import signal
import time

import psutil

from . import _runfolder as runfolder

STACK_DUMP_GRACE = 2.0  # seconds a hung rank gets to print its stack before it is killed


def run_processes(run_id):
    """Every live process whose environment carries this run's marker (children of children too)."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(runfolder.RUN_ID_VAR) == run_id:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return found


def kill_all(procs):
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


class RankWatch:
    """Notes when each rank's process disappears: the end time of a rank that left no exit record."""

    def __init__(self, run_dir, world):
        self.run_dir, self.world = run_dir, world
        self.procs, self.ended = {}, {}

    def poll(self):
        now = time.time()
        for rank in range(self.world):
            if rank in self.ended:
                continue
            if rank not in self.procs:
                start = runfolder.read_start(self.run_dir, rank)
                if start is None:
                    continue
                try:
                    self.procs[rank] = psutil.Process(start["pid"])
                except psutil.NoSuchProcess:
                    self.ended[rank] = now
                    continue
            p = self.procs[rank]
            try:
                gone = p.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                self.ended[rank] = now

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
    end = time.monotonic() + STACK_DUMP_GRACE
    sizes = None
    while signalled and time.monotonic() < end:
        time.sleep(0.1)
        now = [os.path.getsize(p) if os.path.exists(p) else 0 for p in signalled]
        if now == sizes:
            break
        sizes = now
    kill_all(run_processes(run_id))
