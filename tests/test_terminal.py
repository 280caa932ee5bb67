"""`python -m lessonlib run` and `python -m lessonlib list`, started as a reader starts them: a real
subprocess, real torchrun, real lessons. Every run is bounded; a command that overruns is killed with
every process it started (found by a marker in their environment), and the autouse fixture in
conftest.py checks that no process of a launch outlived the test."""

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import HELPERS, ended_by, kill_processes, processes_with_env
from lessonlib import ROOT, RankOutput, run_bounded
from lessonlib.cli import catalog
from lessonlib.cli import main as terminal
from lessonlib.paths import chapter_files
from lessonlib.processes.bounded import kill_session, poll_until

HANG = HELPERS / "hang.py"
LESSONS = catalog.lesson_files()
MARK = "COURSE_TESTS_RUNNER_CLI"  # every process a runner test starts carries it, with a value of its own
RUN_LIMIT = 120  # seconds for one runner command
FAST = 20  # seconds for a command that starts no run (python start-up on a busy machine); timeouts are 3x


def kill_marked(value):
    kill_processes(processes_with_env(MARK, value))


def cli(*args, timeout=RUN_LIMIT, env=None):
    """`python -m lessonlib ARGS` from the repository root, bounded: (exit code, stdout, stderr, seconds)."""
    done = run_bounded(
        [sys.executable, "-m", "lessonlib", *args],
        timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        merge_output=False,
    )
    if done.timed_out:
        pytest.fail(
            f"python -m lessonlib {' '.join(args)} did not finish in {timeout} s:\n"
            f"{done.stdout[-3000:]}\n{(done.stderr or '')[-3000:]}"
        )
    return done.returncode, done.stdout, done.stderr, done.seconds


def shown(code, out, err):
    return f"exit {code}\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"


# --------------------------------------------------------------------------- help, list, import cost


def test_help_lists_the_subcommands():
    code, out, err, _ = cli("--help", timeout=FAST * 3)
    assert code == 0, shown(code, out, err)
    assert re.search(r"^\s+run\s", out, re.M) and re.search(r"^\s+list\s", out, re.M), out


def test_run_help_explains_itself_with_examples():
    code, out, err, _ = cli("run", "--help", timeout=FAST * 3)
    assert code == 0, shown(code, out, err)
    for needed in (
        "-n N, --nproc N",
        "--timeout SECONDS",
        "--columns",
        "examples:",
        "python -m lessonlib run lessons/01_launch.py -- --fail-rank 1",
        "after `--`",
        "exit status",
    ):
        assert needed in out, f"run --help does not say {needed!r}:\n{out}"


def test_list_and_help_do_not_import_torch():
    code = (
        "import sys, io, contextlib\n"
        "from lessonlib.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    assert main(['list']) == 0\n"
        "    for argv in (['--help'], ['run', '--help'], []):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'psutil')\n"
        "               or m in ('lessonlib.launcher.core', 'lessonlib.launcher.agents'))\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=FAST * 3)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"list/--help imported: {proc.stdout}"
    # The same seen from outside, as `python -X importtime -m lessonlib list` reports every import.
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lessonlib", "list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=FAST * 3,
    )
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "lessonlib.cli.main" in imported, proc.stderr[-2000:]
    assert not {m for m in imported if m.split(".")[0] == "torch"}, "python -m lessonlib list imported torch"


def test_list_shows_every_lesson_under_its_chapter():
    code, out, err, _ = cli("list", timeout=FAST * 3)
    assert code == 0, shown(code, out, err)
    lines = out.splitlines()
    headings = {}
    for notebook in chapter_files():
        cells = json.loads(notebook.read_text())["cells"]
        first = next(
            re.search(r"^#\s+(.+?)\s*$", "".join(c["source"]), re.M)
            for c in cells
            if c["cell_type"] == "markdown" and re.search(r"^#\s", "".join(c["source"]), re.M)
        )
        title = first.group(1).replace("`", "")
        matches = [i for i, line in enumerate(lines) if title in line and f"book/{notebook.name}" in line]
        assert len(matches) == 1, f"chapter heading {title!r} ({notebook.name}) not listed once:\n{out}"
        headings[int(notebook.name[:2])] = matches[0]
    assert list(headings.values()) == sorted(headings.values()), "chapters are not in order"
    for lesson in LESSONS:
        command = catalog.command_of(lesson)
        assert command, f"{lesson.name} has no docstring command"
        at = [i for i, line in enumerate(lines) if line.strip() == command]
        assert len(at) == 1, f"{lesson.name}: its command {command!r} is not listed once:\n{out}"
        chapter = int(lesson.name[:2])
        if chapter in headings:  # listed below its own chapter's heading, before the next one's
            later = [h for c, h in headings.items() if c > chapter]
            assert headings[chapter] < at[0] < min(later, default=len(lines)), f"{lesson.name} under the wrong chapter"
    assert f"{len(LESSONS)} lessons" in out


