"""The book: notebooks are stored without outputs; every chapter executes, and the book builds.

CI runs the reader's `jupyter-book build book` (warnings as errors) into an empty folder, so every
chapter executes exactly once, several at a time (lessonlib.book.rebuild), and the HTML is built from
those outputs. When a cell fails, the test names the notebook, the cell and, through lessonlib's
LaunchError, the rank. That work is done once per session by the fixture `built_book` (tests/conftest.py), which calls
`execute_and_build` here: the book test reports its outcome, and the browser tests
(tests/test_browser.py) open the pages it wrote. Both carry the xdist group "book", so that under
`make test` (--dist loadgroup) they run in one worker, one after the other, and share one build.

The build records what its chapters ran (lessonlib.book.launchrecord), and the tests skip the runs that
lessonlib/book/launches.json says the book makes: the book test fails when this build's record and that
file differ, either way, naming the entries and the command that rewrites the file from this build.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lessonlib import ROOT, run_bounded
from lessonlib.book import launchrecord, rebuild
from lessonlib.processes.bounded import marked_environment, poll_until
from lessonlib.processes.marks import kill_all, marked_processes

JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")
# The whole build, every chapter executed two at a time, then the HTML; each chapter also has its own
# bound (lessonlib.book.rebuild: 2400 s) and each cell execute.timeout (_config.yml). A bound against a hang,
# not a target: the build took ~14 minutes beside the rest of the suite on 2 busy cores before the
# chapters' added asserts and the Start page, and over 25 minutes after them at load 9 (being reduced).
BUILD_TIMEOUT = 4300
BOOK_TEST_TIMEOUT = 4400  # the book test's bound, fixture included (pytest-timeout counts setup)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tracked_notebooks():
    """Notebooks in git plus any on disk not yet added: found by pattern, never by a hand-kept list."""
    found = set((ROOT / "book").glob("*.ipynb"))
    try:
        out = subprocess.run(
            ["git", "ls-files", "book/*.ipynb"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
        found.update(ROOT / p for p in out)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        pass
    return sorted(found)


def build_book(book_dir, timeout=BUILD_TIMEOUT, output=None, fresh=True, tmpdir=None):
    """Run `jupyter-book build` (warnings as errors) in its own session; kill the whole tree on timeout.

    `output`: the folder that gets _build/ (--path-output), instead of the book's config folder.
    `fresh`: read every source again (--all), as a first build does.
    `tmpdir`: the build's TMPDIR (every chapter's kernel and every rank inherit it), to see what is left.
    """
    cmd = [str(JUPYTER_BOOK), "build", str(book_dir), "-W", "-n", "--keep-going"]
    cmd += ["--all"] if fresh else []
    cmd += ["--path-output", str(output)] if output is not None else []
    env = {**os.environ, "TMPDIR": str(tmpdir)} if tmpdir is not None else None
    done = run_bounded(cmd, timeout, cwd=ROOT, env=env)
    if done.timed_out:
        pytest.fail(f"jupyter-book build {book_dir} did not finish in {timeout} s:\n{done.output[-5000:]}")
    return done.returncode, ANSI.sub("", done.output)


def explain_failure(log):
    """What a failed build log says went wrong: the chapters that failed to execute (lessonlib.book.rebuild
    names the notebook, the cell and its error), else the Sphinx warnings, else the log's end."""
    parts = re.findall(r"^Extension error \(lessonlib\.book\.rebuild\):\n(.*?)(?=^Traceback|\Z)", log, re.S | re.M)
    warnings = [ln for ln in log.splitlines() if "WARNING:" in ln or "ERROR:" in ln]
    if warnings:
        parts.append("Sphinx warnings (treated as errors):\n" + "\n".join(warnings[:30]))
    return "\n\n".join(p.strip() for p in parts) or log[-5000:]


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


@dataclass
class BookBuild:
    """What the book build did: which chapters executed (and in how long), which failed, the HTML."""

    notebooks: list
    jobs: int = 0
    execution_seconds: float = 0.0
    times: dict = field(default_factory=dict)  # {notebook: seconds}
    slowest: dict = field(default_factory=dict)  # {notebook: [[cell index, seconds], ...]}, the slowest cells
    failures: dict = field(default_factory=dict)  # {notebook: failure text}
    returncode: int | None = None  # of `jupyter-book build`
    log: str = ""
    html: Path | None = None  # the built book's _build/html
    record: Path | None = None  # what the chapters ran: _build/lessonlib-launches.jsonl (lessonlib.book.launchrecord)
    left_in_tmp: list = field(default_factory=list)  # what the build left in its own TMPDIR

    @property
    def ok(self):
        """Every chapter executed and the HTML was built: the browser tests have pages to open."""
        return not self.failures and self.returncode == 0


