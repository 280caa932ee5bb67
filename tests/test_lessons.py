"""Every lesson script runs to the end on every rank at world sizes 1, 2, 3 and 4.

Lessons are found by pattern, so a new lesson is tested the moment it is added.
"""

from pathlib import Path

import pytest

import lessonlib

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted(ROOT.glob("lessons/[0-9][0-9]_*.py"))
WORLD_SIZES = (1, 2, 3, 4)  # 3: a world size that does not divide evenly


def test_lessons_are_found():
    assert LESSONS, f"no lessons matched {ROOT / 'lessons/[0-9][0-9]_*.py'}"


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"np{n}")
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs(lesson, world_size):
    run = lessonlib.launch(lesson, nproc=world_size, timeout=180, show="none")
    assert run.ok, run.describe_failure()
    assert [r.exitcode for r in run.ranks] == [0] * world_size, run.describe_failure()
