"""The exercise scaffold (lessonlib.exercises.run_checker, shared_verdict) and the checker lessons built on it.

Real processes and real gloo, no mocks. A toy checker written here shows what the scaffold does with a
wrong answer at two ranks under torchrun: every rank fails with the problem, naming the rank that saw
it (rank 1 here, so a notebook's check_function says what is wrong); and that the self-test fails a
checker that accepts a wrong answer. Then, for every checker lesson (found by pattern): its `solution`
region, alone in a file as a reader would send it, passes the checker; and its self-test checks exactly
the function that region defines (sabotage the region, in a copy of the lessons, and the self-test
fails, naming it). The per-lesson runs are at world size 1 as plain `python lessons/X.py` runs (a
one-rank gloo group), the cheapest real run, forked from the server that has imported torch already
(tests/rankfork.py, as the lesson tests' ranks are); tests/test_lessons.py runs every self-test at 1 to 4
ranks."""

import ast
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

import lessonlib
from lessonlib.code import regions
from lessonlib.exercises import PRELUDE, load_function
from lessonlib.runprocs import run_bounded
from rankfork import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHECKERS = sorted(ROOT.glob("lessons/[0-9][0-9]_exercise_*.py"))
TIMEOUT = 180  # seconds per run: a 2-core CI machine under load


def solution_region(lesson):
    """The source of the lesson's `solution` region and the names of the functions it defines."""
    text = lesson.read_text()
    first, last = regions(text)["solution"]
    source = textwrap.dedent("\n".join(text.splitlines()[first : last + 1]))
    return source, [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]


def run_python(args, cwd, timeout=TIMEOUT):
    """Run `python ARGS` in a session of its own; on timeout kill the session (DataLoader workers too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LESSONLIB_RUN_DIR"):
        env.pop(name, None)  # world size 1: a group of one, as `python lessons/X.py` makes
    done = run_bounded([sys.executable, *args], timeout, cwd=cwd, env=env)
    if done.timed_out:
        pytest.fail(f"python {' '.join(map(str, args))} ran past {timeout} s:\n{done.output[-4000:]}")
    return done.returncode, done.output


TOY = '''"""torchrun --nproc_per_node=2 toy_checker.py