@pytest.mark.unit
def test_default_world_size_comes_from_the_docstring():
    assert terminal.check_script("lessons/02_collectives.py", None)[1] == 4
    assert terminal.check_script("lessons/01_launch.py", None)[1] == 2
    assert terminal.check_script("lessons/11_single.py", None)[1] == 1
    assert terminal.check_script(str(HANG), None)[1] == terminal.DEFAULT_NPROC  # no command in its docstring
    assert terminal.check_script("lessons/02_collectives.py", 3)[1] == 3


# --------------------------------------------------------------------------- bad input


def _syntax_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text('"""torchrun --nproc_per_node=2 broken.py"""\ndef main(:\n')
    return [str(bad)]


BAD = [
    ("-n 0", lambda _: ["run", "lessons/01_launch.py", "-n", "0"], "-n/--nproc: must be from 1 to 16"),
    ("-n 17", lambda _: ["run", "lessons/01_launch.py", "-n", "17"], "-n/--nproc: must be from 1 to 16"),
    ("-n two", lambda _: ["run", "lessons/01_launch.py", "-n", "two"], "whole number of ranks, 1 to 16"),
    ("negative timeout", lambda _: ["run", "lessons/01_launch.py", "--timeout", "-1"], "--timeout: must be a number"),
    ("missing script", lambda _: ["run", "lessons/99_no_such.py"], "lessons/99_no_such.py: no such file"),
    (
        "unknown option",
        lambda _: ["run", "lessons/01_launch.py", "--fail-rank", "1"],
        "options for the lesson go after `--`, e.g. python -m lessonlib run lessons/01_launch.py -- --fail-rank 1",
    ),
    ("not python", lambda _: ["run", "README.md"], "README.md: not a lesson"),
    ("syntax error", lambda tmp: ["run", *_syntax_error(tmp)], "not valid Python"),
    (
        "spawn script",
        lambda _: ["run", "lessons/11_spawn.py"],
        "run it as its docstring says: python lessons/11_spawn.py",
    ),
    ("one-process script", lambda _: ["run", "lessons/11_single.py", "-n", "2"], "-n must be 1"),
    ("no subcommand", lambda _: [], "usage: python -m lessonlib"),
]


@pytest.mark.parametrize("make_args, message", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_refused_before_anything_starts(make_args, message, tmp_path):
    code, out, err, _ = cli(*make_args(tmp_path), timeout=FAST * 3)
    assert code == 2, shown(code, out, err)
    assert message in err, shown(code, out, err)
    assert "Traceback" not in err, err
    started = re.search(r"^\[(rank \d+|torchrun|lessonlib)\]", out + err, re.M)
    assert not started, f"something started:\n{shown(code, out, err)}"


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def columns_run():
    """One 2-rank run of chapter 1's lesson with --columns in a 90-character terminal, for the two tests
    below (a torchrun launch costs some 8 CPU-seconds; CI's time is the budget)."""
    return cli("run", "lessons/01_launch.py", "-n", "2", "--columns", env={"COLUMNS": "90"})


def test_run_shows_every_rank_live_and_exits_0(columns_run):
    code, out, err, _ = columns_run
    assert code == 0, shown(code, out, err)
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}\] rank {rank}: RANK={rank} ", out, re.M), shown(code, out, err)
    assert re.search(r"^\[lessonlib\] ok: torchrun --nproc_per_node=2 lessons/01_launch.py", out, re.M), out


def test_columns_show_the_ranks_side_by_side_within_the_terminal_width(columns_run):
    code, out, err, _ = columns_run
    assert code == 0, shown(code, out, err)
    lines = out.splitlines()
    heads = [i for i, line in enumerate(lines) if re.match(r"rank 0 \(exit 0\)\s+\| rank 1 \(exit 0\)$", line)]
    assert len(heads) == 1, f"no column heading for ranks 0 and 1:\n{out}"
    assert heads[0] > max(i for i, line in enumerate(lines) if line.startswith("[rank ")), "columns before the end"
    table = lines[heads[0] :]
    assert all(len(line) <= 90 for line in table), "\n".join(line for line in table if len(line) > 90)
    assert any("rank 0: step 0 all_reduce = 1" in line and "rank 1: step 0 all_reduce = 1" in line for line in table), (
        out
    )


def test_a_failing_rank_is_named_last_on_stderr():
    code, out, err, _ = cli("run", "lessons/01_launch.py", "-n", "2", "--", "--fail-rank", "1")
    assert code == 1, shown(code, out, err)
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith("lessonlib run: lessons/01_launch.py failed on rank(s)"), shown(code, out, err)
    assert "rank 1 failed first with RuntimeError: rank 1: failing on purpose" in last, last
    # Above it, one line per rank: how it ended and where it was (the display's words, as in a notebook).
    assert re.search(
        r"^  rank 1 \(root cause\): RuntimeError: rank 1: failing on purpose.*; at lessons/01_launch\.py:\d+ in \w+",
        err,
        re.M,
    ), err
    assert re.search(r"^  rank 0: ", err, re.M), err
    # Each traceback once, as it came ([rank N]-prefixed); not a second copy at the end.
    assert "[rank 1] Traceback (most recent call last):" in err and "--- rank 1 traceback ---" not in err, err
    assert ".venv/lib/" not in out + err and str(ROOT) + "/" not in out + err, "a long path is shown"


