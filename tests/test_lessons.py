"""Every lesson script runs to the end on every rank at world sizes 1, 2, 3 and 4.

World size 1 runs the lesson the way the README's second command does, `python lessons/X.py`: with
none of torchrun's variables, so lessonlib.setup makes a process group of one rank (forked like the
ranks below; a script that is only ever run with `python` runs as that fresh command). World sizes 2
to 4 start one process per rank, each entering through lessonlib.launcher._rank_main (the
rank wrapper every launch uses: output files, start and exit records, a stack dump when asked) with
the environment lessonlib.launch and torchrun give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT on a reserved port, the run folder, ...), and the run folder is read into a RunResult by
the launcher's own code, so a failure here reads as it does in the book. Real processes and real
gloo, without a torchrun agent per run and without an `import torch` per rank: each rank is forked
from a server that has imported the third-party packages (tests/rankfork.py). That start-up is a
large share of a small lesson's CPU time, and CI's time is the budget. Chapter 1's lessons are about
torchrun itself and always run under it (lessonlib.launch), as does every launch in the book;
test_forked_ranks_fail_as_a_launch_fails runs one failing script both ways and compares.

A chapter that launches a lesson with its default arguments, every rank exiting 0, already runs that
lesson at that world size inside the book build. The build records what it ran, and
lessonlib/book/launches.json is the committed summary of that record (lessonlib.book.launchrecord),
which the book test checks against its own build. When the book build is part of the same pytest
session, such a pair is skipped here with the chapter named, instead of being run twice: CI time is
the budget the course lives within. Run this file alone and every pair runs.

Lessons are found by pattern, so a new lesson is tested the moment it is added. The command on a
lesson's first docstring line says how it starts: `torchrun --nproc_per_node=N lessons/X.py` (the
rule), `python lessons/X.py --world-size N` (a script that starts its own processes, with
torch.multiprocessing.spawn: run as that command for each world size) or `python lessons/X.py` (a
single-process script: run at world size 1 only).

That first line is also what the README tells readers to paste, so test_docstring_command_runs runs
it exactly as written (shlex.split; `torchrun` and `python` are the ones next to this interpreter; from
the repository root): real torchrun, real imports, no fork server. It replaces the run of the same
(lesson, world size) pair here, so the pair is not run twice. Where the book, in the same session,
launches that pair under torchrun with default options (lessonlib.launch runs torchrun's own agent),
the book's run stands for it; each lesson's command names the world size its chapter launches it at,
so that most commands are run once, by the book.
"""

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

import lessonlib
from conftest import HELPERS, line_of
from lessonlib import ROOT, run_bounded
from lessonlib.book import launchrecord
from lessonlib.cli import catalog
from lessonlib.cli.catalog import command_of
from lessonlib.launcher.request import TORCHRUN_ENV
from lessonlib.paths import LESSON_GLOB
from rankfork import run_plain, run_ranks

LESSONS = catalog.lesson_files()
WORLD_SIZES = (1, 2, 3, 4)  # 3: a world size that does not divide evenly
TIMEOUT = 180  # seconds per run
BOOK_TEST = "test_book_builds_and_executes_every_chapter"
# What the book build ran with default arguments and success: the runs it stands for (launchrecord).
BOOK = launchrecord.load()


def book_runs_in_this_session(request):
    """Whether the book test, which executes every chapter, is part of this pytest session."""
    return any(item.name == BOOK_TEST for item in request.session.items)


def kind_of(lesson):
    """'torchrun', 'spawn' or 'single', from the lesson's command (the catalog's reading of it)."""
    return catalog.kind_of(command_of(lesson))


def command_world_size(lesson):
    """The world size the lesson's command runs it at (1 when it names none)."""
    return catalog.nproc_of(command_of(lesson)) or 1


@pytest.mark.unit
def test_the_book_runs_that_stand_for_test_runs_name_what_exists():
    """Every run launches.json says the book makes is a lesson (or a command) and a chapter that exist, so
    that each skip below stands for a real run; the record of a build is checked against it by the book
    test, and the record itself in tests/test_launchrecord.py."""
    lessons = {f"lessons/{p.name}" for p in LESSONS}
    chapters = launchrecord.toc_chapters()
    assert BOOK.launches and BOOK.commands, f"{launchrecord.SUMMARY} names no run; {launchrecord.REWRITE}"
    for script, ranks, chapter in sorted(BOOK.launches):
        assert script in lessons or (ROOT / script).is_file(), f"{launchrecord.SUMMARY}: no file {script}"
        assert 1 <= ranks <= lessonlib.MAX_NPROC, f"{launchrecord.SUMMARY}: {script} at {ranks} ranks"
        assert chapter in chapters, f"{launchrecord.SUMMARY}: {chapter} is not in book/_toc.yml"
    for command, chapter in sorted(BOOK.commands):
        words = shlex.split(command)
        assert words[0] in PROGRAMS and any((ROOT / w).is_file() for w in words[1:]), (
            f"{launchrecord.SUMMARY}: `{command}` runs no file of the course"
        )
        assert chapter in chapters, f"{launchrecord.SUMMARY}: {chapter} is not in book/_toc.yml"
    # The docstring commands the book runs as written are found as the skips below look for them.
    spawn = ROOT / "lessons" / "11_spawn.py"
    if spawn.exists():
        assert BOOK.chapters_running(command_of(spawn)) == ["11_end_to_end.ipynb"], sorted(BOOK.commands)


