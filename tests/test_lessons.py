"""Every lesson script runs to the end on every rank at world sizes 1, 2, 3 and 4.

World size 1 runs the lesson the way the README's second command does, `python lessons/X.py`: as
`__main__`, with none of torchrun's variables, so lessonlib.setup makes a process group of one rank
(forked from the same server as the ranks below, which saves the imports per lesson). World sizes 2
to 4 start one process per rank that runs the lesson file as `__main__` with the environment
torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT on a reserved
port, ...): real processes and real gloo, without a torchrun agent per run and without an `import
torch` per rank (each rank is forked from a server that has imported it: tests/rankfork.py). That
start-up is a large share of a small lesson's CPU time, and CI's time is the budget. Chapter 1's
lessons are about torchrun itself and always run under it (lessonlib.launch), as does every launch
in the book; the launcher tests cover torchrun's own behaviour.

A chapter that launches a lesson with its default arguments and `.raise_for_status()` already runs
that lesson at that world size, every rank to exit 0, inside the book build. When the book build is
part of the same pytest session, such a pair is skipped here with the chapter named, instead of being
run twice: CI time is the budget the course lives within. Run this file alone and every pair runs.

Lessons are found by pattern, so a new lesson is tested the moment it is added. The command on a
lesson's first docstring line says how it starts: `torchrun --nproc_per_node=N lessons/X.py` (the
rule), `python lessons/X.py --world-size N` (a script that starts its own processes, with
torch.multiprocessing.spawn: run as that command for each world size) or `python lessons/X.py` (a
single-process script: run at world size 1 only).

That first line is also what the README tells readers to paste, so test_docstring_command_runs runs
it exactly as written (shlex.split; `torchrun` and `python` are the ones next to this interpreter; from
the repository root): real torchrun, real imports, no fork server. It replaces the run of the same
(lesson, world size) pair here, so the pair is not run twice, and it runs even where the book launches
that pair, since the book goes through lessonlib.launch, not the pasted command.
"""

import ast
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import lessonlib
import rankfork
from conftest import COMMAND_VAR, kill_processes, processes_with_env

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted(ROOT.glob("lessons/[0-9][0-9]_*.py"))
WORLD_SIZES = (1, 2, 3, 4)  # 3: a world size that does not divide evenly
TIMEOUT = 180  # seconds per run
BOOK_TEST = "test_book_builds_and_executes_every_chapter"
# Only this exact shape counts: default arguments, and the run's success asserted on the spot.
BOOK_LAUNCH = re.compile(r'lessonlib\.launch\(\s*"lessons/(\w+)\.py",\s*nproc=(\d+),\s*timeout=\d+,?\s*'
                         r'(?:show="\w+",?\s*)?\)\.raise_for_status\(\)')
# A run panel made with no lesson options and run at once in the same cell is the same launch.
BOOK_PANEL = re.compile(r'lessonlib\.panel\(\s*"lessons/(\w+)\.py",\s*nproc=(\d+)(?:,\s*timeout=\d+)?'
                        r'(?:,\s*plot=\w+)?(?:,\s*plot_alt=\w+)?\)(?=[\s\S]*\bpanel\.run\(\)\.raise_for_status\(\))')


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
                source = "".join(cell["source"])
                for lesson, n in BOOK_LAUNCH.findall(source) + BOOK_PANEL.findall(source):
                    runs.setdefault((lesson, int(n)), notebook.name)
    return runs


BOOK_RUNS = book_runs()


