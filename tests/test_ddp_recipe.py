"""lessons/recipes/test_ddp_step.py, the pytest file readers copy to test their own DDP step (chapter 11).

It is run as a reader runs it, `python -m pytest -q lessons/recipes/test_ddp_step.py` from the course
root, and it must pass (chapter 11 runs the same command with more reporting options and asserts it
passed: when the book build is in the same session and its record, lessonlib/book/launches.json, has
that run exiting 0, it stands for this one). A recipe whose tests cannot fail proves nothing,
so copies of it with a broken step must fail, each in the test that names the mistake: the loss
divided by the world size a second time (the gradient test), an update only rank 0 applies (the
replica test), a rank that hangs (killed at the recipe's time bound) and a rank that raises (the run
ends at once, not at the group timeout). No run may leave a process or a temporary file behind: each
runs with TMPDIR in a folder of its own, which must be empty afterwards, and processes it started that
are still alive when it exits fail the test.
"""

import re
import shlex
import subprocess
import sys

import pytest

from lessonlib import ROOT
from lessonlib.book import launchrecord
from lessonlib.processes.bounded import kill_session, marked_environment
from lessonlib.processes.marks import marked_processes
from test_lessons import BOOK, book_runs_in_this_session

RECIPE = ROOT / "lessons" / "recipes" / "test_ddp_step.py"
TIMEOUT = 240  # seconds for one pytest run of the recipe, a few of them in a row under load

PROCESS_TESTS = ("test_replicas_stay_equal", "test_gradient_matches_one_process")
ALL_TESTS = (*PROCESS_TESTS, "test_threaded_group_trains_as_one_process", "test_fake_group_builds_rank_7_of_8")

# One edit each: (name, [(text in the recipe, what replaces it)], tests selected, {test: outcome}).
LOSS = "    loss = F.mse_loss(model(x), y)\n"
STEP = "    optimizer.step()\n"
ZERO = "    optimizer.zero_grad(set_to_none=True)\n"
BROKEN = [
    (
        "loss_twice",
        [(LOSS, LOSS + "    loss = loss / dist.get_world_size() if dist.is_initialized() else loss\n")],
        ALL_TESTS,
        {
            "test_replicas_stay_equal": "PASSED",  # every rank applies the same, wrong, update
            "test_gradient_matches_one_process": "FAILED",
            "test_threaded_group_trains_as_one_process": "FAILED",
            "test_fake_group_builds_rank_7_of_8": "PASSED",
        },
    ),
    (
        "rank0_step",
        [(STEP, "    if not dist.is_initialized() or dist.get_rank() == 0:\n        optimizer.step()\n")],
        ALL_TESTS,
        {
            "test_replicas_stay_equal": "FAILED",
            "test_gradient_matches_one_process": "PASSED",  # the first step's gradients are still right
            "test_threaded_group_trains_as_one_process": "FAILED",
            "test_fake_group_builds_rank_7_of_8": "PASSED",
        },
    ),
    (
        "hang",
        [
            (ZERO, ZERO + "    if dist.get_rank() == 1:\n        time.sleep(3600)\n"),
            ("RUN_TIMEOUT = 120", "RUN_TIMEOUT = 5"),
        ],
        PROCESS_TESTS[:1],
        {"test_replicas_stay_equal": "ERROR"},
    ),
    (
        "crash",
        [(ZERO, ZERO + "    if dist.get_rank() == 1:\n        raise RuntimeError('rank 1 broke')\n")],
        PROCESS_TESTS[:1],
        {"test_replicas_stay_equal": "ERROR"},
    ),
]


def run_pytest(args, cwd, tmpdir):
    """`python -m pytest -q -rA ARGS` in cwd with TMPDIR=tmpdir, bounded by TIMEOUT: (exit code, output).
    Fails if a process it started outlives it or if it leaves anything in tmpdir."""
    tmpdir.mkdir()
    env, mark = marked_environment()
    env["TMPDIR"] = str(tmpdir)
    argv = [sys.executable, "-m", "pytest", "-q", "-rA", "--color=no", "-p", "no:cacheprovider", *args]
    log = tmpdir.parent / f"{tmpdir.name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT)
            leftovers = [" ".join(p.cmdline())[:200] for p in marked_processes(mark)]
        finally:
            kill_session(proc, mark)
    output = log.read_text()
    assert proc.returncode is not None and proc.returncode >= 0, f"pytest ran past {TIMEOUT} s:\n{output[-5000:]}"
    assert not leftovers, f"processes outlived `pytest {' '.join(args)}`: {leftovers}\n{output[-3000:]}"
    # torch's own compile cache (torchinductor_USER), made by the optimizer's first step, is shared by every
    # run of torch on the machine and reused: not a file the recipe leaves behind.
    left = sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))
    assert not left, f"`pytest {' '.join(args)}` left {left} in its temporary folder"
    return proc.returncode, output


