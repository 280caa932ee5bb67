"""Every lesson script runs to the end on every rank at world sizes 1, 2, 3 and 4.

World sizes 2 to 4 run under torchrun (lessonlib.launch). World size 1 runs the way the README's
second command does, `python lessons/X.py`, where lessonlib.setup makes a process group of one rank;
torchrun at one rank is covered by the chapters and the launcher tests.

A chapter that launches a lesson with its default arguments and `.raise_for_status()` already runs
that lesson at that world size, every rank to exit 0, inside the book build. When the book build is
part of the same pytest session, such a pair is skipped here with the chapter named, instead of being
run twice: CI time is the budget the course lives within. Run this file alone and every pair runs.

Lessons are found by pattern, so a new lesson is tested the moment it is added.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import lessonlib

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted(ROOT.glob("lessons/[0-9][0-9]_*.py"))
WORLD_SIZES = (1, 2, 3, 4)  # 3: a world size that does not divide evenly
TIMEOUT = 180  # seconds per run
BOOK_TEST = "test_book_builds_and_executes_every_chapter"
# Only this exact shape counts: default arguments, and the run's success asserted on the spot.
BOOK_LAUNCH = re.compile(r'lessonlib\.launch\(\s*"lessons/(\w+)\.py",\s*nproc=(\d+),\s*timeout=\d+,?\s*'
                         r'(?:show="\w+",?\s*)?\)\.raise_for_status\(\)')


def book_runs():
    """{(lesson stem, world size): notebook} for the launches in chapters listed in book/_toc.yml."""
    toc = (ROOT / "book" / "_toc.yml").read_text()
    runs = {}
    for stem in re.findall(r"^\s*-\s*file:\s*(\S+)", toc, re.M):
        notebook = ROOT / "book" / f"{stem}.ipynb"
        if not notebook.exists():
            continue
        for cell in json.loads(notebook.read_text())["cells"]:
            if cell["cell_type"] == "code":
                for lesson, n in BOOK_LAUNCH.findall("".join(cell["source"])):
                    runs.setdefault((lesson, int(n)), notebook.name)
    return runs


BOOK_RUNS = book_runs()


def test_lessons_are_found():
    assert LESSONS, f"no lessons matched {ROOT / 'lessons/[0-9][0-9]_*.py'}"


def run_plain(lesson):
    """`python lesson.py` in its own session, bounded; the whole session is killed on timeout."""
    proc = subprocess.Popen([sys.executable, str(lesson)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"python {lesson.name} did not finish in {TIMEOUT} s:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"np{n}")
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs(lesson, world_size, request):
    chapter = BOOK_RUNS.get((lesson.stem, world_size))
    if chapter and any(item.name == BOOK_TEST for item in request.session.items):
        pytest.skip(f"the book build runs it: {chapter} launches {lesson.name} at {world_size} ranks with "
                    f"default arguments and raise_for_status()")
    if world_size == 1:
        code, out = run_plain(lesson)
        assert code == 0, f"python {lesson.name} exited {code}:\n{out[-5000:]}"
        return
    run = lessonlib.launch(lesson, nproc=world_size, timeout=TIMEOUT, show="none")
    assert run.ok, run.describe_failure()
    assert [r.exitcode for r in run.ranks] == [0] * world_size, run.describe_failure()
