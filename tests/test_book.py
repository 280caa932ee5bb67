"""The book: notebooks are stored without outputs; every chapter executes, and the book builds.

CI executes each notebook exactly once, with MyST-NB's own execution function and settings, several
chapters at a time, and then builds the HTML book from those outputs (warnings are errors). When a
cell fails, the test names the notebook, the cell and, through lessonlib's LaunchError, the rank.
That work is done once per session by the fixture `built_book` (tests/conftest.py), which calls
`execute_and_build` here: the book test reports its outcome, and the browser tests
(tests/test_browser.py) open the pages it wrote. Both carry the xdist group "book", so that under
`make test` (--dist loadgroup) they run in one worker, one after the other, and share one build.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")
BUILD_TIMEOUT = 1500  # seconds for the whole book; each cell also has execute.timeout in _config.yml
CHAPTER_TIMEOUT = 1200  # seconds for one chapter's execution (chapter 2 took 650 s with the whole suite beside it)
# The book test's bound, fixture included (pytest-timeout counts setup): every chapter, two at a time, then
# the HTML. A bound against a hang, well above the ~25 minutes the chapters took beside the rest of the
# suite on 2 busy cores, not a target.
BOOK_TEST_TIMEOUT = 2700
EXECUTE = ROOT / "tests" / "helpers" / "execute_notebook.py"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tracked_notebooks():
    """Notebooks in git plus any on disk not yet added: found by pattern, never by a hand-kept list."""
    found = set((ROOT / "book").glob("*.ipynb"))
    try:
        out = subprocess.run(["git", "ls-files", "book/*.ipynb"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
        found.update(ROOT / p for p in out)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        pass
    return sorted(found)


def build_book(book_dir, timeout=BUILD_TIMEOUT):
    """Run `jupyter-book build` (warnings as errors) in its own session; kill the whole tree on timeout."""
    # --all: without it, a _build/ left by an earlier build makes Sphinx skip unchanged chapters,
    # and they would not be executed this time.
    cmd = [str(JUPYTER_BOOK), "build", str(book_dir), "--all", "-W", "-n", "--keep-going"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"jupyter-book build {book_dir} did not finish in {timeout} s:\n{log[-5000:]}")
    return proc.returncode, ANSI.sub("", log)


def explain_failure(log):
    """Turn a failed build log into: which notebook, which cell (number and source), which error."""
    parts = []
    for m in re.finditer(r"An error occurred while executing the following cell:\n-+\n(.*?)\n-+\n(.*?)"
                         r"(?=\n(?:The above exception|Traceback \(most recent call last\):\n  File \"/.*?jupyter_book)|\Z)",
                         log, re.S):
        source, error = m.group(1), m.group(2)
        path = re.search(r"ExecutionError: (\S+\.ipynb)", log[m.end():] + log)
        notebook = Path(path.group(1)) if path else None
        where = f"{notebook}" if notebook else "a notebook"
        if notebook and notebook.exists():
            cells = json.loads(notebook.read_text())["cells"]
            index = next((i for i, c in enumerate(cells) if "".join(c["source"]).strip() == source.strip()), None)
            if index is not None:
                where += f", cell {index} (counting from 0, markdown cells included)"
        lines = error.strip().splitlines()
        # The cell's own error (a LaunchError names the rank and the root cause) is what matters.
        start = next((i for i, ln in enumerate(lines) if re.match(r"^\w*(Error|Exception)\b.*:", ln)), 0)
        parts.append(f"{where} failed:\n{textwrap.indent(source, '    ')}\n" + "\n".join(lines[start:]))
    warnings = [ln for ln in log.splitlines() if "WARNING:" in ln or "ERROR:" in ln]
    if warnings:
        parts.append("Sphinx warnings (treated as errors):\n" + "\n".join(warnings[:30]))
    return "\n\n".join(parts) or log[-5000:]


def test_notebooks_in_git_have_no_outputs():
    notebooks = tracked_notebooks()
    assert notebooks, "no notebooks found under book/"
    dirty = []
    for path in notebooks:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count")):
                dirty.append(f"{path.relative_to(ROOT)} cell {i}")
    assert not dirty, "notebooks must be stored without outputs (CI executes them); strip: " + ", ".join(dirty)


def test_every_chapter_is_in_the_toc():
    toc = (ROOT / "book" / "_toc.yml").read_text()
    missing = [p.stem for p in tracked_notebooks() if not re.search(rf"file:\s*{re.escape(p.stem)}\s*$", toc, re.M)]
    assert not missing, f"notebooks missing from book/_toc.yml (they would never be built): {missing}"


def execute_chapters(notebooks, out_dir, jobs, cell_timeout):
    """Execute the notebooks, `jobs` at a time, each in a process (and session) of its own.

    Returns ({notebook: seconds}, {notebook: failure text}). The notebooks with the most launches
    start first, so the longest one does not start last. Each is bounded: a chapter still running
    after CHAPTER_TIMEOUT is killed with everything it started.
    """
    def weight(path):
        text = path.read_text()
        return text.count("lessonlib.launch(") + text.count("check_function(")

    pending = sorted(notebooks, key=weight, reverse=True)
    running, times, failures = {}, {}, {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                path = pending.pop(0)
                log = open(out_dir / f"{path.stem}.log", "w+")
                proc = subprocess.Popen([sys.executable, str(EXECUTE), str(path), str(out_dir / path.name),
                                         str(cell_timeout)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
                running[path] = (proc, log, time.monotonic())
            for path, (proc, log, started) in list(running.items()):
                late = time.monotonic() - started > CHAPTER_TIMEOUT
                if proc.poll() is None and not late:
                    continue
                if late:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                log.seek(0)
                text = log.read()
                log.close()
                del running[path]
                if late:
                    failures[path] = f"still running after {CHAPTER_TIMEOUT} s (killed)\n{text[-3000:]}"
                elif proc.returncode != 0:
                    failures[path] = describe_cell_failure(path, text)
                else:
                    times[path] = float(text.strip().splitlines()[-1])
            time.sleep(0.2)
    finally:
        for proc, log, _ in running.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()
    return times, failures


def describe_cell_failure(path, text):
    """Which cell of which notebook failed, with the cell's own error (a LaunchError names the rank)."""
    line = text.strip().splitlines()[-1] if text.strip() else ""
    try:
        info = json.loads(line)
    except ValueError:
        return f"{path.name}: the executor failed:\n{text[-3000:]}"
    lines = (info["error"] or "").strip().splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r"^\w*(Error|Exception)\b.*:", ln)), 0)
    where = f"cell {info['cell']} (counting from 0, markdown cells included)" if info["cell"] is not None else "a cell"
    return f"{path.name}, {where} failed:\n{textwrap.indent(info['source'] or '', '    ')}\n" + "\n".join(lines[start:])


