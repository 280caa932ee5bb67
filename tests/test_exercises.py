"""lessonlib.exercises: the checker scaffold (run_checker, shared_verdict), the checker lessons built on it,
and check_function / load_function, which send a reader's function to a checker.

Real processes and real gloo, no mocks. A toy checker (tests/helpers/toy_checker.py) shows what the
scaffold does with a wrong answer at two ranks under torchrun: every rank fails with the problem, naming
the rank that saw it (rank 1 here, so a notebook's check_function says what is wrong); and that the
self-test fails a checker that accepts a wrong answer. Then, for every checker lesson (found by pattern):
its `solution` region, alone in a file as a reader would send it, passes the checker; and its self-test
checks exactly the function that region defines (sabotage the region, in a copy of the lessons, and the
self-test fails, naming it). The per-lesson runs are at world size 1 as plain `python lessons/X.py` runs
(a one-rank gloo group), the cheapest real run, forked from the server that has imported torch already
(tests/rankfork.py, as the lesson tests' ranks are); tests/test_lessons.py runs every self-test at 1 to 4
ranks."""

import ast
import inspect
import shutil
import textwrap
from pathlib import Path

import pytest

import lessonlib
from conftest import HELPERS
from lessonlib import ROOT
from lessonlib.cli import catalog
from lessonlib.exercises import PRELUDE, load_function
from lessonlib.notebook.code import regions
from rankfork import run_plain, run_ranks

CHECKERS = catalog.checkers()
TIMEOUT = 180  # seconds per run: a 2-core machine under load


def solution_region(lesson):
    """The source of the lesson's `solution` region and the names of the functions it defines."""
    text = lesson.read_text()
    first, last = regions(text)["solution"]
    source = textwrap.dedent("\n".join(text.splitlines()[first : last + 1]))
    return source, [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]


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
    """tests/helpers/toy_checker.py, copied: a test may edit its copy."""
    return Path(shutil.copy(HELPERS / "toy_checker.py", tmp_path))


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
    toy.write_text(toy.read_text().replace("LENIENT = False", "LENIENT = True"))
    run = lessonlib.launch(toy, nproc=2, timeout=TIMEOUT, show="none")
    assert not run.ok
    assert "the checker accepted the wrong answer(s) ['own_rank']" in run.ranks[0].stderr, run.ranks[0].stderr[-2000:]


def test_at_world_size_1_a_mistake_that_one_rank_cannot_make_is_not_rejected(toy):
    code, out = run_plain(toy)
    assert code == 0, out[-3000:]
    assert (
        "accepts rank_sum, rejects []" in out
        and "these wrong answers are right, so they are not rejected: ['own_rank']" in out
    ), out[-3000:]


@pytest.mark.unit
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


# --------------------------------------------------------------------------- check_function and load_function
# End to end: real torchrun, real gloo, chapter 2's own checker lesson.

CHECKER = ROOT / "lessons" / "02_exercise_all_gather.py"


def gather_by_broadcast(tensor_list, tensor):
    for k in range(dist.get_world_size()):  # noqa: F821 - `dist` is imported by the solution file
        if dist.get_rank() == k:  # noqa: F821
            tensor_list[k].copy_(tensor)
        dist.broadcast(tensor_list[k], src=k)  # noqa: F821


def gather_in_place(tensor_list, tensor):
    for k in range(dist.get_world_size()):  # noqa: F821
        dist.broadcast(tensor, src=k)  # noqa: F821
        tensor_list[k].copy_(tensor)


def gather_with_all_gather(tensor_list, tensor):
    dist.all_gather(tensor_list, tensor)  # noqa: F821


def gather_with_all_reduce(tensor_list, tensor):
    for k in range(dist.get_world_size()):  # noqa: F821
        slot = tensor.clone() if dist.get_rank() == k else torch.zeros_like(tensor)  # noqa: F821
        dist.all_reduce(slot)  # noqa: F821 - correct result, but not built from broadcast
        tensor_list[k].copy_(slot)


def test_check_function_accepts_a_correct_solution():
    run = lessonlib.check_function(gather_by_broadcast, CHECKER, nproc=3)
    assert run.ok and all("gathers like dist.all_gather" in r.stdout for r in run.ranks)


def test_check_function_rejects_a_wrong_solution_and_says_why():
    with pytest.raises(AssertionError, match=r"tensor_list\[1\] is \[1, 1, 1\], rank 1 sent 11"):
        lessonlib.check_function(gather_in_place, CHECKER, nproc=3)


@pytest.mark.parametrize("fn", [gather_with_all_gather, gather_with_all_reduce], ids=lambda f: f.__name__)
def test_check_function_enforces_the_rules_of_the_exercise(fn):
    with pytest.raises(AssertionError, match="other collectives are off"):
        lessonlib.check_function(fn, CHECKER, nproc=2)


def test_check_function_defaults_are_what_the_chapters_want():
    """The chapters call check_function(fn, checker, nproc=n): quiet (the verdict is the result), bounded."""
    defaults = {k: p.default for k, p in inspect.signature(lessonlib.check_function).parameters.items()}
    assert (defaults["timeout"], defaults["show"]) == (120, "none"), defaults


def test_check_function_refuses_what_has_no_source_before_launching():
    with pytest.raises(TypeError, match="define it with def"):
        lessonlib.check_function(len, CHECKER)
    with pytest.raises(TypeError, match="function defined with def"):
        lessonlib.check_function(42, CHECKER)


@pytest.mark.unit
def test_load_function_names_what_is_missing(tmp_path):
    path = tmp_path / "solution.py"
    path.write_text("def present():\n    return 7\n")
    assert load_function(str(path), "present")() == 7
    with pytest.raises(SystemExit, match="defines no function 'absent'"):
        load_function(str(path), "absent")
    with pytest.raises(SystemExit, match="no such file"):
        load_function(str(tmp_path / "nope.py"), "present")