def execute_and_build(folder):
    """`make book` from scratch, with its output under `folder`: every chapter executed, the HTML built.

    The reader's own command, `jupyter-book build book` with warnings as errors, the course's
    _config.yml and an empty cache (--path-output: nothing from an earlier build is reused), so every
    chapter executes: lessonlib.book.rebuild runs them BOOK_JOBS at a time (2 on CI's 2 cores) and leaves
    what it executed, and in how long, in _build/lessonlib-execution.json. When a chapter fails, the
    build stops and that report names the notebook, the cell and the error.
    """
    build = BookBuild(tracked_notebooks())
    config = (ROOT / "_config.yml").read_text()
    assert re.search(r"^\s*execute_notebooks: cache\b", config, re.M), "_config.yml no longer uses the cache"
    scratch = folder / "tmp"  # the build's own TMPDIR: whatever a chapter leaves in it is found afterwards
    scratch.mkdir()
    build.returncode, build.log = build_book(ROOT / "book", output=folder, tmpdir=scratch)
    # Importing torch._dynamo in a fresh process (a bare torchrun's ranks, a spawned process) makes torch's
    # own cache folder, torchinductor_<user>, in the temporary folder, empty; torch reuses it in every
    # program, and a reader's may hold real caches, so no chapter removes it. Empty, it is not counted.
    build.left_in_tmp = sorted(
        p.name for p in scratch.iterdir() if not (p.name.startswith("torchinductor_") and not any(p.iterdir()))
    )
    report_path = folder / "_build" / "lessonlib-execution.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
        build.jobs, build.execution_seconds = report["jobs"], report["seconds"]
        build.times = {Path(p): s for p, s in report["executed"].items()}
        build.slowest = {Path(p): cells for p, cells in report.get("slowest_cells", {}).items()}
        build.failures = {Path(p): f for p, f in report["failures"].items()}
    build.html = folder / "_build" / "html"
    build.record = folder / "_build" / launchrecord.RECORD_FILE
    return build


def record_drift(record, summary_path=None):
    """What differs between the runs a build recorded (`record`, its lessonlib-launches.jsonl) and the committed
    summary the tests take their skips from: a message, or None when they agree."""
    summary_path = launchrecord.SUMMARY if summary_path is None else summary_path
    entries = launchrecord.read_record(record)
    launchrecord.executed_chapters(entries, record)  # every chapter ran to its end: its runs are all there
    missing, new = launchrecord.drift(launchrecord.load(summary_path), launchrecord.summarise(entries))
    if not missing and not new:
        return None
    said = [
        f"{summary_path.relative_to(ROOT) if summary_path.is_relative_to(ROOT) else summary_path} "
        "is not what this build ran."
    ]
    if missing:
        said.append(
            "In it, but not run by this build with default arguments and every rank ok (the tests skip these "
            "runs for the book, which no longer makes them):\n  " + "\n  ".join(missing)
        )
    if new:
        said.append("Run by this build, but not in it (the tests run these a second time):\n  " + "\n  ".join(new))
    said.append(
        f"Rewrite it from this build with `python -m lessonlib.book.launchrecord {record}` (or "
        f"`{launchrecord.REWRITE}`, which builds the book in _build/ first), and commit it."
    )
    return "\n".join(said)


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
            cells = ", ".join(f"cell {i} {s:.0f} s" for i, s in book.slowest.get(path, []))
            print(f"  {path.relative_to(ROOT)}: {seconds:.1f} s" + (f" (slowest: {cells})" if cells else ""))
    assert not book.failures, "\n\n".join(book.failures.values())
    assert book.returncode == 0, explain_failure(book.log)
    # Every chapter removes what it made outside the repository: torchrun's log folders, run folders,
    # compiler caches, checkpoints. The whole build ran with a TMPDIR of its own, now empty.
    assert book.left_in_tmp == [], f"the book build left these in its TMPDIR: {book.left_in_tmp}"
    # The tests skip the runs lessonlib/book/launches.json says the book makes: it must be what this build ran,
    # both ways (an entry it did not run is coverage lost; a run not in it is run twice, and is refused too).
    drift = record_drift(book.record)
    assert drift is None, drift
    for path in book.notebooks:
        page = book.html / f"{path.stem}.html"
        assert page.exists(), f"{page} was not written"
        if "lessonlib.launch(" in path.read_text():
            assert "lessonlib-run" in page.read_text(), f"{page.name} shows no side-by-side rank output"