@pytest.mark.unit
def test_columns_wrap_onto_rows_when_the_terminal_is_narrow():
    ranks = [RankOutput(r, stdout=f"rank {r} says " + "x" * 50 + "\nbye\n", exitcode=0, status="ok") for r in range(4)]
    text = terminal.render_columns(SimpleNamespace(ranks=ranks), 60)
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines), text
    assert re.match(r"rank 0 \(exit 0\)\s+\| rank 1 \(exit 0\)$", lines[0]), text  # two columns a row
    assert any(re.match(r"rank 2 \(exit 0\)\s+\| rank 3 \(exit 0\)$", line) for line in lines), text
    joined = "".join(line.split(" | ")[0].rstrip() for line in lines[2:5])
    assert ("rank 0 says " + "x" * 50).replace(" ", "") in joined.replace(" ", ""), text  # wrapped, not cut


@pytest.fixture
def hang_env(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    return {"TEST_TAG": uuid.uuid4().hex, "TEST_READY_DIR": str(ready)}, ready


# Each rank says it is ready, then sleeps: a run that only the timeout ends. No torch in the ranks, so
# they start at once; 40 s leaves torchrun's agent time to start them on a loaded 2-core machine.
SLEEPER_TIMEOUT = 40


def test_a_timeout_says_so_and_leaves_no_process(hang_env):
    env, ready = hang_env
    sleeper = HELPERS / "sleeper.py"
    code, out, err, seconds = cli("run", str(sleeper), "-n", "2", "--timeout", str(SLEEPER_TIMEOUT), env=env)
    assert code == terminal.EXIT_TIMEOUT, shown(code, out, err)
    assert sorted(os.listdir(ready)) == ["rank0.ready", "rank1.ready"], (
        f"the run timed out before the ranks were sleeping: {os.listdir(ready)}"
    )
    last = err.rstrip("\n").splitlines()[-1]
    assert "timed out after 40 s" in last and "rank(s) 0, 1 were still running" in last, shown(code, out, err)
    assert re.search(r"^\[rank 1\]\s+File .*sleeper\.py", err, re.M), err  # its stack, printed as it was stopped
    assert re.search(  # ...and where it was, in the line for rank 1
        r"^  rank 1: hung: still running at the 40 s timeout, then killed; at .*sleeper\.py:\d+ in <module>: "
        r"time\.sleep\(600\)$",
        err,
        re.M,
    ), err
    assert ended_by(SLEEPER_TIMEOUT, seconds), f"a {SLEEPER_TIMEOUT} s timeout took {seconds:.0f} s"
    assert processes_with_env("TEST_TAG", env["TEST_TAG"]) == []


def test_ctrl_c_exits_130_without_a_traceback_and_leaves_no_process(hang_env):
    env, ready = hang_env
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "lessonlib", "run", str(HANG), "-n", "2", "--timeout", "120"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # SIGINT at its default, as in a terminal. A process started with SIGINT ignored keeps it
        # ignored (Python installs no KeyboardInterrupt then), and the test suite can pass that on: run
        # as a background job of a non-interactive shell (`make test &` in a script), every process of
        # it starts with SIGINT ignored, and Ctrl-C would never reach the terminal.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env={**os.environ, **env, MARK: mark},
    )

    def stuck():
        assert proc.poll() is None, f"the runner ended early: exit {proc.returncode}"
        return all((ready / f).exists() for f in ("rank0.ready", "rank1.ready", "grandchild.pid"))

    try:
        poll_until(stuck, 90, interval=0.2, what=lambda: f"the ranks to be stuck (ready: {os.listdir(ready)})")
        assert len(processes_with_env("TEST_TAG", env["TEST_TAG"])) >= 4  # torchrun, 2 ranks, a grandchild
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends the runner (its ranks are in other sessions)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Where the runner is stuck is the evidence (it was waiting, its SIGINT ignored, above).
            stack = run_bounded([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(proc.pid)], 30)
            pytest.fail(f"the runner had not ended 60 s after SIGINT; its stack (py-spy):\n{stack.output}")
    finally:
        kill_session(proc)
        kill_marked(mark)
    assert proc.returncode == terminal.EXIT_INTERRUPTED, shown(proc.returncode, out, err)
    assert (
        err.rstrip("\n").splitlines()[-1] == "lessonlib run: interrupted (Ctrl-C); every process of the run was stopped"
    ), err
    assert "KeyboardInterrupt" not in err and 'File "' + terminal.__file__ not in err, err
    assert processes_with_env("TEST_TAG", env["TEST_TAG"]) == []
