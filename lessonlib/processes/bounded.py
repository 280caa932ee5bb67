"""Run any command bounded, and leave nothing of it behind (the tests, the book's executor, chapters 11 and 12).

`run_bounded` runs a command (a script that spawns its own ranks, a book build, a notebook run) in a
session of its own with a mark (lessonlib.processes.marks), for at most `timeout` seconds, and whatever way
it ends, every process carrying the mark is killed. `started` does the same for a command that runs in
the background while a cell inspects it. `sigterm_cleans_up` makes a SIGTERM to this process run that
cleanup first. `poll_until` is the one bounded wait for something to become true: lessonlib and the
tests wait with it, not with deadline loops of their own.
"""

import contextlib
import math
import numbers
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

from .marks import add_mark, kill_marked, new_mark


def poll_until(check, timeout, interval=0.1, what=None):
    """Call `check()` every `interval` seconds until it returns something true, and return that value.

    TimeoutError naming `what` and `timeout` if `timeout` seconds pass first. `what` says what was awaited
    ("rank 1 to be ready"): a string, or a callable that returns one, called then (so it can say what
    it saw last); by default the check's name. `check` runs at once, then every `interval` seconds, and
    once more at the end of the time (a sleep never runs past it). An exception from `check` ends the
    wait: a check raises to say that waiting longer is in vain (the process it waits on has exited).
    """
    if not _seconds(timeout) or timeout < 0:
        raise ValueError(f"poll_until: timeout must be a finite number of seconds >= 0, not {timeout!r}")
    if not _seconds(interval) or interval <= 0:
        raise ValueError(f"poll_until: interval must be a finite number of seconds > 0, not {interval!r}")
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            said = what() if callable(what) else what
            said = said or f"{getattr(check, '__qualname__', check)}() to return something true"
            raise TimeoutError(f"waited {timeout:g} s in vain for {said}")
        time.sleep(min(interval, left))


def _seconds(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class Finished:
    """How a run_bounded command ended. `stderr` is None when it was merged into `stdout`."""

    argv: list
    returncode: int
    stdout: str
    stderr: str | None
    seconds: float
    timed_out: bool

    @property
    def output(self):
        return self.stdout if self.stderr is None else self.stdout + self.stderr


def run_bounded(argv, timeout, *, cwd=None, env=None, merge_output=True, input=None, record=False):
    """Run `argv` in a session of its own for at most `timeout` seconds, then kill every process it
    started, whether it finished, timed out or was interrupted (Ctrl-C is re-raised after the kill).

    `env`: the whole environment (default: this process's). `input`: text written to its standard
    input, which is then closed (chapter 12 types into pdb this way); without it, the command gets no
    standard input. Output is captured as text; with merge_output, stderr goes into stdout. The
    command has ended when its own process exits, even if something it left behind still holds its
    output open (output goes to files, not pipes, for that). `record`: while the book build executes a
    chapter, note the command and how it ended in the build's record (lessonlib.book.launchrecord:
    chapter 11's commands stand for the tests' runs of the same commands); elsewhere it does nothing.
    Never raises on failure or timeout: read the Finished.
    """
    given_env, (env, mark) = env, marked_environment(env)
    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [str(a) for a in argv],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT if merge_output else err,
            start_new_session=True,
        )
        if input is not None:  # from a thread: a command that does not read must not block this one
            threading.Thread(target=_write_and_close, args=(proc.stdin, input), daemon=True).start()
        timed_out = False
        with sigterm_cleans_up():  # a SIGTERM to this process still kills the command first
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                kill_session(proc, mark)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
    finished = Finished(
        argv=[str(a) for a in argv],
        returncode=proc.returncode,
        stdout=texts[0],
        stderr=None if merge_output else texts[1],
        seconds=time.monotonic() - started,
        timed_out=timed_out,
    )
    if record:
        from ..book.launchrecord import record_command

        record_command(argv, cwd, given_env, finished)
    return finished


def _write_and_close(pipe, text):
    with contextlib.suppress(OSError):  # BrokenPipeError: the command ended without reading it all
        pipe.write(text.encode())
        pipe.close()


class Terminated(BaseException):
    """Raised by sigterm_cleans_up's handler: unwinds the stack so that `finally` blocks run."""


@contextlib.contextmanager
def sigterm_cleans_up():
    """While inside, SIGTERM unwinds this process's stack (every `finally` runs, killing what it
    started), then ends the process as SIGTERM would have. Without it, SIGTERM ends Python at once
    and the commands it started in sessions of their own (a book build, a notebook's kernel) live on.
    Only in the main thread (Python runs signal handlers there), and only where SIGTERM has no
    handler of its own yet; elsewhere it changes nothing."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield
        return

    def handler(signum, frame):
        raise Terminated

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # now with the default action: the process ends here
        raise  # not reached
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def marked_environment(env=None):
    """(env with a new run_bounded mark added, the mark): for a command started some other way
    (with start_new_session=True) that kill_session(proc, mark) must end with all it started."""
    mark = new_mark()
    return add_mark(dict(os.environ if env is None else env), mark), mark


def kill_session(proc, mark=None):
    """Kill a process started with start_new_session=True, its whole session, and (given the `mark`
    of run_bounded) every process that carries the mark wherever it went (sessions of their own)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()  # reaped here, before the scan: psutil would reap it otherwise, and its exit code be lost
    if mark is not None:
        kill_marked(mark)


class Started:
    """A command running in the background under `started`: its process, and its output so far."""

    def __init__(self, proc, out_path):
        self.proc, self._out_path = proc, out_path

    def output(self):
        """Everything it has written so far (stdout and stderr together), as text."""
        with open(self._out_path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")

    def poll_until(self, check, timeout=60):
        """Call `check()` every 0.1 s until it returns something true, and return that; TimeoutError (with
        the output so far) if `timeout` seconds pass or the command ends first."""

        def found_or_ended():
            found = check()
            if not found and self.proc.poll() is not None:
                raise TimeoutError(f"{check} was never true: it exited {self.proc.returncode}; {self._so_far()}")
            return found

        return poll_until(found_or_ended, timeout, 0.1, lambda: f"{check} to be true; {self._so_far()}")

    def _so_far(self):
        return f"its output so far:\n{self.output()[-3000:]}"


@contextlib.contextmanager
def started(argv, timeout, *, cwd=None, env=None):
    """Run `argv` in the background while the with-block works with it (chapter 12: a job to inspect
    while it hangs); on leaving the block, or after `timeout` seconds, whichever comes first, every
    process it started is killed (run_bounded's rule). Yields a Started."""
    env, mark = marked_environment(env)
    with tempfile.NamedTemporaryFile(prefix="lessonlib-started-") as out:
        proc = subprocess.Popen(
            [str(a) for a in argv],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timer = threading.Timer(timeout, lambda: kill_session(proc, mark))
        timer.daemon = True
        timer.start()
        try:
            yield Started(proc, out.name)
        finally:
            timer.cancel()
            kill_session(proc, mark)