def mini_book(folder, name, sources):
    """A one-chapter book in `folder`, configured as the course's (lessonlib.book.rebuild executes it), whose
    notebook `name` has one code cell per source. Returns the book's folder."""
    (folder / "_config.yml").write_text(
        textwrap.dedent(f"""
        title: {name}
        only_build_toc_files: true
        execute: {{execute_notebooks: cache, timeout: 120, allow_errors: false, run_in_temp: false}}
        sphinx: {{extra_extensions: [lessonlib.book.rebuild],
                 config: {{nb_execution_raise_on_error: true, nb_execution_show_tb: true}}}}
    """)
    )
    book = folder / "book"
    book.mkdir()
    (book / "_toc.yml").write_text(f"format: jb-book\nroot: index\nchapters:\n  - file: {name}\n")
    (book / "index.md").write_text("# index\n")
    cells = [{"cell_type": "markdown", "metadata": {}, "source": f"# {name}"}] + [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": source}
        for source in sources
    ]
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (book / f"{name}.ipynb").write_text(json.dumps(nb))
    return book


@pytest.mark.timeout(300)
def test_a_failing_cell_is_named_with_its_notebook_and_rank(tmp_path):
    """A deliberately broken mini-book, executed as the course's is: the build log must say which
    notebook, which cell, which rank."""
    launch = (
        'lessonlib.launch("lessons/01_launch.py", nproc=2, args=["--fail-rank", "1"], '
        'timeout=60, show="none").raise_for_status()'
    )
    book = mini_book(tmp_path, "broken", ["import lessonlib", launch])
    earlier = tmp_path / "_build" / launchrecord.RECORD_FILE  # an earlier build's record: this build starts anew
    earlier.parent.mkdir()
    earlier.write_text('{"chapter": "old.ipynb", "kind": "chapter", "ok": true}\n')
    rc, log = build_book(book, timeout=240)
    assert rc != 0, "a notebook with a failing cell must fail the build"
    message = explain_failure(log)
    assert "broken.ipynb" in message, message
    assert "cell 2" in message, message
    assert "First failure (root cause): rank 1" in message, message
    # The build recorded what ran: the launch, not with defaults (args=) and not ok, and a chapter that failed.
    records = list(tmp_path.rglob(launchrecord.RECORD_FILE))
    assert records == [earlier], f"expected {earlier} alone: {records}"
    entries = launchrecord.read_record(records[0])
    assert entries == [
        {
            "chapter": "broken.ipynb",
            "kind": "launch",
            "script": "lessons/01_launch.py",
            "ranks": 2,
            "defaults": False,
            "changed": ["args"],
            "ok": False,
        },
        {"chapter": "broken.ipynb", "kind": "chapter", "ok": False},
    ], entries
    with pytest.raises(launchrecord.RecordError, match="broken.ipynb: failed"):
        launchrecord.executed_chapters(entries, records[0])