Checker for a toy exercise: rank_sum() returns the sum of every rank's number, on every rank.
"""

import torch
import torch.distributed as dist

from lessonlib.exercises import run_checker


def verdict(fn, ctx):
    got, want = fn(), sum(range(ctx.world_size))
    return None if LENIENT or got == want else f"rank_sum() returned {got}, the ranks add up to {want}"


# [start: solution]
def rank_sum():
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    return total.item()
# [end: solution]


def own_rank():
    return dist.get_rank()  # wrong, except at world size 1


def main():
    run_checker(__doc__, verdict, rank_sum, wrong=[own_rank], right_alone=[own_rank], passed="adds up the ranks")


LENIENT = False
if __name__ == "__main__":
    main()
'''

WRONG_ON_RANK_1 = (
    PRELUDE
    + """def rank_sum():
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    return total.item() + (dist.get_rank() == 1)
"""
)


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy_checker.py"
    path.write_text(TOY)
    return path


def test_the_scaffold_fails_a_wrong_answer_on_every_rank_and_names_the_problem(toy, tmp_path):
    answer = tmp_path / "answer.py"
    answer.write_text(WRONG_ON_RANK_1)
    run = lessonlib.launch(
        toy, nproc=2, args=["--solution", str(answer), "--function", "rank_sum"], timeout=TIMEOUT, show="none"
    )
    assert not run.ok and all(r.exitcode != 0 for r in run.ranks), run.describe_failure()
    for r in run.ranks:  # rank 0 saw nothing wrong itself, and still says what rank 1 saw
        assert "AssertionError: rank 1: rank_sum() returned 2, the ranks add up to 1" in r.stderr, r.stderr[-2000:]
    # The same answer as a notebook sends it: check_function raises with the rank that saw the problem.
    with pytest.raises(AssertionError, match=r"not yet: .*rank 1: rank_sum\(\) returned 2, the ranks add up to 1"):
        lessonlib.check_function(load_function(str(answer), "rank_sum"), toy, nproc=2, timeout=TIMEOUT)


def test_the_scaffold_passes_the_solution_and_its_self_test_rejects_the_wrong_answer(toy, tmp_path):
    run = lessonlib.launch(toy, nproc=2, timeout=TIMEOUT, show="none").raise_for_status()
    assert "rank 0: checker self-test: accepts rank_sum, rejects ['own_rank']" in run.ranks[0].stdout
    assert "  own_rank: rank 0: rank_sum() returned 0, the ranks add up to 1" in run.ranks[0].stdout
    answer = tmp_path / "answer.py"
    answer.write_text(PRELUDE + solution_region(toy)[0])
    passed = lessonlib.check_function(load_function(str(answer), "rank_sum"), toy, nproc=2, timeout=TIMEOUT)
    assert all("rank_sum adds up the ranks" in r.stdout for r in passed.ranks), passed.ranks[0].stdout


def test_a_checker_that_accepts_a_wrong_answer_fails_its_self_test(toy):
    toy.write_text(TOY.replace("LENIENT = False", "LENIENT = True"))
    run = lessonlib.launch(toy, nproc=2, timeout=TIMEOUT, show="none")
    assert not run.ok
    assert "the checker accepted the wrong answer(s) ['own_rank']" in run.ranks[0].stderr, run.ranks[0].stderr[-2000:]


def test_at_world_size_1_a_mistake_that_one_rank_cannot_make_is_not_rejected(toy):
    code, out = run_python([toy], cwd=toy.parent)
    assert code == 0, out[-3000:]
    assert (
        "accepts rank_sum, rejects []" in out
        and "these wrong answers are right, so they are not rejected: ['own_rank']" in out
    ), out[-3000:]


def test_every_checker_lesson_is_found_and_uses_the_scaffold():
    assert len(CHECKERS) >= 10, CHECKERS
    for lesson in CHECKERS:
        text = lesson.read_text()
        assert "run_checker(" in text and "def agreed(" not in text and "def main(" in text, (
            f"{lesson.name}: use lessonlib.exercises"
        )


@pytest.mark.parametrize("lesson", CHECKERS, ids=lambda p: p.stem)
def test_the_solution_region_passes_as_a_readers_answer(lesson, tmp_path):
    """The region alone, with only the prelude check_function adds (torch, dist), passes: it is self-contained."""
    source, names = solution_region(lesson)
    assert names, f"{lesson.name}: the solution region defines no function"
    answer = tmp_path / "answer.py"
    answer.write_text(PRELUDE + source)
    for name in names:
        run = run_ranks(lesson, 1, tmp_path / name, args=["--solution", answer, "--function", name], plain=True)
        assert run.ok and f"rank 0: {name} " in run.ranks[0].stdout, run.describe_failure()


@pytest.mark.parametrize("lesson", CHECKERS, ids=lambda p: p.stem)
def test_the_self_test_checks_the_function_the_solution_region_defines(lesson, tmp_path):
    """In a copy of the lessons, each function of the region is replaced (inside the region) by one that
    raises: the self-test must then fail, naming it. So the reference it checks is the region's."""
    copy = tmp_path / "lessons"
    shutil.copytree(ROOT / "lessons", copy, ignore=shutil.ignore_patterns("__pycache__"))
    _, names = solution_region(lesson)
    sabotage = "".join(
        f"\n\ndef {name}(*args, **kwargs):\n    raise RuntimeError('sabotaged {name}')\n" for name in names
    )
    text = lesson.read_text()
    assert text.count("# [end: solution]") == 1
    (copy / lesson.name).write_text(text.replace("# [end: solution]", sabotage.strip("\n") + "\n# [end: solution]"))
    run = run_ranks(copy / lesson.name, 1, tmp_path / "run", plain=True)
    assert not run.ok and f"sabotaged {names[0]}" in run.ranks[0].stderr, (
        f"{lesson.name}: the self-test passed a sabotaged solution region:\n{run.describe_failure()}"
    )
