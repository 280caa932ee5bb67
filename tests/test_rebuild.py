"""The book's rebuilds (lessonlib.book.rebuild): a chapter executes again when, and only when, its code cells,
the lessons it shows or launches, or lessonlib change; with real incremental `jupyter-book build`s of a
small book that has the course's execution settings.
"""

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from lessonlib import ROOT, run_bounded
from lessonlib.processes.bounded import poll_until

JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")


def _build(book, timeout=240):
    """`jupyter-book build` without --all (an incremental build), in its own session, bounded."""
    done = run_bounded([JUPYTER_BOOK, "build", book, "-W", "-n"], timeout, cwd=book.parent)
    if done.timed_out:
        pytest.fail(f"jupyter-book build did not finish in {timeout} s:\n{done.output[-4000:]}")
    # The executors' lines about kernels come first: a kernel's end is told early in a long log.
    said = "\n".join(line for line in done.output.splitlines() if "kernel" in line.lower() and len(line) < 400)
    assert done.returncode == 0, f"{said[-3000:]}\n[...]\n{done.output[-4000:]}"
    return done.output


def _notebook(path, kernel, markdown, code, tags=()):
    cells = [
        {"cell_type": "markdown", "id": "m", "metadata": {}, "source": markdown},
        {
            "cell_type": "code",
            "id": "c",
            "metadata": {"tags": list(tags)},
            "outputs": [],
            "execution_count": None,
            "source": code,
        },
    ]
    path.write_text(
        json.dumps({"cells": cells, "metadata": {"kernelspec": kernel}, "nbformat": 4, "nbformat_minor": 5})
    )


@pytest.mark.timeout(600)
def test_a_rebuild_executes_exactly_the_chapters_whose_code_changed(tmp_path):
    """A small book with the course's execution settings (_config.yml's `execute` block, lessonlib.book.rebuild)
    and three chapters: one shows a region of a lesson, one runs another lesson, one uses no lesson.
    Each execution of a chapter is recorded in a file. Incremental builds (no --all), as a reader makes
    them: a cold build executes all three (side by side); nothing changed, or prose edited, executes
    none; a lesson edited executes exactly the chapter that uses it, and its page shows the new code or
    output; a code cell edited executes its chapter only. The shown code is highlighted like any block."""
    config = (ROOT / "_config.yml").read_text()
    assert "lessonlib.book.rebuild" in config, "_config.yml no longer loads lessonlib.book.rebuild"
    execute = re.search(r"^execute:\n(?:[ #].*\n|\n)+", config, re.M).group(0)  # the course's own settings
    assert re.search(r"^\s*execute_notebooks: cache\b", execute, re.M), execute
    (tmp_path / "_config.yml").write_text(
        "title: demo\nonly_build_toc_files: true\n"
        + execute
        + textwrap.dedent("""
        sphinx: {extra_extensions: [lessonlib.book.rebuild], config: {nb_execution_raise_on_error: true}}
    """)
    )
    book = tmp_path / "book"
    (book / "lessons").mkdir(parents=True)
    (book / "_toc.yml").write_text(
        "format: jb-book\nroot: index\nchapters:\n  - file: shows\n  - file: runs\n  - file: plain\n"
    )
    (book / "index.md").write_text("# index\n")
    shown = book / "lessons" / "demo.py"
    shown.write_text('def f():\n    # [start: shown]\n    value = "FIRST"\n    # [end: shown]\n    return value\n')
    run = book / "lessons" / "other.py"
    run.write_text('print("OUTPUT ONE")\n')
    record = tmp_path / "executions.txt"
    kernel = json.loads((ROOT / "book" / "01_launch.ipynb").read_text())["metadata"]["kernelspec"]
    note = f"open({str(record)!r}, 'a').write('{{}}\\n')\n"
    _notebook(
        book / "shows.ipynb",
        kernel,
        "# shows",
        note.format("shows") + 'import lessonlib\nlessonlib.show_code("lessons/demo.py", "shown")',
        tags=["remove-input", "lesson-code"],
    )
    _notebook(
        book / "runs.ipynb",
        kernel,
        "# runs",
        note.format("runs") + "import subprocess, sys\n"
        'print(subprocess.run([sys.executable, "lessons/other.py"], capture_output=True, text=True, '
        "timeout=60).stdout)",
    )
    _notebook(book / "plain.ipynb", kernel, "# plain", note.format("plain") + "print(6 * 7)")
    html = tmp_path / "_build" / "html"

    def build():
        """Build; return the chapters executed, in sorted order, and the log."""
        record.write_text("")
        log = _build(book)
        return sorted(record.read_text().split()), log

    executed, log = build()
    assert executed == ["plain", "runs", "shows"], log[-3000:]
    report = json.loads((tmp_path / "_build" / "lessonlib-execution.json").read_text())
    assert report["jobs"] >= 2 and len(report["executed"]) == 3, report  # side by side
    page = (html / "shows.html").read_text()
    assert (
        '<span class="n">value</span> <span class="o">=</span> <span class="s2">&quot;FIRST&quot;</span>' in page
        or '<span class="n">value</span> <span class="o">=</span> <span class="s2">"FIRST"</span>' in page
    ), "the shown region is not a Pygments-highlighted code block:\n" + page[page.find("cell_output") :][:800]
    assert "def f" not in page  # only the region, without the function around it
    assert "OUTPUT ONE" in (html / "runs.html").read_text()

    assert build()[0] == [], "a rebuild with nothing changed executed chapters"

    nb = json.loads((book / "shows.ipynb").read_text())
    nb["cells"][0]["source"] = "# shows, its prose edited"
    (book / "shows.ipynb").write_text(json.dumps(nb))
    assert build()[0] == [], "a prose edit executed chapters"
    assert "its prose edited" in (html / "shows.html").read_text()

    shown.write_text(shown.read_text().replace("FIRST", "SECOND"))
    assert build()[0] == ["shows"], "editing the lesson a chapter shows should execute that chapter alone"
    assert "SECOND" in (html / "shows.html").read_text() and "FIRST" not in (html / "shows.html").read_text()

    run.write_text('print("OUTPUT TWO")\n')
    assert build()[0] == ["runs"], "editing the lesson a chapter runs should execute that chapter alone"
    assert "OUTPUT TWO" in (html / "runs.html").read_text()

    nb = json.loads((book / "plain.ipynb").read_text())
    nb["cells"][1]["source"] = nb["cells"][1]["source"].replace("6 * 7", "6 * 8")
    (book / "plain.ipynb").write_text(json.dumps(nb))
    assert build()[0] == ["plain"], "editing a chapter's code should execute that chapter alone"
    assert "48" in (html / "plain.html").read_text()