SLEEPER = "import pathlib, sys, time\npathlib.Path(sys.argv[1]).write_text('asleep')\ntime.sleep(300)\n"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_book_build_stopped_mid_chapter_leaves_no_process_behind(tmp_path, sig):
    """`jupyter-book build` stopped while a chapter's launch runs (a rank asleep for 300 s). SIGTERM (CI
    cancelling a job, `kill`): the build stops every executor (SIGTERM, then after rebuild.STOP_GRACE the
    kill), with its kernel and the kernel's launch, and removes its scratch folder before it ends.
    SIGKILL (nothing can be run in the build itself): the executor is told by Linux (PR_SET_PDEATHSIG)
    and shuts its kernel down, and the launch ends with the kernel (lessonlib.processes.lifeline).
    Either way, within that bound no process the build started is left."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(SLEEPER)
    asleep = tmp_path / "asleep"  # the rank is up (forked ranks show the agent server's command line)
    launch = f'lessonlib.launch({str(sleeper)!r}, nproc=1, args=[{str(asleep)!r}], timeout=280, show="none")'
    book = mini_book(tmp_path, "stopped", ["import lessonlib", launch])
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env, mark = marked_environment({**os.environ, "TMPDIR": str(scratch)})
    log = open(tmp_path / "build.log", "w")
    build = subprocess.Popen(
        [str(JUPYTER_BOOK), "build", str(book), "--all"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def launch_started():
        assert build.poll() is None, (
            f"the build ended before its launch started:\n{(tmp_path / 'build.log').read_text()}"
        )
        return asleep.exists()

    try:
        poll_until(launch_started, 150, interval=0.5, what="the chapter's launch to start")
        os.kill(build.pid, sig)
        build.wait(timeout=rebuild.STOP_GRACE + 10)  # the executors' grace, then the kill

        # Within 30 s, every process of the build; and the launch's run folder (lessonlib-<id>-*), which goes
        # with its processes. After SIGTERM the build's own scratch folder too (after SIGKILL nothing runs in
        # the build to remove that one).
        def left():
            procs = [" ".join(p.cmdline())[:150] for p in marked_processes(mark)]
            runs = [p.name for p in scratch.glob("lessonlib-*") if not p.name.startswith("lessonlib-book-")]
            return procs + runs

        poll_until(
            lambda: not left(), 30, interval=0.5, what=lambda: f"the build's processes and run folder to go: {left()}"
        )
        if sig == signal.SIGTERM:
            assert build.returncode == -signal.SIGTERM, build.returncode
            assert sorted(p.name for p in scratch.iterdir()) == [], f"left in TMPDIR: {list(scratch.iterdir())}"
    finally:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGKILL)
            build.wait()
        kill_all(marked_processes(mark))
        log.close()


def environment_without_the_course_kernel(folder):
    """A Python environment in `folder` that has every package of this one (a .pth file adding its
    site-packages) but its own prefix, so no kernel `make setup` registered: a reader's own environment
    with requirements.txt installed and nothing else. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    # addsitedir, unlike a plain path line, also reads that folder's own .pth files (editable installs).
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (Path(site) / "course_packages.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in ours))
    return python


# The kernel every chapter names in its metadata (`make setup` registers it).
KERNEL = json.loads((ROOT / "book" / "01_launch.ipynb").read_text())["metadata"]["kernelspec"]["name"]


@pytest.mark.timeout(300)
def test_the_plain_build_command_works_where_the_course_kernel_was_never_registered(tmp_path):
    """Every chapter names the kernel `dp-course` (for JupyterLab and VS Code), which only `make setup`
    registers. `jupyter-book build` in an environment that never ran it executes the chapters with that
    environment's own Python kernel instead of failing with NoSuchKernel."""
    python = environment_without_the_course_kernel(tmp_path / "env")
    specs = subprocess.run(
        [
            str(python),
            "-c",
            "from jupyter_client.kernelspec import KernelSpecManager as K; print(*K().find_kernel_specs())",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert KERNEL not in specs, f"{KERNEL} is registered in the fresh environment after all: {specs}"
    book = mini_book(tmp_path, "plain", ["import sys\nimport lessonlib\nprint('kernel python:', sys.executable)"])
    nb_path = book / "plain.ipynb"
    nb = json.loads(nb_path.read_text())
    nb["metadata"]["kernelspec"] = {"name": KERNEL, "display_name": "Python (dp-course .venv)", "language": "python"}
    nb_path.write_text(json.dumps(nb))
    # What the environment's `jupyter-book` script runs (the new environment has no scripts of its own).
    build = [str(python), "-c", "import sys; from jupyter_book.cli.main import main; sys.exit(main())"]
    done = run_bounded([*build, "build", str(book), "-W", "-n"], 240, cwd=ROOT)
    log = ANSI.sub("", done.output)
    assert done.returncode == 0 and not done.timed_out, log[-5000:]
    page = next(tmp_path.glob("**/_build/html/plain.html")).read_text()
    assert f"kernel python: {python}" in page, "the chapter did not run in the fresh environment's own Python"