def outcomes(output):
    """{(file stem, test name): PASSED | FAILED | ERROR | SKIPPED} from pytest's -rA summary."""
    found = {}
    for word, stem, test in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) (?:\S*/)?(\w+)\.py::(\w+)", output, re.M):
        found[(stem, test)] = word
    return found


# Options that change what pytest prints, not what it runs: a run with these and no others runs the recipe
# as a reader's `python -m pytest -q FILE` does.
REPORTING = re.compile(r"-q|-rA|--color=(no|yes|auto)|-p|no:cacheprovider|--durations(-min)?=[\d.]+")


def runs_the_recipe(command):
    """Whether `command` is `python -m pytest` run from the course root on the recipe alone, with options
    that change only what pytest prints."""
    words = shlex.split(command)
    if words[:3] != ["python", "-m", "pytest"]:
        return False
    rest = words[3:]
    recipe = str(RECIPE.relative_to(ROOT))
    return rest.count(recipe) == 1 and all(REPORTING.fullmatch(w) for w in rest if w != recipe)


def chapters_running_the_recipe(summary=BOOK):
    """The chapters whose recorded runs include the recipe, run as a reader runs it, exiting 0."""
    return sorted({chapter for command, chapter in summary.commands if runs_the_recipe(command)})


@pytest.mark.unit
def test_a_recorded_command_stands_for_the_recipe_only_when_it_runs_it_as_a_reader_does():
    recipe = "lessons/recipes/test_ddp_step.py"
    assert runs_the_recipe(f"python -m pytest -q {recipe}")
    assert runs_the_recipe(f"python -m pytest -q -rA --color=no -p no:cacheprovider --durations=0 {recipe}")
    for other in (
        f"python -m pytest -q {recipe} -k replicas",  # a part of it
        f"python -m pytest -q -x {recipe} {recipe}",
        f"python -m pytest -q {recipe}::test_replicas_stay_equal",
        f"python -m pytest -q tests/{recipe}",
        f"python {recipe}",
        f"python -m pytest -q -p no:randomly -p xdist {recipe}",
    ):
        assert not runs_the_recipe(other), other
    summary = launchrecord.Summary(commands=frozenset({(f"python -m pytest -q {recipe}", "11_end_to_end.ipynb")}))
    assert chapters_running_the_recipe(summary) == ["11_end_to_end.ipynb"]
    assert chapters_running_the_recipe(launchrecord.Summary()) == []


def test_the_recipe_passes_as_a_reader_runs_it(tmp_path, request):
    chapters = chapters_running_the_recipe()
    if chapters and book_runs_in_this_session(request):
        pytest.skip(f"the book build runs it: {chapters[0]} runs pytest on the recipe, which exits 0")
    code, output = run_pytest([str(RECIPE.relative_to(ROOT))], ROOT, tmp_path / "tmp")
    assert code == 0, f"the recipe failed on the step it ships with:\n{output[-5000:]}"
    assert outcomes(output) == {(RECIPE.stem, t): "PASSED" for t in ALL_TESTS}, output[-3000:]


def test_the_recipe_fails_a_broken_step(tmp_path):
    """One pytest run over four broken copies: each fails where it should, and only there."""
    recipe, args = RECIPE.read_text(), []
    for name, edits, tests, _ in BROKEN:
        text = recipe
        for old, new in edits:
            assert text.count(old) == 1, f"the recipe no longer has {old!r} exactly once: update BROKEN"
            text = text.replace(old, new)
        (tmp_path / f"test_{name}.py").write_text(text)
        args += [f"test_{name}.py::{test}" for test in tests]
    code, output = run_pytest(args, tmp_path, tmp_path / "tmp")
    assert code == 1, f"pytest exited {code}, not 1 (tests failed):\n{output[-5000:]}"
    want = {(f"test_{name}", test): outcome for name, _, _, expected in BROKEN for test, outcome in expected.items()}
    assert outcomes(output) == want, output[-6000:]
    # The messages name the mistake.
    assert "rank 0's gradient of 0.weight is not one process's" in output, output[-6000:]
    assert "rank 1's 0.weight differs from rank 0's" in output, output[-6000:]
    assert "the ranks ran past 5 s and were killed" in output, output[-6000:]
    crash = output[output.index("a rank failed:") :]  # rank 0 killed at once, not failed by the group timeout
    assert crash.index("--- rank 0 (exit -9)") < crash.index("RuntimeError: rank 1 broke"), crash[:5000]
