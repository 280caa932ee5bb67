"""One formatter and one linter for the whole course, lessons of a readable size, a unit tier that
starts no process, and one definition of where things are.

ruff (pinned in requirements.txt, configured in pyproject.toml) covers the lessons, lessonlib, the
tests, the benchmarks and the chapters' code cells. `make format` fixes what these tests find. The
course root and the lessons are defined once (lessonlib.paths); every other file imports them.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lessonlib import ROOT
from lessonlib.cli import catalog
from lessonlib.paths import CHAPTER_GLOB, LESSON_GLOB

RUFF = Path(sys.executable).with_name("ruff")
LESSONS = catalog.lesson_files()
NOT_THE_COURSES = {".git", ".venv", "_build", "__pycache__", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints"}
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


def course_files(suffix):
    """Every file of the course ending in `suffix`, in every folder and subfolder (not .venv, _build, caches)."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(d for d in subfolders if d not in NOT_THE_COURSES)
        found += [Path(folder) / f for f in sorted(files) if f.endswith(suffix)]
    return found


def lessonlib_packages():
    """Every package of lessonlib, itself included: each folder under it that has an __init__.py."""
    return sorted(p.parent for p in (ROOT / "lessonlib").rglob("__init__.py") if not NOT_THE_COURSES & set(p.parts))


def missing_packages(files):
    """The lessonlib packages (as folders relative to the root) that have no module among `files`."""
    covered = {Path(f).parent for f in files}
    return [str(p.relative_to(ROOT)) for p in lessonlib_packages() if p not in covered]


@pytest.mark.unit
def test_every_lessonlib_package_is_known_here():
    """The packages the checks below must reach. A new one is found by the walk, not by a list; this list only
    makes sure the walk sees those that exist today."""
    found = {str(p.relative_to(ROOT)) for p in lessonlib_packages()}
    today = {"lessonlib", *(f"lessonlib/{s}" for s in ("launcher", "launcher/fastpath", "view", "processes"))}
    today |= {f"lessonlib/{s}" for s in ("cluster", "cli", "notebook", "book")}
    assert today <= found, sorted(today - found)
    assert missing_packages(course_files(".py")) == [], "course_files misses a package"


def test_ruff_covers_the_notebooks_and_every_python_folder():
    """The check above is only as good as what it reads: every chapter and every Python file, in every
    folder and subfolder (lessonlib's subpackages, tests/helpers, lessons/recipes, ...)."""
    listed = set(ruff("check", "--show-files", ".").stdout.split())
    wanted = [*ROOT.glob("book/*.ipynb"), *course_files(".py")]
    assert len(wanted) > len(LESSONS) + 50 and ROOT / "lessonlib" / "launcher" / "core.py" in wanted, wanted
    missing = [str(p.relative_to(ROOT)) for p in wanted if str(p) not in listed]
    assert not missing, f"ruff does not read: {missing}"
    assert missing_packages(listed) == [], "ruff reads no module of these packages"


def _assigned_names(tree):
    return {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}


@pytest.mark.unit
def test_the_course_root_and_the_lesson_glob_are_defined_once():
    """lessonlib.paths defines ROOT and the patterns of a lesson and a chapter; lessonlib, the tests and the
    benchmarks import them (`from lessonlib import ROOT`, lessonlib.cli.catalog.lesson_files). Only
    lessonlib/gpucheck.py keeps its own ROOT: it runs on a GPU machine with torch and the standard library
    alone. (A lesson that adds the checkout to sys.path, to run without an install, computes it itself.)"""
    # By the first folder under the root: the root's own path may hold any name (a checkout in .../tests).
    sides = [p for p in course_files(".py") if p.relative_to(ROOT).parts[0] in ("lessonlib", "tests", "benchmarks")]
    assert missing_packages(sides) == [], "the check misses a lessonlib package"
    own = {ROOT / "lessonlib" / "paths.py", ROOT / "lessonlib" / "gpucheck.py"}
    roots = [
        str(p.relative_to(ROOT)) for p in sides if p not in own and "ROOT" in _assigned_names(ast.parse(p.read_text()))
    ]
    assert roots == [], f"ROOT assigned outside lessonlib/paths.py: {roots}"
    globs = [
        str(p.relative_to(ROOT))
        for p in sides
        if p.name not in ("paths.py", "test_style.py")
        and (LESSON_GLOB in p.read_text() or CHAPTER_GLOB in p.read_text())
    ]
    assert globs == [], f"the lesson or chapter pattern spelled outside lessonlib/paths.py: {globs}"


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