def test_lessons_are_found():
    assert LESSONS, f"no lessons matched {ROOT / 'lessons' / LESSON_GLOB}"


@pytest.mark.unit
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_docstring_starts_with_the_command_that_runs_it(lesson):
    command, path = command_of(lesson), f"lessons/{lesson.name}"
    assert re.match(rf"(torchrun --nproc_per_node=\d+ |python ){re.escape(path)}(\s|$)", command), (
        f"{path}: the docstring's first line must be the command that runs it, `torchrun "
        f"--nproc_per_node=N {path} ...` or `python {path} ...`; it is {command!r}"
    )
    assert not re.search(r"[\[\]<>|]", command), (
        f"{path}: the docstring's first line must run as pasted into a shell; {command!r} has usage brackets "
        "(list the options on an `Options:` line below the summary instead)"
    )


COMMAND_TEST = "test_docstring_command_runs"
PROGRAMS = {"python": sys.executable, "torchrun": str(Path(sys.executable).with_name("torchrun"))}


def run_command(command, tmp_path):
    """Run a shell command line as a reader pastes it at the repository root with .venv activated:
    `python` and `torchrun` are the ones next to this interpreter. Bounded, and every process it
    started killed at the end (lessonlib.run_bounded: torchrun puts its workers in sessions of
    their own, so killing the command's process group alone would not reach them).

    Nothing else differs from a reader's shell: a one-node torchrun with no --master-port picks a free
    port itself (torch 2.14.1 turns it into a c10d rendezvous on localhost:0, with a run id of its own),
    so the commands pytest-xdist runs at once cannot take each other's port."""
    argv = shlex.split(command)
    if argv[0] not in PROGRAMS:
        pytest.fail(f"the command must start with {' or '.join(PROGRAMS)}: {command!r}")
    argv[0] = PROGRAMS[argv[0]]
    if not Path(argv[0]).is_file():
        pytest.fail(f"{argv[0]} is missing: is torch installed in this environment ({sys.prefix})?")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env["TMPDIR"] = str(tmp_path)  # torchrun's torchelastic_* log folder lands here, not in /tmp for good
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # as activate does
    done = run_bounded(argv, TIMEOUT, cwd=ROOT, env=env)
    if done.timed_out:
        pytest.fail(
            f"`{command}` did not finish in {TIMEOUT} s (killed, with every process it started):\n{done.output[-5000:]}"
        )
    return done.returncode, done.output


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_docstring_command_runs(lesson, request, tmp_path):
    # What the README tells readers to paste, run as pasted: real torchrun (or python), no fork server.
    # Where the book, in the same session, launches the lesson at the command's world size with default
    # options, that run (torchrun through lessonlib.launch) stands for it: a bare torchrun start, each rank
    # importing torch afresh, costs some 8-12 CPU-seconds. The command's form is checked for every lesson
    # above, and this file run alone runs all of them.
    command = command_of(lesson)
    chapters = BOOK.chapters_launching(f"lessons/{lesson.name}", command_world_size(lesson))
    if (
        chapters
        and command.startswith("torchrun ")
        and len(shlex.split(command)) == 3
        and book_runs_in_this_session(request)
    ):
        pytest.skip(
            f"the book build runs it: {chapters[0]} launches {lesson.name} at {command_world_size(lesson)} "
            f"ranks under torchrun with default options, as `{command}` does, and every rank exits 0"
        )
    chapters = BOOK.chapters_running(command)
    if chapters and book_runs_in_this_session(request):
        pytest.skip(f"the book build runs it: {chapters[0]} runs `{command}`, which exits 0")
    code, out = run_command(command, tmp_path)
    assert code == 0, f"`{command}` (the first line of {lesson.name}'s docstring) exited {code}:\n{out[-5000:]}"


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"np{n}")
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs(lesson, world_size, request, tmp_path):
    if world_size == command_world_size(lesson) and any(
        item.name == f"{COMMAND_TEST}[{lesson.stem}]" for item in request.session.items
    ):
        pytest.skip(f"{COMMAND_TEST} runs it at {world_size} rank(s), as its command: `{command_of(lesson)}`")
    # World size 1 here is plain `python lessons/X.py`, which a one-rank torchrun launch in the book is not.
    chapters = BOOK.chapters_launching(f"lessons/{lesson.name}", world_size) if world_size > 1 else []
    if chapters and book_runs_in_this_session(request):
        pytest.skip(
            f"the book build runs it: {chapters[0]} launches {lesson.name} at {world_size} ranks with "
            f"default arguments, and every rank exits 0"
        )
    kind = kind_of(lesson)
    if kind == "single" and world_size > 1:
        pytest.skip(f"a single-process script (its command is `{command_of(lesson)}`): world size 1 only")
    if kind == "spawn":
        code, out = run_plain(lesson, ["--world-size", str(world_size)])
        assert code == 0, f"python {lesson.name} --world-size {world_size} exited {code}:\n{out[-5000:]}"
        return
    if world_size == 1:
        run = run_ranks(lesson, 1, tmp_path, plain=True)
        assert run.ok, run.describe_failure()
        return
    if lesson.name.startswith("01_"):
        run = lessonlib.launch(lesson, nproc=world_size, timeout=TIMEOUT, show="none")
        assert run.ok, run.describe_failure()
        assert [r.exitcode for r in run.ranks] == [0] * world_size, run.describe_failure()
        return
    run = run_ranks(lesson, world_size, tmp_path)
    assert run.ok, run.describe_failure()