def command_of(lesson):
    """The command on the first line of the lesson's docstring."""
    doc = ast.get_docstring(ast.parse(lesson.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def kind_of(lesson):
    """'torchrun', 'spawn' (python ... --world-size N) or 'single' (python ...), from its command."""
    command = command_of(lesson)
    if command.startswith("torchrun "):
        return "torchrun"
    return "spawn" if "--world-size" in command else "single"


def command_world_size(lesson):
    """The world size the lesson's command runs it at: N of --nproc_per_node=N or --world-size N, else 1."""
    m = re.search(r"--nproc_per_node=(\d+)|--world-size[= ](\d+)", command_of(lesson))
    return int(m.group(1) or m.group(2)) if m else 1


def test_lessons_are_found():
    assert LESSONS, f"no lessons matched {ROOT / 'lessons/[0-9][0-9]_*.py'}"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_docstring_starts_with_the_command_that_runs_it(lesson):
    command, path = command_of(lesson), f"lessons/{lesson.name}"
    assert re.match(rf"(torchrun --nproc_per_node=\d+ |python ){re.escape(path)}(\s|$)", command), (
        f"{path}: the docstring's first line must be the command that runs it, `torchrun "
        f"--nproc_per_node=N {path} ...` or `python {path} ...`; it is {command!r}")
    assert not re.search(r"[\[\]<>|]", command), (
        f"{path}: the docstring's first line must run as pasted into a shell; {command!r} has usage brackets "
        "(list the options on an `Options:` line below the summary instead)")


COMMAND_TEST = "test_docstring_command_runs"
PROGRAMS = {"python": sys.executable, "torchrun": str(Path(sys.executable).with_name("torchrun"))}


def run_command(command, tmp_path):
    """Run a shell command line as a reader pastes it at the repository root with .venv activated:
    `python` and `torchrun` are the ones next to this interpreter. In a session of its own, bounded;
    at the end every process that carries its marker is killed (torchrun puts its workers in sessions
    of their own, so killing the command's process group alone would not reach them).

    One thing differs from a reader's shell: torchrun without --standalone rendezvous on port 29500,
    and pytest-xdist runs several commands at once, so PET_MASTER_PORT (torchrun reads any option from
    PET_<OPTION>) gives each run a reserved free port instead. The command line stays as written."""
    argv = shlex.split(command)
    if argv[0] not in PROGRAMS:
        pytest.fail(f"the command must start with {' or '.join(PROGRAMS)}: {command!r}")
    argv[0] = PROGRAMS[argv[0]]
    if not Path(argv[0]).is_file():
        pytest.fail(f"{argv[0]} is missing: is torch installed in this environment ({sys.prefix})?")
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env[COMMAND_VAR] = marker
    env["TMPDIR"] = str(tmp_path)  # torchrun's torchelastic_* log folder lands here, not in /tmp for good
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # as activate does
    timed_out = False
    with lessonlib.reserve_port() as port:
        env["PET_MASTER_PORT"] = str(port)
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            kill_processes(processes_with_env(COMMAND_VAR, marker))
    if timed_out:
        out, _ = proc.communicate()
        pytest.fail(f"`{command}` did not finish in {TIMEOUT} s (killed, with every process it started):\n"
                    f"{out[-5000:]}")
    return proc.returncode, out


def run_plain(lesson, args=()):
    """`python lesson.py [args]` in its own session, bounded; the whole session is killed on timeout."""
    proc = subprocess.Popen([sys.executable, str(lesson), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"python {lesson.name} did not finish in {TIMEOUT} s:\n{out[-3000:]}")
    return proc.returncode, out


TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT")


def run_alone(lesson, tmp_path):
    """`python lesson.py`: the lesson as __main__ with none of torchrun's variables, so lessonlib.setup
    takes its one-rank path, in a process forked from the server that has imported torch (as
    run_ranks does); bounded, its session killed at the deadline after it printed its stack."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env["PYTHONUNBUFFERED"] = "1"
    log = tmp_path / "alone.log"
    proc = rankfork.start_rank(lesson, ROOT, env, log)
    proc.join(TIMEOUT)
    timed_out = proc.exitcode is None
    rankfork.kill_rank(proc, dump_stack=timed_out)
    out = log.read_text(errors="replace") if log.exists() else ""
    if timed_out:
        pytest.fail(f"python {lesson.name} did not finish in {TIMEOUT} s; its stack when killed:\n{out[-5000:]}")
    return proc.exitcode, out


def run_ranks(lesson, world_size, tmp_path):
    """One process per rank with torchrun's environment, all bounded; every rank's exit code and output.

    The ranks are forked from a server that has imported torch already (tests/rankfork.py). When a
    rank fails, the others get a few seconds and are then killed, so a rank left waiting in a
    collective for a partner that died cannot hold the test until the process-group timeout. A rank
    still running at the deadline prints its Python stack before it is killed.
    """
    import torch.distributed as dist  # here, not at the top: only this path needs torch in the test process

    logs = [tmp_path / f"rank{rank}.log" for rank in range(world_size)]
    procs, timed_out = [], False
    with lessonlib.reserve_port() as port:
        # The test process hosts the rendezvous store, as torchrun's agent does: the ranks connect at once
        # instead of retrying, with growing pauses, until rank 0 has opened one.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "OMP_NUM_THREADS": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "PYTHONUNBUFFERED": "1"}
        try:
            for rank in range(world_size):
                env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                procs.append(rankfork.start_rank(lesson, ROOT, env, logs[rank]))
            deadline, failed_at = time.monotonic() + TIMEOUT, None
            while any(p.exitcode is None for p in procs):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() > failed_at + 5:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                rankfork.kill_rank(p, dump_stack=timed_out)
            del store
    outputs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    if timed_out:
        outputs = [f"(still running after {TIMEOUT} s; its stack when killed is at the end)\n{o}" for o in outputs]
    return [p.exitcode for p in procs], outputs


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_docstring_command_runs(lesson, request, tmp_path):
    # What the README tells readers to paste, run as pasted: real torchrun (or python), no fork server.
    # Where the book, in the same session, launches the lesson at the command's world size with default
    # options, that run (torchrun through lessonlib.launch) stands for it: a torchrun start costs some
    # 8-12 CPU-seconds, and 40 of them would push CI past its budget. The command's form is checked for
    # every lesson above, and this file run alone runs all of them.
    command = command_of(lesson)
    chapter = BOOK_RUNS.get((lesson.stem, command_world_size(lesson)))
    if chapter and command.startswith("torchrun ") and len(shlex.split(command)) == 3 and any(
            item.name == BOOK_TEST for item in request.session.items):
        pytest.skip(f"the book build runs it: {chapter} launches {lesson.name} at {command_world_size(lesson)} "
                    f"ranks under torchrun with default options, as `{command}` does")
    code, out = run_command(command, tmp_path)
    assert code == 0, f"`{command}` (the first line of {lesson.name}'s docstring) exited {code}:\n{out[-5000:]}"


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"np{n}")
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs(lesson, world_size, request, tmp_path):
    if world_size == command_world_size(lesson) and any(
            item.name == f"{COMMAND_TEST}[{lesson.stem}]" for item in request.session.items):
        pytest.skip(f"{COMMAND_TEST} runs it at {world_size} rank(s), as its command: `{command_of(lesson)}`")
    # World size 1 here is plain `python lessons/X.py`, which a one-rank torchrun launch in the book is not.
    chapter = BOOK_RUNS.get((lesson.stem, world_size)) if world_size > 1 else None
    if chapter and any(item.name == BOOK_TEST for item in request.session.items):
        pytest.skip(f"the book build runs it: {chapter} launches {lesson.name} at {world_size} ranks with "
                    f"default arguments and raise_for_status()")
    kind = kind_of(lesson)
    if kind == "single" and world_size > 1:
        pytest.skip(f"a single-process script (its command is `{command_of(lesson)}`): world size 1 only")
    if kind == "spawn":
        code, out = run_plain(lesson, ["--world-size", str(world_size)])
        assert code == 0, f"python {lesson.name} --world-size {world_size} exited {code}:\n{out[-5000:]}"
        return
    if world_size == 1:
        code, out = run_alone(lesson, tmp_path)
        assert code == 0, f"python {lesson.name} exited {code}:\n{out[-5000:]}"
        return
    if lesson.name.startswith("01_"):
        run = lessonlib.launch(lesson, nproc=world_size, timeout=TIMEOUT, show="none")
        assert run.ok, run.describe_failure()
        assert [r.exitcode for r in run.ranks] == [0] * world_size, run.describe_failure()
        return
    codes, outputs = run_ranks(lesson, world_size, tmp_path)
    failed = [r for r, c in enumerate(codes) if c != 0]
    assert not failed, "\n".join(f"--- rank {r}: exit {codes[r]}\n{outputs[r][-4000:]}" for r in failed)


def test_a_lesson_missing_an_import_of_its_own_fails(tmp_path):
    """The fork server preloads third-party packages only, so the ranks import lessonlib's modules as a
    fresh `python` does: a lesson that uses lessonlib.training after a bare `import lessonlib` fails
    here, as it fails for a reader; with the import it passes."""
    body = ("import lessonlib{extra}\n\nctx = lessonlib.setup(device='cpu')\ntry:\n"
            "    lessonlib.training.mlp()\nfinally:\n    lessonlib.teardown()\n")
    missing = tmp_path / "99_missing_import.py"
    missing.write_text(body.format(extra=""))
    code, out = run_alone(missing, tmp_path)
    assert code != 0 and "has no attribute 'training'" in out, f"exit {code}:\n{out[-3000:]}"
    codes, outputs = run_ranks(missing, 2, tmp_path)
    assert all(c != 0 for c in codes) and all("has no attribute 'training'" in o for o in outputs), (codes, outputs)
    fixed = tmp_path / "99_with_import.py"
    fixed.write_text(body.format(extra="\nimport lessonlib.training"))
    codes, outputs = run_ranks(fixed, 2, tmp_path)
    assert codes == [0, 0], outputs
