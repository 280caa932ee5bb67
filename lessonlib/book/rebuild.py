"""A Sphinx extension for the book: rebuilds that redo only what changed, and never show stale output.

The book executes its chapters with MyST-NB's cache mode (`execute_notebooks: cache`): a chapter's
outputs are kept in jupyter-cache (`_build/.jupyter_cache`) under a hash of its code cells, so an
edit to prose alone re-executes nothing. What that hash cannot see is the code a chapter runs
outside itself: the lessons it shows with `lessonlib.show_code("lessons/X.py", ...)` or launches with
`lessonlib.launch("lessons/X.py", ...)` and friends, and lessonlib's own modules. This extension
closes that gap, in two steps:

- `source-read`: each notebook's dependencies (every lesson file its code cells name, and lessonlib's
  modules when it uses lessonlib) are noted with Sphinx, so editing one makes Sphinx read the
  chapter again.
- `env-before-read-docs`: before Sphinx reads anything, every notebook it is about to read whose
  cached outputs are missing, or were made from other contents of those dependencies (a key stored
  with the cache record), is executed here, several at a time (BOOK_JOBS, default 2 to 4 by CPU
  count), each in a process of its own with the same function and settings as MyST-NB's
  (lessonlib.book._execute_notebook), each bounded (BOOK_CHAPTER_TIMEOUT seconds, default 2400), and
  cached. MyST-NB then finds every chapter in the cache and only renders it.

The chapters start longest first, and a chapter that mostly waits (on timeouts, on Slurm) takes only
part of an execution slot: its share is the cores it kept busy last time (CPU seconds per second, its
kernel's launches, their ranks and its Slurm jobs included) over a slot's cores, from MIN_SHARE to 1,
and chapters start while the running ones' shares leave room, so waiting chapters overlap computing
ones. Last time is the chapter's cache record, or, in a cold build, COSTS: each chapter's seconds and
CPU seconds in a measured build (`python -m lessonlib.book.rebuild _build/lessonlib-execution.json`
rewrites it from that build's report).

So a cold `jupyter-book build book` executes the chapters side by side; a rebuild with nothing changed
executes nothing; a lesson or lessonlib edit re-executes exactly the chapters that use it. A chapter
that fails stops the build with its notebook, cell and error named (a LaunchError names the rank);
the chapters that succeeded stay cached. Each build leaves what it executed, in how long and with how
many CPU seconds, in `_build/lessonlib-execution.json`, and what those chapters ran, each launch and
recorded command with how it ended, in `_build/lessonlib-launches.jsonl` (lessonlib.book.launchrecord:
both files are rewritten by every build, so a chapter not executed, its cache fresh, is in neither).
With `execute_notebooks: force` or `off` only the first step runs.

Enabled in _config.yml (`sphinx: config: extensions`).
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ..paths import ROOT, find_script
from ..processes import owners
from ..processes.bounded import kill_session, marked_environment, poll_until, sigterm_cleans_up
from ..processes.marks import marked_processes, marks_of
from . import launchrecord

LESSON_PATH = re.compile(r"""["']((?:\.\./)?lessons/[\w./-]+\.py)["']""")
KEY = "lessonlib_dependencies"  # the field of a cache record's data that holds the dependency key
REPORT = "lessonlib-execution.json"  # written next to the HTML folder, in _build/
SCRATCH_PREFIX = "lessonlib-book-"  # the executed copies, in the temporary folder: then the build's pid and start
DEFAULT_CHAPTER_TIMEOUT = 2400  # seconds for one chapter, all its cells: a bound against a hang
COSTS = Path(__file__).with_name("costs.json")  # each chapter's seconds and CPU seconds, for a cold build
MIN_SHARE = 0.25  # the least part of an execution slot a chapter takes, however little CPU it used
SAMPLE_EVERY = 2.0  # seconds between two looks at the CPU seconds of each executor's marked processes


def dependencies(notebook_text, folder):
    """Files a notebook's code cells depend on: the lessons they name, found from the notebook's
    folder or the course root (as the launcher finds them), plus lessonlib's modules and the runs it
    serves from book/captured/ when they use it."""
    try:
        cells = json.loads(notebook_text).get("cells", [])
    except ValueError:
        return []
    code = "\n".join("".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code")
    found = set()
    for name in LESSON_PATH.findall(code):
        # As the launch in the chapter finds it: the chapter runs in its folder.
        path = find_script(name, here=folder)
        if path is not None:
            found.add(path)
    if "lessonlib" in code:  # its modules, and the recorded runs it serves (book/captured/: a GPU's output)
        found.update(p.resolve() for p in (ROOT / "lessonlib").rglob("*.py"))
        found.update(p.resolve() for p in (ROOT / "book" / "captured").glob("*.json"))
    return sorted(found)


def dependency_key(paths):
    """A hash of the files' names and contents: it changes when any of them does."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        digest.update(f"{name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\0".encode())
    return digest.hexdigest()


def jobs():
    """How many chapters execute at once: BOOK_JOBS, else 2 to 4 by CPU count. A chapter's ranks spend
    much of their time waiting on each other, so even 2 cores keep 2 chapters busy."""
    value = os.environ.get("BOOK_JOBS", "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"BOOK_JOBS={value!r}: give a whole number of chapters to execute at once, 1 or more")
        return int(value)
    return min(4, max(2, (os.cpu_count() or 1) // 2))


def chapter_timeout():
    value = os.environ.get("BOOK_CHAPTER_TIMEOUT", "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"BOOK_CHAPTER_TIMEOUT={value!r}: give whole seconds, 1 or more")
        return int(value)
    return DEFAULT_CHAPTER_TIMEOUT


def describe_failure(path, log):
    """Which cell of which notebook failed, with the cell's own error (a LaunchError names the rank)."""
    lines = log.strip().splitlines()
    try:
        info = json.loads(lines[-1]) if lines else {}
    except ValueError:
        info = {}
    if "error" not in info:
        return f"{path}: the executor failed:\n{log[-3000:]}"
    where = f"cell {info['cell']} (counting from 0, markdown cells included)" if info["cell"] is not None else "a cell"
    return f"{path}, {where} failed:\n{textwrap.indent(info['source'] or '', '    ')}\n{info['error'].strip()}"


@dataclass(kw_only=True)
class Execution:
    """What execute_notebooks did, by notebook path: how long each took and its CPU seconds, how each
    failed, where each executed copy is (in `scratch`, a temporary folder the caller removes), each
    one's slowest cells."""

    scratch: Path
    seconds: dict = field(default_factory=dict)
    cpu_seconds: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    executed: dict = field(default_factory=dict)
    slowest: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class _Executor:
    """One notebook being executed: its process (in a session of its own), the mark on every process
    it starts, its log, where it writes the executed copy, and when it started."""

    proc: subprocess.Popen
    mark: str
    log: object
    out: Path
    started: float


def execute_notebooks(paths, cell_timeout, jobs, timeout, log=print, shares=None, record=None):
    """Execute the notebooks in `jobs` slots, in their order, each in a process (and session) of its own,
    bounded; returns an Execution. A notebook takes `shares[path]` of a slot (default 1: `jobs` at a
    time); see next_to_start. `record`: the file each notebook's launches are recorded in
    (lessonlib.book.launchrecord), or None for none. If this raises, or the build is sent SIGTERM,
    every executor still running is stopped (stop_executors: SIGTERM, then after STOP_GRACE killed)
    with everything it started (its kernel, the kernel's launches), and the scratch folder is removed
    here."""
    # A build killed outright (SIGKILL) leaves its scratch folder: its name carries the build's pid and start
    # time, and the next build removes it once that process is gone.
    owners.sweep(tempfile.gettempdir(), SCRATCH_PREFIX)
    done = Execution(scratch=Path(tempfile.mkdtemp(prefix=owners.owned_prefix(SCRATCH_PREFIX))))
    running = {}  # {path: _Executor}
    with sigterm_cleans_up():  # SIGTERM unwinds to the `except` below before the build ends
        try:
            _execute_all(list(paths), running, done, cell_timeout, jobs, timeout, log, shares or {}, record)
        except BaseException:
            stop_executors(running.values())
            shutil.rmtree(done.scratch, ignore_errors=True)
            raise
    return done


STOP_GRACE = 20  # seconds an interrupted build gives its executors' kernels and launches to end by themselves


def stop_executors(executors):
    """End executors of an interrupted build: each its own way first, then by force.

    SIGTERM to the executor alone, as Linux sends it when the build dies (PDEATHSIG): its kernel ends
    when its parent does, and each launch of that kernel then ends itself, removing its run folder in
    the temporary folder (lessonlib.launcher._agent_main). Killing them all at once would leave those
    folders behind. After STOP_GRACE seconds, whatever is left is killed: the executor, its kernel, the
    kernel's launches."""
    executors = list(executors)
    for executor in executors:
        if executor.proc.poll() is None:
            executor.proc.terminate()
    try:  # a second SIGTERM during the grace ends the wait, not the kill
        with contextlib.suppress(TimeoutError):  # then the kill below
            poll_until(lambda: not any(marked_processes(e.mark) for e in executors), STOP_GRACE, 0.2)
    finally:
        for executor in executors:
            kill_session(executor.proc, executor.mark)
            executor.log.close()


def next_to_start(pending, running, jobs, shares):
    """The notebook to start now, or None: the first of `pending` whose share (`shares`, default 1) fits in
    what the `running` ones' shares leave of `jobs` slots; the first of all when nothing runs. At most
    2 * jobs at once, however small their shares (each holds a kernel, its launches, their memory)."""
    if not pending:
        return None
    if not running:
        return pending[0]
    if len(running) >= 2 * jobs:
        return None
    free = jobs - sum(shares.get(path, 1.0) for path in running)
    return next((path for path in pending if shares.get(path, 1.0) <= free + 1e-9), None)


def _sample(marks, seen):
    """Note the CPU seconds so far of every live process that carries one of `marks` (an executor's mark,
    which every process it starts inherits, a Slurm job's too): seen[mark][(pid, start time)] = seconds."""
    for proc in psutil.process_iter():
        try:
            for mark in set(marks_of(proc.environ())) & marks:
                times = proc.cpu_times()
                seen.setdefault(mark, {})[proc.pid, proc.create_time()] = times.user + times.system
        except (psutil.Error, OSError):
            pass


def _reap(proc):
    """None while `proc` runs. Once it has ended: reap it, and return its CPU seconds with those of every
    process it or its descendants waited for (an executor's kernel, the kernel's launches, their ranks)."""
    try:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped already (by Popen)
        return None if proc.poll() is None else 0.0
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def _execute_all(pending, running, done, cell_timeout, jobs, timeout, log, shares, record):
    """execute_notebooks' loop: start executors while their shares fit in `jobs` slots, collect each as it
    ends or runs late. An executor's CPU seconds are the larger of two counts that each miss some: its
    wait status's (itself and every process it or a descendant waited for; not a Slurm job's, whose
    processes the cluster's daemons start) and the sum over its marked processes, looked at every
    SAMPLE_EVERY seconds (not what a process did after the last look)."""
    seen, sampled = {}, 0.0
    while pending or running:
        if running and time.monotonic() - sampled >= SAMPLE_EVERY:
            _sample({e.mark for e in running.values()}, seen)
            sampled = time.monotonic()
        while (path := next_to_start(pending, running, jobs, shares)) is not None:
            pending.remove(path)
            number = len(done.executed) + len(running) + len(done.failures)
            running[path] = _start(path, done, number, cell_timeout, record)
        for path, executor in list(running.items()):
            late = time.monotonic() - executor.started > timeout
            cpu = _reap(executor.proc)
            if cpu is None and not late:
                continue
            kill_session(executor.proc, executor.mark)  # a late executor, or what a finished one left
            executor.log.seek(0)
            text = executor.log.read()
            executor.log.close()
            del running[path]
            if late:
                done.failures[path] = f"{path}: still running after {timeout} s (killed)\n{text[-3000:]}"
            elif executor.proc.returncode != 0:
                done.failures[path] = describe_failure(path, text)
            else:
                report = json.loads(text.strip().splitlines()[-1])
                done.seconds[path], done.slowest[path] = report["seconds"], report.get("slowest", [])
                done.cpu_seconds[path] = round(max(cpu, sum(seen.pop(executor.mark, {}).values())), 1)
                done.executed[path] = executor.out
            said = f"executed in {done.seconds[path]} s" if path in done.seconds else "FAILED"
            if path in done.cpu_seconds:
                said += f", {done.cpu_seconds[path]} CPU-seconds"
            log(f"lessonlib.book.rebuild: {path.name}: {said}")
        time.sleep(0.2)


def _start(path, done, number, cell_timeout, record):
    out = done.scratch / f"{number}-{path.name}"
    logfile = open(done.scratch / f"{out.stem}.log", "w+")
    env, mark = marked_environment()
    env.pop(launchrecord.CHAPTER_VAR, None)  # the executor names its chapter itself
    if record is not None:
        env[launchrecord.RECORD_VAR] = str(record)
    else:
        env.pop(launchrecord.RECORD_VAR, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lessonlib.book._execute_notebook", str(path), str(out), str(cell_timeout)],
        cwd=ROOT,
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return _Executor(proc=proc, mark=mark, log=logfile, out=out, started=time.monotonic())


def _note(app, docname, source):
    path = Path(app.env.doc2path(docname))
    if path.suffix != ".ipynb":
        return
    for dep in dependencies(source[0], path.parent):
        app.env.note_dependency(str(dep))


@dataclass(frozen=True, kw_only=True)
class Stale:
    """A notebook to execute: its cached outputs are missing or were made from other dependencies."""

    path: Path
    key: str  # dependency_key of what it depends on now
    last_seconds: float | None  # how long it took last time, if it ever ran (its cache record, else COSTS)
    last_cpu_seconds: float | None = None  # and its CPU seconds then


def costs():
    """COSTS: {notebook file name: {"seconds": S, "cpu_seconds": C}}, or {} without the file."""
    try:
        return json.loads(COSTS.read_text())["chapters"]
    except (OSError, ValueError, KeyError):
        return {}


def share(stale, jobs, cpus=None):
    """The part of an execution slot a notebook takes: the cores it kept busy last time (CPU seconds per
    second) over a slot's cores (the CPUs over `jobs`, at least 1), from MIN_SHARE to 1; 1 if unknown."""
    if not stale.last_seconds or stale.last_cpu_seconds is None:
        return 1.0
    per_slot = max(1.0, (cpus or os.cpu_count() or 1) / jobs)
    return round(min(1.0, max(MIN_SHARE, stale.last_cpu_seconds / stale.last_seconds / per_slot)), 2)


def find_stale(cache, env, docnames):
    """The notebooks among `docnames` to execute, longest first (last time's duration, from the cache
    record, else COSTS, else ten seconds per launch), so that the longest does not start last. A cache
    record made from other dependencies is removed here: MyST-NB must never render it."""
    import nbformat

    known = costs()
    stale = []
    for docname in docnames:
        path = Path(env.doc2path(docname))
        if path.suffix != ".ipynb":
            continue
        text = path.read_text()
        key = dependency_key(dependencies(text, path.parent))
        try:
            record = cache.match_cache_notebook(nbformat.reads(text, as_version=4))
        except KeyError:
            record = None
        if record is not None and record.data.get(KEY) == key:
            continue
        if record is not None:
            cache.remove_cache(record.pk)
        last = record.data if record is not None and "execution_seconds" in record.data else {}
        seconds = last.get("execution_seconds", known.get(path.name, {}).get("seconds"))
        cpu = last.get("execution_cpu_seconds") if last else known.get(path.name, {}).get("cpu_seconds")
        stale.append(Stale(path=path, key=key, last_seconds=seconds, last_cpu_seconds=cpu))
    return sorted(stale, key=lambda s: -(s.last_seconds if s.last_seconds is not None else 10 * _launches(s.path)))


def cache_executed(cache, stale, done):
    """Store each executed copy in the cache, with its dependency key, then empty the scratch folder."""
    import nbformat
    from jupyter_cache.base import CacheBundleIn

    keys = {s.path: s.key for s in stale}
    try:
        for path, out in done.executed.items():
            data = {"execution_seconds": done.seconds[path], KEY: keys[path]}
            if path in done.cpu_seconds:
                data["execution_cpu_seconds"] = done.cpu_seconds[path]
            bundle = CacheBundleIn(nbformat.read(out, as_version=4), str(path), data=data)
            cache.cache_notebook_bundle(bundle, check_validity=False, overwrite=True)
    finally:
        shutil.rmtree(done.scratch, ignore_errors=True)


def report(jobs, seconds, done):
    """What a build executed, in how long and how it failed: written to _build/lessonlib-execution.json."""
    if done is None:
        return {"jobs": 0, "seconds": 0.0, "executed": {}, "failures": {}}
    return {
        "jobs": jobs,
        "seconds": round(seconds, 1),
        "executed": {str(p): s for p, s in done.seconds.items()},
        "cpu_seconds": {str(p): s for p, s in done.cpu_seconds.items()},
        "slowest_cells": {str(p): cells for p, cells in done.slowest.items()},
        "failures": {str(p): f for p, f in done.failures.items()},
    }


def _execute_stale(app, env, docnames):
    """Execute, side by side, the notebooks about to be read whose cached outputs are missing or stale."""
    from jupyter_cache import get_cache
    from sphinx.errors import ExtensionError
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    config = env.mystnb_config
    if config.execution_mode != "cache":
        return
    cache = get_cache(config.execution_cache_path)
    stale = find_stale(cache, env, docnames)
    n, done, started = 0, None, time.monotonic()
    record = Path(app.outdir).parent / launchrecord.RECORD_FILE
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("")  # this build's runs alone, as its report holds this build's chapters alone
    if stale:
        n = min(jobs(), len(stale))
        shares = {s.path: share(s, n) for s in stale}
        names = ", ".join(s.path.name + (f" ({shares[s.path]} of a slot)" if shares[s.path] < 1 else "") for s in stale)
        logger.info(f"lessonlib.book.rebuild: executing {len(stale)} notebook(s) in {n} slots: {names}")
        paths = [s.path for s in stale]
        done = execute_notebooks(paths, config.execution_timeout, n, chapter_timeout(), logger.info, shares, record)
        cache_executed(cache, stale, done)
    written = report(n, time.monotonic() - started, done)
    Path(app.outdir).parent.joinpath(REPORT).write_text(json.dumps(written, indent=1))
    if written["failures"]:
        message = f"{len(written['failures'])} notebook(s) failed to execute:\n\n" + "\n\n".join(
            written["failures"].values()
        )
        if config.execution_raise_on_error:
            raise ExtensionError(message, modname=__name__)
        logger.warning(message)


def _launches(path):
    # lessonlib's launches, and Slurm jobs (chapter 17: `cluster.sbatch(`, `run_sbatch(`)
    text = path.read_text()
    return sum(text.count(f"{name}(") for name in ("launch", "check_function", "panel", "sbatch"))


def write_costs(report_path, path=COSTS):
    """Rewrite COSTS from a build's report (_build/lessonlib-execution.json): each executed chapter's
    seconds and CPU seconds, beside those of chapters that build did not execute."""
    report = json.loads(Path(report_path).read_text())
    chapters = costs() if path == COSTS else {}
    for name, seconds in report["executed"].items():
        cpu = report.get("cpu_seconds", {}).get(name)
        chapters[Path(name).name] = {"seconds": seconds, "cpu_seconds": cpu}
    about = "Each chapter's seconds and CPU seconds in a measured build: lessonlib.book.rebuild's plan for a cold build"
    rows = ",\n".join(f"  {json.dumps(name)}: {json.dumps(cost)}" for name, cost in sorted(chapters.items()))
    path.write_text(f'{{\n "about": {json.dumps(about)},\n "chapters": {{\n{rows}\n }}\n}}\n')


def setup(app):
    app.connect("source-read", _note)
    app.connect("env-before-read-docs", _execute_stale)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    write_costs(sys.argv[1])