@dataclass
class BookBuild:
    """What `execute_and_build` did: which chapters executed (and in how long), which failed, the build."""
    notebooks: list
    jobs: int
    execution_seconds: float = 0.0
    times: dict = field(default_factory=dict)  # {notebook: seconds}
    failures: dict = field(default_factory=dict)  # {notebook: failure text}
    returncode: int | None = None  # of `jupyter-book build`; None when it did not run (a chapter failed)
    log: str = ""
    html: Path | None = None  # the built book's _build/html

    @property
    def ok(self):
        return not self.failures and self.returncode == 0


def execute_and_build(folder):
    """Execute every chapter, then build the HTML book from those outputs, under `folder`.

    This is `make book` in two halves, so that chapters can execute side by side (CI's time is the
    budget): each notebook is executed by the same function and settings as MyST-NB's (tests/helpers/
    execute_notebook.py), from book/, BOOK_JOBS at a time; then `jupyter-book build` runs on a copy of
    book/ holding the executed notebooks, with execution off, so every output is rendered as a reader
    sees it. `make book` executes them one after another inside the build. When a chapter fails, the
    book is not built; the result says what failed, and the book test turns that into its report.
    """
    notebooks = tracked_notebooks()
    executed = folder / "executed"
    executed.mkdir()
    jobs = int(os.environ.get("BOOK_JOBS", min(2, os.cpu_count() or 1)))
    build = BookBuild(notebooks, jobs)
    started = time.monotonic()
    build.times, build.failures = execute_chapters(notebooks, executed, jobs, cell_timeout())
    build.execution_seconds = time.monotonic() - started
    if build.failures:
        return build

    # The copy: book/ with the executed notebooks, next to links to the folders it includes code from.
    site = folder / "site"
    shutil.copytree(ROOT / "book", site / "book", ignore=shutil.ignore_patterns("*.ipynb", ".ipynb_checkpoints"))
    for path in notebooks:
        shutil.copy(executed / path.name, site / "book" / path.name)
    for folder_name in ("lessons", "lessonlib"):
        (site / folder_name).symlink_to(ROOT / folder_name, target_is_directory=True)
    config = (ROOT / "_config.yml").read_text()
    assert re.search(r"^\s*execute_notebooks: force\b", config, re.M), "_config.yml no longer forces execution"
    (site / "_config.yml").write_text(re.sub(r"(^\s*execute_notebooks:) force\b", r'\1 "off"', config, flags=re.M))
    build.returncode, build.log = build_book(site / "book")
    build.html = site / "_build" / "html"
    return build


