"""Rank processes for the lesson tests, forked from a server that has already imported torch.

A lesson test at world size N starts N real processes that meet through real gloo, each running the
lesson file as `python lessons/X.py` would, with the environment torchrun gives a rank. What this
module saves is the `import torch` in each of them: about 2 CPU-seconds per process, and the lesson
tests start some 250 of them, which on CI's 2 cores is minutes of the 20 the whole run may take.

How: one multiprocessing fork server per test worker imports torch once (with OMP_NUM_THREADS=1
already set, as torchrun sets it, since OpenMP reads it when torch loads). Each rank is then a fork
of that server which starts a session of its own, points fds 1 and 2 at its log file, takes the
exact environment the test gives it, and runs the lesson with runpy as `__main__`. Nothing else
differs from a plain start: the lesson, torch.distributed and gloo run unchanged. Chapter 1's lessons
(about torchrun itself), the book and the launcher tests still go through real torchrun.
"""

import faulthandler
import multiprocessing
import os
import runpy
import signal
import sys

PRELOAD = "rankfork_preload"  # what the fork server imports once, before it forks any rank
STACK_GRACE = 2.0  # seconds a rank that is still running at the deadline gets to print its stack

_context = None


def context():
    """The fork-server context, started on first use (one server per test process)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([PRELOAD])
    return _context


def _run_rank(script, cwd, env, log_path):
    """In the forked rank: a session of its own, output to log_path, env exactly as given, then the lesson."""
    os.setsid()  # so the test can kill the rank with every process it started (DataLoader workers)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, as `python -u` near enough
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable()  # a crash prints its stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # so does a hang, when the test asks
    # A process forked from the server inherits "forkserver" as its start method; a fresh `python`
    # has the platform's default (DataLoader workers pickle nothing under fork, everything otherwise).
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")  # an exception prints its traceback and exits 1


def start_rank(script, cwd, env, log_path):
    """Start one rank; returns the multiprocessing.Process (its .pid leads a session of its own)."""
    proc = context().Process(target=_run_rank, args=(str(script), str(cwd), dict(env), str(log_path)),
                             name=f"rank {env.get('RANK')}")
    proc.start()
    return proc


def kill_rank(proc, dump_stack=False):
    """Kill the rank's whole session (SIGUSR1 first when asked, so a hung rank says where it is)."""
    if proc.exitcode is not None:
        return
    try:
        if dump_stack:
            os.kill(proc.pid, signal.SIGUSR1)
            proc.join(STACK_GRACE)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.join()
