"""Rank processes for the lesson tests, forked from a server that has already imported torch.

A lesson test at world size N starts N real processes that meet through real gloo, each entering
through lessonlib._rank_main exactly as a rank of `lessonlib.launch` does (its output files, its start
and exit records, its stack dump on SIGUSR1 or SIGTERM), with the environment torchrun and the
launcher give a rank; the test then reads the run folder with the launcher's own
`lessonlib.result.read_result`, so a failure reads as it does in the book. What this module saves is
the imports in each of them: torch (about 2 CPU-seconds), torch._dynamo (1.5 more, pulled in by the
first optimizer any training lesson builds), torchmetrics, torchvision: third-party packages only,
never lessonlib, whose modules each rank imports as the lesson asks (a fresh start). The lesson tests
start some 450 ranks: measured on the 2-core build machine, the lesson tests took 1438 CPU-seconds
with an import per rank and 333 with the imports preloaded.

How: one multiprocessing fork server per test worker imports torch once (with OMP_NUM_THREADS=1
already set, as torchrun sets it, since OpenMP reads it when torch loads). Each rank is then a fork
of that server which starts a session of its own, takes the exact environment the test gives it,
draws fresh random seeds (as a new process would), and runs `python -m lessonlib._rank_main SCRIPT`
in-process. What differs from a launch is only the torchrun agent, which is not there: the test
hosts the rendezvous store and watches the ranks itself. Chapter 1's lessons (about torchrun itself),
the book, the docstring commands and the launcher tests still go through real torchrun, and world
size 1 is a fresh `python lessons/X.py`.
"""

import multiprocessing
import os
import runpy
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PRELOAD = "rankfork_preload"  # what the fork server imports once, before it forks any rank

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
            raise RuntimeError(
                f"the rank fork server did not import {PRELOAD} (probe exit code {probe.exitcode}); "
                f"every rank would import torch itself"
            )
        _context = ctx
    return _context


def _preloaded():
    """In a forked process: exit 0 if the server imported the preload module (and torch with it)."""
    sys.exit(0 if PRELOAD in sys.modules and "torch" in sys.modules else 3)


def _run_rank(script, args, cwd, env):
    """In the forked rank: a session of its own, env exactly as given, then lessonlib._rank_main."""
    os.setsid()  # so the test can kill the rank with every process it started (DataLoader workers)
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
    # As `python -m lessonlib._rank_main SCRIPT ARGS` sets it: the current directory first, then
    # PYTHONPATH; not the test folder (the server's PYTHONPATH, so that it could import PRELOAD).
    # _rank_main then puts the script's folder first, as `python SCRIPT` would.
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra] + [p for p in sys.path if p not in (cwd, HERE, "", *extra)]
    sys.argv = [os.path.join(cwd, "lessonlib", "_rank_main.py"), script, *args]
    runpy.run_module("lessonlib._rank_main", run_name="__main__", alter_sys=True)


def start_rank(script, args, cwd, env):
    """Start one rank; returns the multiprocessing.Process (its .pid leads a session of its own)."""
    proc = context().Process(
        target=_run_rank,
        args=(str(script), [str(a) for a in args], str(cwd), dict(env)),
        name=f"rank {env.get('RANK')}",
    )
    proc.start()
    return proc


def kill_rank(proc):
    """Kill the rank's whole session (a hung rank has been asked for its stack before this)."""
    if proc.exitcode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.join()