@pytest.mark.unit
def test_a_chapter_that_uses_lessonlib_depends_on_all_of_it():
    """An edit to any lessonlib module re-executes every chapter that imports lessonlib (and no other)."""
    from lessonlib.book.rebuild import dependencies

    modules = {p.resolve() for p in (ROOT / "lessonlib").rglob("*.py")}
    chapter = ROOT / "book" / "02_collectives.ipynb"
    found = set(dependencies(chapter.read_text(), chapter.parent))
    assert modules <= found, sorted(modules - found)
    assert ROOT / "lessons" / "02_collectives.py" in found
    plain = json.dumps({"cells": [{"cell_type": "code", "source": "print(1)", "metadata": {}, "outputs": []}]})
    assert dependencies(plain, ROOT / "book") == []


@pytest.mark.unit
def test_a_chapter_that_mostly_waits_takes_part_of_a_slot():
    """A chapter's share of an execution slot is the cores it kept busy last time over a slot's cores,
    from MIN_SHARE to 1 (1 when it never ran); chapters start in their order while the running ones' shares
    leave room, so a waiting chapter runs beside two computing ones on two slots, and two computing ones
    never run beside each other's third."""
    from lessonlib.book.rebuild import MIN_SHARE, Stale, next_to_start, share

    def stale(seconds, cpu):
        return Stale(path=Path("x.ipynb"), key="", last_seconds=seconds, last_cpu_seconds=cpu)

    assert share(stale(None, None), jobs=2, cpus=2) == 1.0  # never ran: a whole slot
    assert share(stale(100.0, None), jobs=2, cpus=2) == 1.0  # a record without CPU seconds
    assert share(stale(100.0, 180.0), jobs=2, cpus=2) == 1.0  # 1.8 cores busy: at most a slot
    assert share(stale(100.0, 40.0), jobs=2, cpus=2) == 0.4  # 0.4 of a core, a slot being one core
    assert share(stale(100.0, 40.0), jobs=2, cpus=8) == 0.1 * 2.5 == MIN_SHARE  # a slot of 4 cores
    assert share(stale(100.0, 1.0), jobs=2, cpus=2) == MIN_SHARE

    shares = {"wait_a": 0.4, "wait_b": 0.3, "busy_a": 1.0, "busy_b": 1.0, "busy_c": 1.0}
    order = ["wait_a", "busy_a", "busy_b", "wait_b", "busy_c"]  # longest first
    running, started = [], []
    while (path := next_to_start([p for p in order if p not in started], running, 2, shares)) is not None:
        started.append(path)
        running.append(path)
    # wait_a (0.4) and busy_a (1.0) leave 0.6: busy_b does not fit, wait_b (0.3) does.
    assert running == ["wait_a", "busy_a", "wait_b"], running
    running.remove("wait_a")  # 1.3 running: still no room for a whole slot
    assert next_to_start(["busy_b", "busy_c"], running, 2, shares) is None
    running.remove("wait_b")
    assert next_to_start(["busy_b", "busy_c"], running, 2, shares) == "busy_b"
    # Without shares, `jobs` at a time in their order, as before; nothing running starts the first whatever its share.
    assert next_to_start(["a", "b"], ["c"], 2, {}) == "a" and next_to_start(["a"], ["b", "c"], 2, {}) is None
    assert next_to_start(["big"], [], 1, {"big": 1.0}) == "big"
    # However small the shares, at most 2 * jobs at once.
    tiny = {name: MIN_SHARE for name in "abcdef"}
    assert next_to_start(["e", "f"], ["a", "b", "c", "d"], 2, tiny) is None


