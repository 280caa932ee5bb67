"""Every lesson script runs to the end on every rank at world sizes 1, 2, 3 and 4.

World sizes 2 to 4 run under torchrun (lessonlib.launch). World size 1 runs the way the README's
second command does, `python lessons/X.py`, where lessonlib.setup makes a process group of one rank;
torchrun at one rank is covered by the chapters and the launcher tests.

Lessons are found by pattern, so a new lesson is tested the moment it is added.
"""

import os
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
def test_lesson_runs(lesson, world_size):
    if world_size == 1:
        code, out = run_plain(lesson)
        assert code == 0, f"python {lesson.name} exited {code}:\n{out[-5000:]}"
        return
    run = lessonlib.launch(lesson, nproc=world_size, timeout=TIMEOUT, show="none")
    assert run.ok, run.describe_failure()
    assert [r.exitcode for r in run.ranks] == [0] * world_size, run.describe_failure()
