"""Ranks forked from the torchrun agent that `lessonlib.launch` starts, instead of a fresh `python` each.

torchrun starts every rank as a new process: `python -u -m lessonlib.launcher._rank_main SCRIPT ARGS`. Each
one then imports torch and, at its first optimizer, torch._dynamo, which the agent has already paid for; a
small lesson's run is mostly those imports. So in the agent (lessonlib.launcher._agent_main) the one step of
torchrun that starts a worker calls this module for that exact command
(lessonlib.launcher.torchpatches.fork_workers): it forks the agent, and the child becomes the rank a fresh
`python` would have been, then runs lessonlib.launcher._rank_main in-process. Everything else is torchrun's
own: its rendezvous, its environment for each rank, its watching, stopping, restarting and failure summary,
which see a child process with a pid.

What the child resets, so that a rank cannot tell the difference in what it computes or prints:

- a session of its own (torchrun's `start_new_session`), the environment torchrun gave the rank (in
  os.environ, so C++ code reading it sees it too), the agent's files torchrun asked for on fd 1 and 2;
- signal handlers as `exec` and Python's start leave them (torchrun's own handlers reset, ignored
  signals still ignored), faulthandler off as at start (torchrun's `@record` turned it on in the agent:
  left so, it would say it is on while the reset took its handlers away, and the rank wrapper's own
  `faulthandler.enable()` would then do nothing, so a rank that aborts would print no stack); the state
  of a fresh interpreter that has imported torch, saved in the agent before torchrun ran: warning
  filters, the root logger's handlers, sys.path;
- fresh random seeds (torch's and numpy's; Python's `random` reseeds at every fork), the intra-op
  thread count from OMP_NUM_THREADS as torch reads it at start, unbuffered stdout and stderr (`-u`);
- lessonlib's modules dropped, so the lesson imports what it uses, as a fresh process would;
- at the end, what the interpreter does at exit (non-daemon threads joined, atexit functions run,
  streams flushed), then the exit status, as a number or a signal. The agent's own atexit functions are
  inherited, among them torch._dynamo's, which the agent imported for its ranks: it runs only where
  something compiled (lessonlib.launcher.torchpatches.skip_empty_compile_times).

What differs, and is visible only from outside: the rank's command line (`ps`, `pgrep -f`) is the
agent's (or, for an agent forked from the agent server, lessonlib.launcher.fastpath.agentserver, the
server's); /proc/PID/environ shows the agent's variables, the run's mark among them (the launcher finds
the rank by it: lessonlib.processes.marks); and the string hash seed is the agent's (PYTHONHASHSEED).
One difference is printed, and only where torch._dynamo's INFO log is on: a forked rank that compiled
nothing does not log torch._dynamo's empty table of compile times at exit, as a fresh one that imported
torch._dynamo does. A machine with NVIDIA devices, or LESSONLIB_FRESH_RANKS=1 in the launch's
environment, gets torchrun's own fresh processes: a CUDA driver touched in the agent would not survive
a fork. The chapters' torchrun commands that readers type start fresh processes: this is `launch`'s
alone.

`become` is also how lessonlib.launcher.fastpath.agentserver turns a fork of itself into a torchrun agent.
It leans on three private CPython names, each for what the interpreter does on its own at start or exit:
`warnings._filters_mutated` (the filters' cache), `threading._shutdown` and `atexit._run_exitfuncs`.
"""

import atexit
import contextlib
import faulthandler
import gc
import io
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
import weakref

from lessonlib.launcher import torchpatches
from lessonlib.machine import nvidia_devices
from lessonlib.processes.bounded import poll_until

FRESH_VAR = "LESSONLIB_FRESH_RANKS"  # "1": every rank a fresh `python`, as torchrun alone starts them
RANK_MODULE = "lessonlib.launcher._rank_main"

_saved = None  # the fresh interpreter's state, saved by install()
_kept = []  # the agent's own stream objects, kept alive in a child so they never flush there


def wanted(environ=os.environ):
    """Fork ranks here? Not when asked for fresh ones, and not where a GPU could be in use."""
    if environ.get(FRESH_VAR) == "1":
        return False
    return hasattr(os, "fork") and not nvidia_devices()


def install():
    """In the agent, after `import torch` and before torchrun runs: save the fresh state, and have torchrun
    fork each rank (where the guard finds torch as this was written for: else fresh ranks, and a warning)."""
    global _saved
    import torch  # noqa: F401 - the state saved below is that of a fresh process with torch imported

    import_dynamo()  # the first optimizer of every training rank imports it (2 CPU-seconds): pay once, here
    # ...without its exit function in every rank, which tabulates compile times whether any compiled or not.
    torchpatches.skip_empty_compile_times()
    _saved = snapshot()
    torchpatches.fork_workers(RANK_MODULE, ForkedRank)
    torchpatches.keep_forks_cuda_free()  # a forked rank's first CUDA call must fail as a fresh one's does
    # Every object so far moves out of the collector's reach: a child's collections then never write to
    # (and so copy) the pages the agent's objects live on.
    gc.freeze()


