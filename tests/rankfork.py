"""Rank processes for the lesson tests, forked from a server that has already imported torch.

A lesson test at world size N starts N real processes that meet through real gloo, each entering
through lessonlib.launcher._rank_main exactly as a rank of `lessonlib.launch` does (its output files, its start
and exit records, its stack dump on SIGUSR1 or SIGTERM), with the environment torchrun and the
launcher give a rank; the test then reads the run folder with the launcher's own
`lessonlib.launcher.result.read_result`, so a failure reads as it does in the book. What this module saves is
the imports in each of them: torch, torch._dynamo (pulled in by the first optimizer any training
lesson builds), torchmetrics, torchvision: third-party packages only, never lessonlib, whose modules
each rank imports as the lesson asks (a fresh start). The lesson tests start some hundreds of ranks,
and for a small lesson those imports are most of a rank's CPU time.

How: one multiprocessing fork server per test worker imports torch once (with OMP_NUM_THREADS=1
already set, as torchrun sets it, since OpenMP reads it when torch loads). Each rank is then a fork
of that server which starts a session of its own, takes the exact environment the test gives it,
draws fresh random seeds (as a new process would), and runs `python -m lessonlib.launcher._rank_main SCRIPT`
in-process. What differs from a launch is only the torchrun agent, which is not there: the test
hosts the rendezvous store and watches the ranks itself (`run_ranks`, which the lesson and exercise
tests call; with plain=True it is `python lessons/X.py`: one rank, none of torchrun's variables).
Chapter 1's lessons (about torchrun itself), the book, the docstring commands and the launcher tests
still go through real torchrun.
"""

import multiprocessing
import os
import runpy
import signal
import sys
import time
import uuid

import pytest

import lessonlib
from lessonlib import ROOT
from lessonlib.launcher.core import _environment as launch_environment
from lessonlib.launcher.request import TORCHRUN_ENV, check_launch
from lessonlib.launcher.result import Ending, read_result
from lessonlib.launcher.watch import RankWatch, dump_stacks_then_kill
from lessonlib.processes.bounded import poll_until, run_bounded

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 180  # seconds per run: a 2-core machine under load
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
    """In the forked rank: a session of its own, env exactly as given, then lessonlib.launcher._rank_main."""
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
    # As `python -m lessonlib.launcher._rank_main SCRIPT ARGS` sets it: the current directory first, then
    # PYTHONPATH; not the test folder (the server's PYTHONPATH, so that it could import PRELOAD).
    # _rank_main then puts the script's folder first, as `python SCRIPT` would.
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra] + [p for p in sys.path if p not in (cwd, HERE, "", *extra)]
    sys.argv = [os.path.join(cwd, "lessonlib", "launcher", "_rank_main.py"), script, *args]
    runpy.run_module("lessonlib.launcher._rank_main", run_name="__main__", alter_sys=True)


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


FAILURE_GRACE = 5.0  # seconds the other ranks get after one failed, as torchrun's agent gives them


def run_ranks(lesson, world_size, tmp_path, args=(), timeout=TIMEOUT, plain=False):
    """The lesson at `world_size` ranks, each entering through lessonlib.launcher._rank_main with the environment
    lessonlib.launch gives it, bounded; returns the RunResult, read from the run folder by the
    launcher's own code (lessonlib.launcher.result.read_result), so a failure reads as it would in the book.
    `plain=True` (world size 1 only) is `python lessons/X.py`: none of torchrun's variables and no store,
    so lessonlib.setup makes a group of one as it does for a reader's plain run.

    The ranks are forked from a server that has imported torch already (start_rank below), and the
    test stands in for torchrun's agent: it hosts the rendezvous store and watches the ranks. When a
    rank fails, the others get FAILURE_GRACE seconds; ranks still running then (waiting in a collective
    for a partner that died) or at the deadline print their Python stacks and are killed, by the
    launcher's own `dump_stacks_then_kill`.
    """
    import torch.distributed as dist  # here, not at the top: only this path needs torch in the test process

    spec = check_launch(
        lesson,
        world_size,
        list(args),
        timeout,
        None,
        nnodes=1,
        backend=None,
        launcher="torchrun",
        rendezvous="c10d",
        cwd=ROOT,
    )
    if plain and world_size != 1:
        raise ValueError(f"plain=True is `python lessons/X.py`, one process; got world_size={world_size}")
    run_id, run_dir = uuid.uuid4().hex, tmp_path / "run"
    run_dir.mkdir(parents=True)
    watch = RankWatch(str(run_dir), world_size)
    procs, timed_out, t0 = [], False, time.monotonic()
    with lessonlib.reserve_port() as port:
        # The test process hosts the rendezvous store, as torchrun's agent does: the ranks connect at once
        # instead of retrying, with growing pauses, until rank 0 has opened one. A plain run has none.
        store = None if plain else dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
        base = {
            **launch_environment(spec, run_id, str(run_dir)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "OMP_NUM_THREADS": "1",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
        if plain:
            # (torch in the fork server was loaded with torchrun's OMP_NUM_THREADS=1, so a plain run here
            # has one intra-op thread where a reader's may have more: the same code, at another speed.)
            drop = (*TORCHRUN_ENV, "OMP_NUM_THREADS")
            base = {k: v for k, v in base.items() if k not in drop and not k.startswith("TORCHELASTIC_")}
        try:
            for rank in range(world_size):
                env = {**base} if plain else {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                procs.append(start_rank(spec.script, spec.args, ROOT, env))
            failed_at = []  # when a rank first failed

            def settled():  # every rank has ended, or FAILURE_GRACE has passed since one failed
                watch.poll()
                if all(p.exitcode is not None for p in procs):
                    return True
                if not failed_at and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at.append(time.monotonic())
                return bool(failed_at) and time.monotonic() > failed_at[0] + FAILURE_GRACE

            try:
                poll_until(settled, max(0.0, t0 + timeout - time.monotonic()), 0.05)
            except TimeoutError:
                timed_out = True
        finally:
            watch.poll()
            dump_stacks_then_kill(run_id, watch)
            for p in procs:
                kill_rank(p)
            watch.poll()
            del store
    codes = [p.exitcode for p in procs]
    # What torchrun's agent would return, and what it would say of a rank that left no exit record.
    ending = Ending(
        returncodes=[0 if all(c == 0 for c in codes) else 1],
        agent_pids=[],
        wall_time=time.monotonic() - t0,
        timed_out=timed_out,
        interrupted=False,
        gone_at=watch.ended,
        leftovers=[],
        exitcodes=dict(enumerate(codes)),
    )
    return read_result(spec, str(run_dir), ending)


def run_plain(script, args=(), timeout=TIMEOUT):
    """`python SCRIPT [args]` as a reader's shell runs it, a fresh interpreter with none of torchrun's
    variables (so lessonlib.setup makes a group of one), from the repository root: bounded, every
    process it started killed after. Returns (exit code, stdout and stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    done = run_bounded([sys.executable, script, *map(str, args)], timeout, cwd=ROOT, env=env)
    if done.timed_out:
        pytest.fail(f"python {script} {' '.join(map(str, args))} did not finish in {timeout} s:\n{done.output[-3000:]}")
    return done.returncode, done.output
