"""Shared fixtures: after every test, prove that no process of a launch outlived it.

`lessonlib.launch` promises that no process of a run survives the run, whatever the outcome (ok,
failure, timeout, interrupt). Workers and their children live in sessions of their own and are
reparented to init when their parent dies, so "children of this test process" would miss exactly
the processes that leak. Instead, every process this test session starts inherits SESSION_VAR in its
environment, and a process is ours if it carries that value (or is still our descendant).

Tests marked `unit` (the tier `make unit` runs alone) may start no process at all: an audit hook notes
any, and such a test fails.
"""

import contextlib
import os
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from lessonlib import ROOT
from lessonlib.processes.bounded import poll_until
from lessonlib.processes.marks import kill_all, marked_processes, marks_of

HELPERS = ROOT / "tests" / "helpers"  # the scripts tests launch as ranks, each with a docstring


def line_of(script, text):
    """The number of the one line of `script` that contains `text` (a marker comment, or code)."""
    hits = [i for i, line in enumerate(Path(script).read_text().splitlines(), 1) if text in line]
    assert len(hits) == 1, f"expected one line of {script} with {text!r}, found {hits}"
    return hits[0]


# The tests' own mark, apart from lessonlib's (lessonlib.processes.marks), which it is here to check: a
# process is this session's whether or not a launch or a bounded command marked it.
SESSION_VAR = "COURSE_TESTS_SESSION"  # not LESSONLIB_*: that prefix is lessonlib's own
# Set at import, before any test spawns, and always anew: under pytest-xdist each worker process gets
# an id of its own, so one worker never mistakes another worker's running launch for a leak.
SESSION_ID = uuid.uuid4().hex
os.environ[SESSION_VAR] = SESSION_ID
LAUNCH_MARKS = ("torch.distributed.run", "torch.distributed.launch", "lessonlib.launcher._rank_main")
LEAK_GRACE = 2.0  # seconds a process that was just killed gets to finish dying before it counts as leaked


def _is_ours(proc, me):
    try:
        if proc.environ().get(SESSION_VAR) == SESSION_ID:
            return True
        return any(p.pid == me for p in proc.parents())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return False


def _looks_like_launch(proc):
    try:
        environ = proc.environ()
        if marks_of(environ):  # a launch's, or a run_bounded command's
            return True
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return False
    return any(mark in cmdline for mark in LAUNCH_MARKS)


def stray_processes(match=_looks_like_launch):
    """Live (non-zombie) processes started by this test session that `match` accepts."""
    me, found = os.getpid(), []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if match(proc) and _is_ours(proc, me):
            found.append(proc)
    return found


def _describe(proc):
    try:
        return f"pid {proc.pid} (ppid {proc.ppid()}): {' '.join(proc.cmdline())[:200]}"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return f"pid {proc.pid} (gone while being described)"


# Shared with the launcher: every test finds and kills processes by a marker the same way it does.
def processes_with_env(var, value):
    """Live processes (not this one) whose environment has `var` set to `value` (or to a list holding it)."""
    return marked_processes(value, var=var)


kill_processes = kill_all


def ended_by(bound, seconds):
    """Whether something that its own `bound` (a timeout the test configured) ended took `seconds` as such a
    thing does: not less than the bound, and less than twice it. The upper limit is a hang guard made of the
    bound itself, not a speed: what follows a bound (stacks printed, processes killed) takes seconds, and a
    busy machine makes that slower but not a bound's worth."""
    return bound <= seconds < 2 * bound


def still_found(scan, seconds, interval=0.1):
    """What `scan()` (a list: processes, files, namespaces that are going) still finds once it finds nothing
    or `seconds` have passed, looking every `interval` seconds: the caller asserts it empty, naming what is left."""
    found = []

    def gone():
        found[:] = scan()
        return not found

    with contextlib.suppress(TimeoutError):
        poll_until(gone, seconds, interval)
    return found


def leaked_processes(match=_looks_like_launch, grace=LEAK_GRACE):
    """stray_processes(match) that are still alive after `grace` seconds."""
    return still_found(lambda: stray_processes(match), grace)


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail the test if any process of a launch it started is still alive after it."""
    yield
    leaked = leaked_processes()
    if leaked:
        text = "\n".join(_describe(p) for p in leaked)
        kill_processes(leaked)  # so the tests after this one start clean
        pytest.fail(f"{len(leaked)} process(es) of a launch outlived the test (now killed):\n{text}", pytrace=False)


# The unit tier (tests marked `unit`, run alone by `make unit`) starts no process. An audit hook notes
# every process started during such a test (subprocess, fork, exec, spawn, system) and the test fails
# after it, naming them. It only notes: raising inside the code that starts one could leave a module
# half imported for every later test of the worker. One start is not the test's: ctypes.util runs
# `ldconfig -p` to find a shared library, as when torch is first imported.
PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system"}
_started_in_unit_test = None  # a list while a unit test runs


def _note_processes_in_unit_tests(event, args):
    if _started_in_unit_test is None or event not in PROCESS_EVENTS:
        return
    if event == "subprocess.Popen" and os.path.basename(str(args[0])) == "ldconfig":
        return
    _started_in_unit_test.append((event, str(args)[:200]))


sys.addaudithook(_note_processes_in_unit_tests)


@pytest.fixture(autouse=True)
def processes_started(request):
    """In a test marked unit: the list of processes it started, which must be empty at its end."""
    global _started_in_unit_test
    if request.node.get_closest_marker("unit") is None:
        yield None
        return
    _started_in_unit_test = started = []
    try:
        yield started
    finally:
        _started_in_unit_test = None
    if started:
        pytest.fail(f"a test marked unit started {len(started)} process(es): {started}; unit tests start none")


@pytest.fixture
def leak_scan():
    """The scan the autouse fixture runs, for tests that check it (and the launcher) directly."""
    return stray_processes


@pytest.fixture(scope="session")
def built_book(tmp_path_factory):
    """Every chapter executed and the HTML book built, once per session (tests/test_book.py,
    `execute_and_build`): the book test reports the outcome, the browser tests open the pages."""
    from test_book import execute_and_build  # tests/ is on sys.path, as for rankfork

    return execute_and_build(tmp_path_factory.mktemp("book"))


@pytest.fixture
def use_tmpdir(monkeypatch):
    """Point this process's TMPDIR (and so every launch's) at a folder: `use_tmpdir(folder)`."""

    def use(folder):
        monkeypatch.setenv("TMPDIR", str(folder))
        monkeypatch.setattr(tempfile, "tempdir", None)  # Python reads TMPDIR again

    return use