def test_a_lesson_missing_an_import_of_its_own_fails(tmp_path):
    """The fork server preloads third-party packages only, so the ranks import lessonlib's modules as a
    fresh `python` does: a lesson that uses lessonlib.training after a bare `import lessonlib` fails
    here, as it fails for a reader; with the import it passes."""
    body = (
        "import lessonlib{extra}\n\nctx = lessonlib.setup(device='cpu')\ntry:\n"
        "    lessonlib.training.mlp()\nfinally:\n    lessonlib.teardown()\n"
    )
    missing = tmp_path / "99_missing_import.py"
    missing.write_text(body.format(extra=""))
    code, out = run_plain(missing)
    assert code != 0 and "has no attribute 'training'" in out, f"exit {code}:\n{out[-3000:]}"
    run = run_ranks(missing, 2, tmp_path / "np2")
    assert run.failed_ranks == [0, 1], run.describe_failure()
    assert all("has no attribute 'training'" in r.error for r in run.ranks), run.describe_failure()
    fixed = tmp_path / "99_with_import.py"
    fixed.write_text(body.format(extra="\nimport lessonlib.training"))
    run = run_ranks(fixed, 2, tmp_path / "fixed")
    assert run.ok, run.describe_failure()


def test_forked_ranks_fail_as_a_launch_fails(tmp_path):
    """The same failing script through the test's forked ranks and through lessonlib.launch (torchrun):
    both name rank 1 as the root cause with its ValueError and its traceback in the script, and rank 0
    as failed after it (whether it noticed the lost peer or was stopped first)."""
    script = HELPERS / "rank1_fails.py"
    forked = run_ranks(script, 2, tmp_path / "forked")
    launched = lessonlib.launch(script, nproc=2, timeout=TIMEOUT, show="none")
    for run in (forked, launched):
        text = run.describe_failure()
        assert not run.ok and run.failed_ranks == [0, 1] and run.root_cause.rank == 1, text
        assert run.root_cause.error == "ValueError: rank 1 gives up", text
        assert text.startswith(f"{run.script} failed on rank(s) 0, 1 of 2:\n  rank 0"), text
        assert "\n  rank 1 (root cause): ValueError: rank 1 gives up" in text, text
        assert "\nFirst failure (root cause): rank 1 exited 1" in text, text
        assert f'{script.name}", line {line_of(script, "raise ValueError")}, in <module>' in run.root_cause.traceback, (
            text
        )
        assert "_rank_main" not in run.root_cause.traceback, text  # it reads as under a bare torchrun
        assert run.ranks[0].stdout == "rank 0 up\n", text


def test_forked_ranks_time_out_as_a_launch_does(tmp_path):
    """A hang, both ways: at the deadline each rank prints where it waits (the rank wrapper's
    faulthandler, asked by the same dump_stacks_then_kill), and every process is gone afterwards."""
    script = HELPERS / "rank1_hangs.py"
    where = {0: line_of(script, "dist.barrier()"), 1: line_of(script, "time.sleep(600)")}
    # Bounds that a loaded 2-core machine still meets with the ranks inside the hang: the launch starts a
    # torchrun agent, which imports torch before any rank exists, while the book builds beside it.
    forked = run_ranks(script, 2, tmp_path / "forked", timeout=30)
    launched = lessonlib.launch(script, nproc=2, timeout=60, show="none")
    for run in (forked, launched):
        text = run.describe_failure()
        assert run.timed_out and [r.status for r in run.ranks] == ["hung", "hung"], text
        assert "rank(s) 0, 1 were still running and were killed" in text, text
        for rank, line in where.items():
            assert f'{script.name}", line {line} in <module>' in text.split(f"--- rank {rank} stack ---")[1], text
