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

So a cold `jupyter-book build book` executes the chapters side by side; a rebuild with nothing changed
executes nothing; a lesson or lessonlib edit re-executes exactly the chapters that use it. A chapter
that fails stops the build with its notebook, cell and error named (a LaunchError names the rank);
the chapters that succeeded stay cached. Each build leaves what it executed, and in how long, in
`_build/lessonlib-execution.json`. With `execute_notebooks: force` or `off` only the first step runs.

Enabled in _config.yml (`sphinx: config: extensions`).
"""

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

from ..paths import ROOT, find_script
from ..processes.bounded import kill_session, marked_environment, sigterm_cleans_up
from ..processes.marks import marked_processes

LESSON_PATH = re.compile(r"""["']((?:\.\./)?lessons/[\w./-]+\.py)["']""")
KEY = "lessonlib_dependencies"  # the field of a cache record's data that holds the dependency key
REPORT = "lessonlib-execution.json"  # written next to the HTML folder, in _build/
DEFAULT_CHAPTER_TIMEOUT = 2400  # seconds for one chapter, all its cells: a bound against a hang


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
    """What execute_notebooks did, by notebook path: how long each took, how each failed, where each
    executed copy is (in `scratch`, a temporary folder the caller removes), each one's slowest cells."""

    scratch: Path
    seconds: dict = field(default_factory=dict)
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


def execute_notebooks(paths, cell_timeout, jobs, timeout, log=print):
    """Execute the notebooks, `jobs` at a time, each in a process (and session) of its own, bounded;
    returns an Execution. If this raises, or the build is sent SIGTERM, every executor still running
    is stopped (stop_executors: SIGTERM, then after STOP_GRACE killed) with everything it started (its
    kernel, the kernel's launches), and the scratch folder is removed here."""
    done = Execution(scratch=Path(tempfile.mkdtemp(prefix="lessonlib-book-")))
    running = {}  # {path: _Executor}
    with sigterm_cleans_up():  # SIGTERM unwinds to the `except` below before the build ends
        try:
            _execute_all(list(paths), running, done, cell_timeout, jobs, timeout, log)
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
    deadline = time.monotonic() + STOP_GRACE
    try:  # a second SIGTERM during the grace ends the wait, not the kill
        while time.monotonic() < deadline and any(marked_processes(e.mark) for e in executors):
            time.sleep(0.2)
    finally:
        for executor in executors:
            kill_session(executor.proc, executor.mark)
            executor.log.close()


def _execute_all(pending, running, done, cell_timeout, jobs, timeout, log):
    """execute_notebooks' loop: start executors up to `jobs`, collect each as it ends or runs late."""
    while pending or running:
        while pending and len(running) < jobs:
            path = pending.pop(0)
            running[path] = _start(path, done, len(done.executed) + len(running) + len(done.failures), cell_timeout)
        for path, executor in list(running.items()):
            late = time.monotonic() - executor.started > timeout
            if executor.proc.poll() is None and not late:
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
                done.executed[path] = executor.out
            said = f"executed in {done.seconds[path]} s" if path in done.seconds else "FAILED"
            log(f"lessonlib.book.rebuild: {path.name}: {said}")
        time.sleep(0.2)


def _start(path, done, number, cell_timeout):
    out = done.scratch / f"{number}-{path.name}"
    logfile = open(done.scratch / f"{out.stem}.log", "w+")
    env, mark = marked_environment()
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
    last_seconds: float | None  # how long it took last time, if it ever ran


def find_stale(cache, env, docnames):
    """The notebooks among `docnames` to execute, longest first (last time's duration, else ten
    seconds per launch), so that the longest does not start last. A cache record made from other
    dependencies is removed here: MyST-NB must never render it."""
    import nbformat

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
        stale.append(Stale(path=path, key=key, last_seconds=record.data.get("execution_seconds") if record else None))
    return sorted(stale, key=lambda s: -(s.last_seconds if s.last_seconds is not None else 10 * _launches(s.path)))


def cache_executed(cache, stale, done):
    """Store each executed copy in the cache, with its dependency key, then empty the scratch folder."""
    import nbformat
    from jupyter_cache.base import CacheBundleIn

    keys = {s.path: s.key for s in stale}
    try:
        for path, out in done.executed.items():
            data = {"execution_seconds": done.seconds[path], KEY: keys[path]}
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
    if stale:
        n = min(jobs(), len(stale))
        names = ", ".join(s.path.name for s in stale)
        logger.info(f"lessonlib.book.rebuild: executing {len(stale)} notebook(s), {n} at a time: {names}")
        paths = [s.path for s in stale]
        done = execute_notebooks(paths, config.execution_timeout, n, chapter_timeout(), log=logger.info)
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


def setup(app):
    app.connect("source-read", _note)
    app.connect("env-before-read-docs", _execute_stale)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
