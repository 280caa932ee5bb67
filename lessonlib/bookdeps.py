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
  (lessonlib._execute_notebook), each bounded (BOOK_CHAPTER_TIMEOUT seconds, default 2400), and
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
from pathlib import Path

from .launchspec import ROOT, find_script
from .runprocs import kill_session, marked_environment, sigterm_cleans_up

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
        found.update(p.resolve() for p in (ROOT / "lessonlib").glob("*.py"))
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


def execute_notebooks(paths, cell_timeout, jobs, timeout, log=print):
    """Execute the notebooks, `jobs` at a time, each in a process (and session) of its own, bounded.

    Returns ({path: seconds}, {path: failure text}, {path: executed copy}, scratch, {path: slowest
    cells}): the executed copies are in `scratch`, a temporary folder the caller removes. If this
    raises, or the build is sent SIGTERM, every executor still running is killed with everything it
    started (its kernel, the kernel's launches) and `scratch` is removed here.
    """
    scratch = Path(tempfile.mkdtemp(prefix="lessonlib-book-"))
    running = {}  # {path: (process, mark, log file, executed copy, start time)}
    with sigterm_cleans_up():  # SIGTERM unwinds to the `except` below before the build ends
        try:
            times, failures, executed, slowest = _execute_all(
                list(paths), running, scratch, cell_timeout, jobs, timeout, log
            )
        except BaseException:
            for proc, mark, logfile, _, _ in running.values():
                kill_session(proc, mark)  # the executor, its kernel and every launch that kernel started
                logfile.close()
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    return times, failures, executed, scratch, slowest


def _execute_all(pending, running, scratch, cell_timeout, jobs, timeout, log):
    """execute_notebooks' loop: start executors up to `jobs`, collect each as it ends or runs late."""
    times, failures, executed, slowest = {}, {}, {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            path = pending.pop(0)
            out = scratch / f"{len(executed) + len(running) + len(failures)}-{path.name}"
            logfile = open(scratch / f"{out.stem}.log", "w+")
            env, mark = marked_environment()
            proc = subprocess.Popen(
                [sys.executable, "-m", "lessonlib._execute_notebook", str(path), str(out), str(cell_timeout)],
                cwd=ROOT,
                env=env,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            running[path] = (proc, mark, logfile, out, time.monotonic())
        for path, (proc, mark, logfile, out, started) in list(running.items()):
            late = time.monotonic() - started > timeout
            if proc.poll() is None and not late:
                continue
            kill_session(proc, mark)  # a late executor, or what a finished one left (its kernel's launches)
            logfile.seek(0)
            text = logfile.read()
            logfile.close()
            del running[path]
            if late:
                failures[path] = f"{path}: still running after {timeout} s (killed)\n{text[-3000:]}"
            elif proc.returncode != 0:
                failures[path] = describe_failure(path, text)
            else:
                done = json.loads(text.strip().splitlines()[-1])
                times[path], slowest[path] = done["seconds"], done.get("slowest", [])
                executed[path] = out
            log(f"lessonlib.bookdeps: {path.name}: " + (f"executed in {times[path]} s" if path in times else "FAILED"))
        time.sleep(0.2)
    return times, failures, executed, slowest


def _note(app, docname, source):
    path = Path(app.env.doc2path(docname))
    if path.suffix != ".ipynb":
        return
    for dep in dependencies(source[0], path.parent):
        app.env.note_dependency(str(dep))


def _execute_stale(app, env, docnames):
    """Execute, side by side, the notebooks about to be read whose cached outputs are missing or stale."""
    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn
    from sphinx.errors import ExtensionError
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    config = env.mystnb_config
    if config.execution_mode != "cache":
        return
    cache = get_cache(config.execution_cache_path)
    stale = []  # (path, key, seconds it took last time or None)
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
        if record is not None:  # made from other lessons: never let MyST-NB render it
            cache.remove_cache(record.pk)
        stale.append((path, key, (record.data.get("execution_seconds") if record else None)))
    report = {"jobs": 0, "seconds": 0.0, "executed": {}, "failures": {}}
    if stale:
        n = min(jobs(), len(stale))
        # The longest first (last time's duration, else the number of launches), so it does not start last.
        stale.sort(key=lambda s: -(s[2] if s[2] is not None else 10 * _launches(s[0])))
        logger.info(
            f"lessonlib.bookdeps: executing {len(stale)} notebook(s), {n} at a time: "
            + ", ".join(p.name for p, _, _ in stale)
        )
        started = time.monotonic()
        times, failures, executed, scratch, slowest = execute_notebooks(
            [p for p, _, _ in stale], config.execution_timeout, n, chapter_timeout(), log=logger.info
        )
        try:
            keys = {p: k for p, k, _ in stale}
            for path, out in executed.items():
                cache.cache_notebook_bundle(
                    CacheBundleIn(
                        nbformat.read(out, as_version=4),
                        str(path),
                        data={"execution_seconds": times[path], KEY: keys[path]},
                    ),
                    check_validity=False,
                    overwrite=True,
                )
        finally:
            for item in scratch.iterdir():
                item.unlink()
            scratch.rmdir()
        report = {
            "jobs": n,
            "seconds": round(time.monotonic() - started, 1),
            "executed": {str(p): s for p, s in times.items()},
            "slowest_cells": {str(p): cells for p, cells in slowest.items()},
            "failures": {str(p): f for p, f in failures.items()},
        }
    Path(app.outdir).parent.joinpath(REPORT).write_text(json.dumps(report, indent=1))
    if report["failures"]:
        message = f"{len(report['failures'])} notebook(s) failed to execute:\n\n" + "\n\n".join(
            report["failures"].values()
        )
        if config.execution_raise_on_error:
            raise ExtensionError(message, modname=__name__)
        logger.warning(message)


def _launches(path):
    text = path.read_text()
    return sum(text.count(f"{name}(") for name in ("launch", "check_function", "panel"))


def setup(app):
    app.connect("source-read", _note)
    app.connect("env-before-read-docs", _execute_stale)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