@pytest.mark.timeout(120)
def test_an_executor_is_reaped_with_its_descendants_cpu_seconds(tmp_path):
    """_reap: None while the process runs; after it ends, its exit status on the Popen and the CPU seconds
    of it and of the child it waited for (a busy child here: its seconds must be counted)."""
    import subprocess

    from lessonlib.book.rebuild import _reap

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    parent = (
        f"import subprocess, sys, time\ntime.sleep(0.5)\nsubprocess.run([sys.executable, '-c', {busy!r}])\nsys.exit(3)"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    assert _reap(proc) is None

    def ended():  # boxed: 0.0 CPU seconds is an answer too, and poll_until waits for a true value
        cpu = _reap(proc)
        return None if cpu is None else [cpu]

    [cpu] = poll_until(ended, 60, 0.05, "the process to end")
    assert proc.returncode == 3 and proc.poll() == 3 and proc.wait() == 3
    assert cpu >= 0.5, cpu


@pytest.mark.unit
def test_a_cold_build_knows_every_chapter_from_costs():
    """lessonlib/book/costs.json (a measured build's seconds and CPU seconds, what a cold build orders and
    shares the chapters by) names every notebook of the book and nothing else, each with both numbers."""
    from lessonlib.book.rebuild import costs

    toc = (ROOT / "book" / "_toc.yml").read_text()
    notebooks = {
        f"{name}.ipynb" for name in re.findall(r"file: (\S+)", toc) if (ROOT / "book" / f"{name}.ipynb").exists()
    }
    known = costs()
    assert set(known) == notebooks, f"missing: {notebooks - set(known)}; not in the book: {set(known) - notebooks}"
    assert all(c["seconds"] > 0 and c["cpu_seconds"] > 0 for c in known.values()), known


@pytest.mark.timeout(180)
def test_a_kernel_that_dies_before_its_first_cell_is_started_again(tmp_path):
    """The executor (`python -m lessonlib.book._execute_notebook`, what the build runs per chapter) starts a
    kernel again when it dies before its first cell, up to KERNEL_STARTS in all. The kernel here is a spec
    whose command exits at once on its first two starts, and is ipykernel on the third: the chapter runs,
    each retry is said on stderr. A kernel that dies on every start fails the chapter, after exactly
    KERNEL_STARTS starts."""
    from lessonlib.book._execute_notebook import KERNEL_STARTS

    starts = tmp_path / "starts"
    spec = tmp_path / "kernels" / "kernels" / "dies-first"
    spec.mkdir(parents=True)
    (spec / "start.py").write_text(
        "import os, sys\n"
        f"starts = {str(starts)!r}\n"
        "with open(starts, 'a') as f: f.write('start\\n')\n"
        "if len(open(starts).read().split()) <= int(os.environ['DIES_FIRST']): sys.exit(3)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'ipykernel_launcher', *sys.argv[1:]])\n"
    )
    argv = [sys.executable, str(spec / "start.py"), "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "dies first", "language": "python"}))
    kernel = {"name": "dies-first", "display_name": "dies first", "language": "python"}
    notebook, out = tmp_path / "ch.ipynb", tmp_path / "out.ipynb"
    _notebook(notebook, kernel, "# ch", "print(6 * 7)")

    def execute(dies_first):
        starts.write_text("")
        env = {**os.environ, "JUPYTER_PATH": str(tmp_path / "kernels"), "DIES_FIRST": str(dies_first)}
        cmd = [sys.executable, "-m", "lessonlib.book._execute_notebook", notebook, out, "60"]
        done = run_bounded(cmd, 120, cwd=ROOT, env=env)
        assert not done.timed_out, done.output[-3000:]
        return done, len(starts.read_text().split())

    done, started = execute(KERNEL_STARTS - 1)
    assert done.returncode == 0, done.output[-3000:]
    assert started == KERNEL_STARTS, done.output[-3000:]
    assert done.output.count("the kernel died before its first cell") == KERNEL_STARTS - 1, done.output[-3000:]
    assert "42" in out.read_text()
    done, started = execute(KERNEL_STARTS)
    assert done.returncode == 1 and started == KERNEL_STARTS, done.output[-3000:]
    assert "Kernel died before replying to kernel_info" in json.loads(done.output.strip().splitlines()[-1])["error"]