def import_dynamo():
    """Import torch._dynamo, leaving no trace of it outside this process's modules.

    Importing it makes inductor's cache folder (torchinductor_USER) in the temporary folder and names it
    in os.environ; this takes both back (an empty folder it made, a variable it set), leaving them to the
    ranks whose code does that, as without this."""
    tmp, had_var = tempfile.gettempdir(), "TORCHINDUCTOR_CACHE_DIR" in os.environ
    before = set(os.listdir(tmp))
    import torch._dynamo  # noqa: F401

    if not had_var:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    for name in set(os.listdir(tmp)) - before:
        if name.startswith("torchinductor_"):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(tmp, name))  # only if empty


def snapshot():
    """What a fresh interpreter that has imported torch holds, and a child takes back (_fresh_state)."""
    return {
        "filters": list(warnings.filters),
        "root": (list(logging.root.handlers), logging.root.level),
        "path": list(sys.path),
        "finalizers": set(weakref.finalize._registry),
    }


class ForkedRank:
    """What torchrun uses of a worker's Popen (pid, poll, wait, returncode; it signals the worker's
    process group itself), for a rank forked from this agent."""

    def __init__(self, rank_args, env, stdout, stderr):
        for stream in (sys.stdout, sys.stderr):  # nothing of the agent's may be left to flush in the child
            with contextlib.suppress(Exception):
                stream.flush()
        with warnings.catch_warnings():  # Python 3.12+ warns of any fork in a process with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            fds = [None if target is None else target.fileno() for target in (stdout, stderr)]
            become(RANK_MODULE, rank_args, env, fds, _saved)  # never returns
        self.pid, self.returncode, self.args = pid, None, rank_args

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its status unknown (as Popen says, 0)
                pid, status = self.pid, 0
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        if timeout is None:
            if self.returncode is None:
                try:
                    status = os.waitpid(self.pid, 0)[1]
                except ChildProcessError:
                    status = 0
                self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        try:
            poll_until(lambda: self.poll() is not None, max(0, timeout), 0.01)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode


def become(module, args, env, fds, saved, cwd=None):
    """In a forked child: become what `python -u -m MODULE ARGS` would be in a session of its own, with
    environment `env`, stdout and stderr on `fds` (None: kept) and the fresh state `saved` (snapshot());
    run the module and exit with its status. `cwd`: change to it first, and make it sys.path[0] as -m does.
    Never returns."""
    code = 1
    try:
        os.setsid()
        for fd, target in zip((1, 2), fds):
            if target is not None:
                os.dup2(target, fd)
        if cwd is not None:
            os.chdir(cwd)
        _fresh_state(env, saved)
        if cwd is not None:
            sys.path[0] = os.getcwd()
        code = _run(module, args)
    except BaseException:  # noqa: BLE001 - a child that returned into the agent's code would run the agent
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(code)


def _fresh_state(env, saved):
    os.environ.clear()
    os.environ.update(env)
    # Signal handlers as `exec` leaves them, then as Python sets them at start: a handler the agent
    # installed (torchrun's, for TERM, INT, HUP and QUIT) is reset to the default, an ignored signal
    # stays ignored; then SIGINT, if at its default, raises KeyboardInterrupt, and SIGPIPE and SIGXFSZ
    # are ignored.
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)  # a parent's (the agent server's) wake-up pipe is not the child's
    # faulthandler as a fresh interpreter starts: off, its handlers out, unless PYTHONFAULTHANDLER (below).
    faulthandler.disable()
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if signal.getsignal(sig) != signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    warnings.filters[:] = saved["filters"]
    warnings._filters_mutated()
    handlers, level = saved["root"]
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)
    sys.path[:] = saved["path"]
    for key in set(weakref.finalize._registry) - saved["finalizers"]:  # the agent's, not the rank's
        weakref.finalize._registry.pop(key, None)
    # `python -u`: stdout and stderr unbuffered on fds 1 and 2. The agent's stream objects are kept, not
    # closed: closing or collecting them would write whatever they hold into the rank's files.
    _kept.extend([sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__])
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), "utf-8", write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), "utf-8", "backslashreplace", write_through=True
    )
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(all_threads=True)  # as `python` does at start, onto the rank's own stderr
    import multiprocessing

    import torch

    multiprocessing.set_start_method(None, force=True)
    torch.seed()  # a fresh process draws torch's seed at start
    if "numpy.random" in sys.modules:  # and numpy's at its first import
        sys.modules["numpy.random"].seed()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch reads it once, at start
    for name in [m for m in sys.modules if m == "lessonlib" or m.startswith("lessonlib.")]:
        del sys.modules[name]


def _run(module, args):
    """`module` as `python -u -m MODULE ARGS` runs it; returns the exit status."""
    import runpy

    sys.argv = ["-m", *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - as the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    sys.last_type = sys.last_value = sys.last_traceback = None
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)  # SystemExit("text"): printed, status 1
        code = 1
    # What the interpreter does on its way out: wait for non-daemon threads, run atexit functions, flush.
    with contextlib.suppress(BaseException):
        threading._shutdown()
    atexit._run_exitfuncs()
    gc.collect()  # the script's objects, files among them, closed as the interpreter's teardown would
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code & 0xFF