@pytest.mark.xdist_group("book")
@pytest.mark.timeout(BOOK_TEST_TIMEOUT)
def test_book_builds_and_executes_every_chapter(built_book, capsys):
    """Every chapter executes without an error, then the book builds from those outputs (warnings as errors).

    The work is the session fixture's (`built_book`, see `execute_and_build`); this test reports it.
    """
    book = built_book
    with capsys.disabled():
        print(f"\nchapter execution, {book.jobs} at a time: {book.execution_seconds:.0f} s")
        for path, seconds in sorted(book.times.items()):
            print(f"  {path.relative_to(ROOT)}: {seconds:.1f} s")
    assert not book.failures, "\n\n".join(book.failures.values())
    assert book.returncode == 0, explain_failure(book.log)
    for path in book.notebooks:
        page = book.html / f"{path.stem}.html"
        assert page.exists(), f"{page} was not written"
        if "lessonlib.launch(" in path.read_text():
            assert "lessonlib-run" in page.read_text(), f"{page.name} shows no side-by-side rank output"


def cell_timeout():
    """execute.timeout from _config.yml: the same bound per cell as the book build's."""
    match = re.search(r"^\s*timeout:\s*(\d+)", (ROOT / "_config.yml").read_text(), re.M)
    assert match, "_config.yml has no execute.timeout"
    return int(match.group(1))


@pytest.mark.timeout(300)
def test_a_failing_cell_is_named_with_its_notebook_and_rank(tmp_path):
    """A deliberately broken mini-book: the report must say which notebook, which cell, which rank."""
    (tmp_path / "_config.yml").write_text(textwrap.dedent("""
        title: broken
        only_build_toc_files: true
        execute: {execute_notebooks: force, timeout: 120, allow_errors: false, run_in_temp: false}
        sphinx: {config: {nb_execution_raise_on_error: true, nb_execution_show_tb: true}}
    """))
    book = tmp_path / "book"
    book.mkdir()
    (book / "_toc.yml").write_text("format: jb-book\nroot: index\nchapters:\n  - file: broken\n")
    (book / "index.md").write_text("# index\n")
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# broken"},
             {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": "import lessonlib"},
             {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
              "source": 'lessonlib.launch("lessons/01_launch.py", nproc=2, args=["--fail-rank", "1"], '
                        'timeout=60, show="none").raise_for_status()'}]
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                      "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    (book / "broken.ipynb").write_text(json.dumps(nb))
    rc, log = build_book(book, timeout=240)
    assert rc != 0, "a notebook with a failing cell must fail the build"
    message = explain_failure(log)
    assert "broken.ipynb" in message, message
    assert "cell 2" in message, message
    assert "First failure (root cause): rank 1" in message, message
