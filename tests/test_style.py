"""One formatter and one linter for the whole course, lessons of a readable size, and a unit tier that
starts no process.

ruff (pinned in requirements.txt, configured in pyproject.toml) covers the lessons, lessonlib, the
tests, the benchmarks and the chapters' code cells. `make format` fixes what these tests find.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).with_name("ruff")
LESSONS = sorted(ROOT.glob("lessons/[0-9][0-9]_*.py"))
# A lesson is one idea: about 150 lines, formatted, docstring included. Checkers (which hold a reference
# answer and the wrong answers they must reject) and lessons that set several cases side by side run
# longer; none may grow past this without being split.
MAX_LESSON_LINES = 300


def ruff(*args):
    if not RUFF.is_file():
        pytest.fail(f"{RUFF} is missing: install requirements.txt into this environment ({sys.prefix})")
    return subprocess.run([str(RUFF), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_tree_is_formatted():
    done = ruff("format", "--check", "--diff", ".")
    assert done.returncode == 0, f"not formatted as ruff formats it (run `make format`):\n{done.stdout[-6000:]}"


def test_the_tree_passes_the_linter():
    done = ruff("check", "--output-format", "concise", ".")
    assert done.returncode == 0, f"ruff check found problems (`make format` fixes some):\n{done.stdout[-6000:]}"


def test_ruff_covers_the_notebooks_and_every_python_folder():
    """The check above is only as good as what it reads: every chapter and every folder of code."""
    listed = set(ruff("check", "--show-files", ".").stdout.split())
    wanted = [
        *ROOT.glob("book/*.ipynb"),
        *LESSONS,
        *ROOT.glob("lessonlib/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("benchmarks/*.py"),
    ]
    missing = [str(p.relative_to(ROOT)) for p in wanted if str(p) not in listed]
    assert not missing, f"ruff does not read: {missing}"


@pytest.mark.unit
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_stays_one_idea_long(lesson):
    lines = len(lesson.read_text().splitlines())
    assert lines <= MAX_LESSON_LINES, f"{lesson.name} has {lines} lines: split it (at most {MAX_LESSON_LINES})"
    ast.parse(lesson.read_text())  # and it is Python a reader can run


@pytest.mark.unit
def test_a_unit_test_that_starts_a_process_is_caught(processes_started):
    """tests/conftest.py notes it (and would fail this test after it), so the tier stays one of seconds."""
    subprocess.run([sys.executable, "-c", "pass"], timeout=30)
    assert [event for event, _ in processes_started] == ["subprocess.Popen"], processes_started
    processes_started.clear()  # what the check after every unit test fails on
