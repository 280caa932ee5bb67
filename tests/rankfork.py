"""Rank processes for the lesson tests, forked from a server that has already imported torch.

A lesson test at world size N starts N real processes that meet through real gloo, each running the
lesson file as `python lessons/X.py` would, with the environment torchrun gives a rank. What this
module saves is the imports in each of them: torch (about 2 CPU-seconds), torch._dynamo (1.5 more,
pulled in by the first optimizer any training lesson builds), torchmetrics, torchvision: third-party
packages only, never lessonlib, whose modules each rank imports as the lesson asks (a fresh start).
The lesson tests start some 450 ranks: measured on the 2-core build machine, the lesson tests took
1438 CPU-seconds with an import per rank and 333 with the imports preloaded.

How: one multiprocessing fork server per test worker imports torch once (with OMP_NUM_THREADS=1
already set, as torchrun sets it, since OpenMP reads it when torch loads). Each rank is then a fork
of that server which starts a session of its own, points fds 1 and 2 at its log file, takes the
exact environment the test gives it, draws fresh random seeds (as a new process would), and runs the
lesson with runpy as `__main__`. Nothing else differs from a plain start: the lesson,
torch.distributed and gloo run unchanged. Chapter 1's lessons
(about torchrun itself), the book and the launcher tests still go through real torchrun.
"""

import faulthandler
import multiprocessing
import os
import runpy
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PRELOAD = "rankfork_preload"  # what the fork server imports once, before it forks any rank
STACK_GRACE = 2.0  # seconds a rank that is still running at the deadline gets to print its stack

_context = None


def context():
    """The fork-server context, started on first use (one server per test process), its preload checked."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([PRELOAD])
        # The server is a fresh interpreter. Python 3.11's forkserver ignores the parent's sys.path
        # and swallows an ImportError of a preload module, which would silently leave every rank to
        # import torch itself: so the server gets this folder on PYTHONPATH, and a probe checks.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, saved]))
        try:
            probe = ctx.Process(target=_preloaded, name="preload probe")
            probe.start()
            probe.join(120)
            if probe.exitcode is None:  # not done in 120 s: it must not outlive the check
                probe.kill()
                probe.join()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        if probe.exitcode != 0:
            raise RuntimeError(f"the rank fork server did not import {PRELOAD} (probe exit code {probe.exitcode}); "
                               f"every rank would import torch itself")
        _context = ctx
    return _context


def _preloaded():
    """In a forked process: exit 0 if the server imported the preload module (and torch with it)."""
    sys.exit(0 if PRELOAD in sys.modules and "torch" in sys.modules else 3)


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
    # A fresh process draws its random seeds as it starts (torch's, numpy's, Python's: the last is
    # redrawn after any fork already); a fork would share the server's, and "unseeded" ranks would
    # all start from the same seed (chapter 4 shows that they do not). So each rank draws anew.
    import numpy
    import torch

    torch.seed()
    numpy.random.seed()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script]
    # As `python SCRIPT` sets it: the script's folder first, and neither the test folder (the
    # server's PYTHONPATH, so that it could import PRELOAD) nor the current directory.
    folder = os.path.dirname(os.path.abspath(script))
    sys.path[:] = [folder] + [p for p in sys.path if p not in (folder, HERE, "")]
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
