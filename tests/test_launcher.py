"""lessonlib.launch with real torchrun, real ranks and real gloo: capture, failure, hangs, input checks.

Every launch here costs seconds on a 2-core machine, so one launch serves several assertions where the
assertions are about the same run (module-scoped fixtures).
"""

import html
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

import lessonlib
from conftest import HELPERS, ended_by, processes_with_env
from lessonlib import ROOT, run_bounded
from lessonlib.launcher.fastpath import forkrank
from lessonlib.processes.bounded import poll_until
from lessonlib.processes.marks import MARKS_VAR

PRINT_LINES = HELPERS / "print_lines.py"
HANG = HELPERS / "hang.py"
LAUNCH_LESSON = "lessons/01_launch.py"
LEGACY_LESSON = "lessons/01_legacy_launch.py"
CAPTURE_LINES = 25


def marker_line(path, marker):
    """The 1-based number of the line of `path` that contains `marker` (exactly one must)."""
    hits = [i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if marker in line]
    assert len(hits) == 1, f"{path}: expected one line with {marker!r}, found {hits}"
    return hits[0]


def expected_lines(rank, stream, n):
    return [f"rank {rank} {stream} {i}" for i in range(n)]


def alive_with_env(pids, name, value):
    """Those of `pids` that still run (non-zombie) and carry name=value (a reused pid would not)."""
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(name) == value:
                alive.append(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return alive


def wait_for_files(paths, timeout, proc=None):
    """Wait until every path exists; fail after `timeout` seconds or if `proc` exits first."""

    def missing():
        return [str(p) for p in paths if not Path(p).exists()]

    def ready():
        if not missing():
            return True
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate(timeout=10)
            pytest.fail(f"launcher process exited {proc.returncode} before the ranks were ready:\n{err}")
        return False

    poll_until(ready, timeout, what=lambda: f"the ranks to be ready; missing {missing()}")


# --------------------------------------------------------------------------- capture and rendering


@pytest.fixture(scope="module")
def capture_run():
    run = lessonlib.launch(PRINT_LINES, nproc=2, args=["--lines", CAPTURE_LINES], timeout=90, show="none")
    assert run.ok, run.describe_failure()
    return run


def test_each_rank_keeps_its_own_lines_in_order(capture_run):
    for r in capture_run.ranks:
        html_line = f'rank {r.rank} says <b>&"bold"</b>'
        assert r.stdout.splitlines() == expected_lines(r.rank, "out", CAPTURE_LINES) + [html_line], (
            f"rank {r.rank} stdout:\n{r.stdout}"
        )
        assert r.stderr.splitlines() == expected_lines(r.rank, "err", CAPTURE_LINES), (
            f"rank {r.rank} stderr:\n{r.stderr}"
        )


def test_torchrun_banner_is_kept_apart_from_the_ranks(capture_run):
    assert "OMP_NUM_THREADS" in capture_run.launcher_output, capture_run.launcher_output
    for r in capture_run.ranks:
        assert "OMP_NUM_THREADS" not in r.stdout + r.stderr, f"torchrun's banner in rank {r.rank}'s output"
    # ... and no rank's line leaked into torchrun's own output either.
    assert "rank 0 out 0" not in capture_run.launcher_output


def test_reports_come_back_per_rank(capture_run):
    assert capture_run.reports("printed") == [
        (0, {"rank": 0, "lines": CAPTURE_LINES}),
        (1, {"rank": 1, "lines": CAPTURE_LINES}),
    ]
    assert capture_run.reports("no such tag") == []
    assert capture_run.reports_by_rank("printed") == {
        0: [{"rank": 0, "lines": CAPTURE_LINES}],
        1: [{"rank": 1, "lines": CAPTURE_LINES}],
    }
    assert capture_run.reports_by_rank("no such tag") == {0: [], 1: []}


def test_text_and_html_views_show_every_rank(capture_run):
    text, page = str(capture_run), capture_run._repr_html_()
    assert text.splitlines()[0].startswith("ok:"), text
    for r in capture_run.ranks:
        for line in r.stdout.splitlines():
            assert f"[rank {r.rank}] {line}" in text
            assert html.escape(line) in page, f"rank {r.rank} line {line!r} missing from the HTML view"
        for line in r.stderr.splitlines():
            assert f"[rank {r.rank}:stderr] {line}" in text
            assert html.escape(line) in page
    # Every rank printed, so no column says it printed nothing (the browser test sees that note where a
    # chapter's lesson prints from rank 0 only).
    assert "lessonlib-quiet" not in page
    # Printed markup is shown as text, never interpreted.
    assert "<b>&" not in page and "&lt;b&gt;&amp;&quot;bold&quot;&lt;/b&gt;" in page


@pytest.mark.timeout(180)
def test_100k_lines_per_rank_complete_and_ordered():
    n = 100_000
    run = lessonlib.launch(PRINT_LINES, nproc=2, args=["--lines", n], timeout=120, show="none")
    assert run.ok, run.describe_failure()
    for r in run.ranks:
        out, err = r.stdout.splitlines(), r.stderr.splitlines()
        assert len(out) == n + 1 and len(err) == n, f"rank {r.rank}: {len(out)} stdout, {len(err)} stderr lines"
        assert out[:n] == expected_lines(r.rank, "out", n), f"rank {r.rank}: stdout lines lost or out of order"
        assert err == expected_lines(r.rank, "err", n), f"rank {r.rank}: stderr lines lost or out of order"


# --------------------------------------------------------------------------- failures


def test_failing_rank_is_named_as_root_cause():
    run = lessonlib.launch(LAUNCH_LESSON, nproc=3, args=["--fail-rank", "1"], timeout=90, show="none")
    assert not run.ok
    assert 1 in run.failed_ranks
    assert run.root_cause is not None and run.root_cause.rank == 1, run.describe_failure()
    assert "failing on purpose" in run.ranks[1].traceback
    with pytest.raises(lessonlib.LaunchError) as caught:
        run.raise_for_status()
    message = str(caught.value)
    # One line per rank first, how it ended and where: rank 1 raised in the lesson's own code.
    lines = message.splitlines()
    assert [ln.split(":", 1)[0].strip() for ln in lines[1:4]] == ["rank 0", "rank 1 (root cause)", "rank 2"], message
    assert re.match(
        r"  rank 1 \(root cause\): RuntimeError: .*failing on purpose.*; at lessons/01_launch\.py:\d+ in ", lines[2]
    )
    assert re.search(r"First failure \(root cause\): rank 1\b", message), message
    assert "failing on purpose" in message
    assert "Traceback (most recent call last)" in message, message
    assert caught.value.result is run


HANG_TIMEOUT = 40  # the 3 ranks must be up and stuck before it strikes, on a heavily loaded machine


@pytest.fixture(scope="module")
def hung_run():
    """A 3-rank run that hangs (rank 1 sleeps, 0 and 2 wait in a barrier, rank 0 has a grandchild),
    ended by a 20 s timeout: long enough for three ranks to reach their hanging lines on a busy 2-core
    machine (pytest-xdist runs other launches beside this one), short enough to keep the test quick."""
    tag = uuid.uuid4().hex
    with tempfile.TemporaryDirectory() as ready:
        t0 = time.monotonic()
        run = lessonlib.launch(
            HANG, nproc=3, timeout=HANG_TIMEOUT, env={"TEST_TAG": tag, "TEST_READY_DIR": ready}, show="none"
        )
        elapsed = time.monotonic() - t0
        ready_files = sorted(os.listdir(ready))
        grandchild = int((Path(ready) / "grandchild.pid").read_text()) if "grandchild.pid" in ready_files else None
    return {"run": run, "tag": tag, "elapsed": elapsed, "ready": ready_files, "grandchild": grandchild}


def test_timeout_is_reported_and_bounded(hung_run):
    run = hung_run["run"]
    # Without this the timeout would have struck during start-up, and the test would prove little.
    assert hung_run["ready"] == ["grandchild.pid", "rank0.ready", "rank1.ready", "rank2.ready"], hung_run["ready"]
    assert run.timed_out and not run.ok
    assert run.timeout == HANG_TIMEOUT and ended_by(HANG_TIMEOUT, hung_run["elapsed"]), (
        f"timeout {HANG_TIMEOUT} s, launch returned after {hung_run['elapsed']:.1f} s"
    )
    assert ended_by(HANG_TIMEOUT, run.wall_time), f"timeout {HANG_TIMEOUT} s, wall time {run.wall_time:.1f} s"
    assert [r.status for r in run.ranks] == ["hung"] * 3
    with pytest.raises(lessonlib.LaunchError, match=f"timed out after {HANG_TIMEOUT} s"):
        run.raise_for_status()


def test_timeout_prints_each_hung_ranks_stack(hung_run):
    run = hung_run["run"]
    lines = {
        1: marker_line(HANG, "# HANG-SLEEP"),
        0: marker_line(HANG, "# HANG-BARRIER"),
        2: marker_line(HANG, "# HANG-BARRIER"),
    }
    for rank, line in lines.items():
        stderr = run.ranks[rank].stderr
        assert "most recent call first" in stderr, f"rank {rank} printed no stack:\n{stderr}"
        assert re.search(rf'hang\.py", line {line} in main', stderr), (
            f"rank {rank}'s stack does not name hang.py line {line}:\n{stderr}"
        )
        # The failure message carries the stacks too.
        assert f"--- rank {rank} stack ---" in run.describe_failure()


def test_timeout_kills_the_whole_tree(hung_run, leak_scan):
    run, tag = hung_run["run"], hung_run["tag"]
    assert run.leftovers == [], f"the launcher found survivors after its own kill: {run.leftovers}"
    assert processes_with_env("TEST_TAG", tag) == []
    pids = [r.pid for r in run.ranks] + run.agent_pids + [hung_run["grandchild"]]
    assert None not in pids, pids
    assert alive_with_env(pids, "TEST_TAG", tag) == []
    assert leak_scan() == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("interrupts", [1, 4], ids=["one Ctrl-C", "Ctrl-C during cleanup too"])
def test_interrupt_kills_the_run(tmp_path, interrupts):
    tag = uuid.uuid4().hex
    # The run's temporary folder goes to a TMPDIR of its own: other tests' launches (pytest-xdist runs
    # them at the same time) make and remove lessonlib-* folders in the shared one meanwhile.
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # even if SIGINT was ignored
        "import lessonlib\n"
        f"lessonlib.launch({str(HANG)!r}, nproc=2, timeout=120, show='none',\n"
        f"                 env={{'TEST_TAG': {tag!r}, 'TEST_READY_DIR': {str(tmp_path)!r}}})\n"
        "print('launch returned instead of raising')\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(own_tmp)},
    )
    try:
        wait_for_files(
            [tmp_path / "rank0.ready", tmp_path / "rank1.ready", tmp_path / "grandchild.pid"], timeout=60, proc=child
        )
        running = processes_with_env("TEST_TAG", tag)
        assert len(running) >= 4, f"expected agent, 2 ranks and a grandchild; found {running}"
        for _ in range(interrupts):  # more than one: the later ones land while the launcher cleans up
            if child.poll() is None:
                os.kill(child.pid, signal.SIGINT)
            time.sleep(0.05)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=10)
    assert child.returncode != 0, f"exit {child.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    assert "KeyboardInterrupt" in err, err
    assert "launch returned" not in out
    assert processes_with_env("TEST_TAG", tag) == []
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert alive_with_env([grandchild] + [p.pid for p in running], "TEST_TAG", tag) == []
    assert list(own_tmp.glob("lessonlib-*")) == [], "the run's temporary folder was left behind"


# --------------------------------------------------------------------------- input checks

BAD_INPUTS = [
    ("nproc=0", dict(nproc=0), ValueError, "nproc"),
    ("nproc=-1", dict(nproc=-1), ValueError, "nproc must be from 1 to"),
    ("nproc=17", dict(nproc=17), ValueError, "nproc"),
    ("nproc=10000", dict(nproc=10000), ValueError, "nproc must be from 1 to"),
    ("nproc='abc'", dict(nproc="abc"), ValueError, "nproc must be an int"),
    ("nproc=2.5", dict(nproc=2.5), ValueError, "int"),
    ("nproc=True", dict(nproc=True), ValueError, "int"),
    ("nproc='2'", dict(nproc="2"), ValueError, "int"),
    ("missing script", dict(script="lessons/99_no_such_lesson.py"), FileNotFoundError, "not found"),
    ("args as a string", dict(args="--steps 3"), ValueError, "list of strings"),
    ("env non-str value", dict(env={"MY_FLAG": 1}), ValueError, "must be a str"),
    ("env reserved RANK", dict(env={"RANK": "0"}), ValueError, "cannot be overridden"),
    ("env LESSONLIB_ key", dict(env={"LESSONLIB_RUN_ID": "x"}), ValueError, "cannot be overridden"),
    ("env PYTHONUNBUFFERED", dict(env={"PYTHONUNBUFFERED": "0"}), ValueError, "cannot be overridden"),
    ("timeout=0", dict(timeout=0), ValueError, "timeout"),
    ("timeout=-1", dict(timeout=-1), ValueError, "timeout"),
    ("timeout='10'", dict(timeout="10"), ValueError, "timeout"),
    ("backend nccl without GPU", dict(backend="nccl"), ValueError, "GPU"),
    ("backend bogus", dict(backend="bogus"), ValueError, "backend must be one of"),
    ("launcher bogus", dict(launcher="bogus"), ValueError, "launcher must be one of"),
    ("show bogus", dict(show="bogus"), ValueError, "show must be one of"),
]


@pytest.mark.parametrize(
    "kwargs, error, keyword", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
@pytest.mark.unit
def test_bad_input_is_refused_before_anything_starts(kwargs, error, keyword, monkeypatch, tmp_path):
    """Refused with a message that names the mistake, before any process is spawned (subprocess or
    psutil) and before any run folder exists (TMPDIR is the test's own). How fast is not asserted: a
    busy machine sets that; what was started is checked directly."""
    if kwargs.get("backend") == "nccl" and list(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this machine has an NVIDIA GPU, so backend='nccl' is not a bad input here")
    spawned = []

    def spy(real):
        def popen(*a, **kw):
            spawned.append(a[0] if a else kw.get("args"))
            return real(*a, **kw)

        return popen

    monkeypatch.setattr(psutil, "Popen", spy(psutil.Popen))
    monkeypatch.setattr(subprocess, "Popen", spy(subprocess.Popen))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # Python reads TMPDIR again
    call = {"script": LAUNCH_LESSON, "nproc": 2, "timeout": 30, "show": "none", **kwargs}
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(error) as caught:
        lessonlib.launch(call.pop("script"), **call)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert keyword in str(caught.value), f"unhelpful message: {caught.value}"
    assert spawned == [], f"started {spawned} before refusing"
    assert after <= before, f"new child processes: {after - before}"
    assert list(tmp_path.iterdir()) == [], "made a run folder before refusing"


# --------------------------------------------------------------------------- several launches


@pytest.mark.timeout(240)
def test_four_concurrent_launches_do_not_collide():
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = list(pool.map(lambda _: lessonlib.launch(LAUNCH_LESSON, nproc=2, timeout=180, show="none"), range(4)))
    ports = []
    for run in runs:
        assert run.ok, run.describe_failure()
        env = run.reports("env")
        assert [rank for rank, _ in env] == [0, 1]
        run_ports = {e["MASTER_PORT"] for _, e in env}
        assert len(run_ports) == 1, f"ranks of one run disagree on MASTER_PORT: {run_ports}"
        ports += run_ports
    assert len(set(ports)) == 4, f"MASTER_PORT per run: {ports}"


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_nodes(rendezvous):
    run = lessonlib.launch(LAUNCH_LESSON, nproc=2, nnodes=2, rendezvous=rendezvous, timeout=120, show="none")
    assert run.ok, run.describe_failure()
    assert run.world_size == 4 and len(run.ranks) == 4 and len(run.agent_pids) == 2
    env = dict(run.reports("env"))
    assert sorted(env) == [0, 1, 2, 3]
    # torchrun's static rendezvous uses --node-rank; c10d ranks nodes by their sorted descriptors
    # (addr, agent pid, local id), and every agent here has the address 127.0.0.1.
    order = run.agent_pids if rendezvous == "static" else sorted(run.agent_pids)
    for rank, e in env.items():
        assert e["PPID"] in run.agent_pids, f"rank {rank}'s parent {e['PPID']} is not an agent {run.agent_pids}"
        group_rank = int(e["GROUP_RANK"])
        assert group_rank == order.index(e["PPID"]), f"{rendezvous}: rank {rank} env {e}, agents {run.agent_pids}"
        assert rank == group_rank * 2 + int(e["LOCAL_RANK"]), e
    per_agent = [sum(e["PPID"] == pid for e in env.values()) for pid in run.agent_pids]
    assert per_agent == [2, 2], per_agent
    assert len({e["MASTER_PORT"] for e in env.values()}) == 1


def test_legacy_launcher_passes_local_rank_argument():
    run = lessonlib.launch(
        LEGACY_LESSON, nproc=2, args=["--expect-argv"], launcher="torch.distributed.launch", timeout=90, show="none"
    )
    assert run.ok, run.describe_failure()
    got = run.reports("local_rank")
    assert [rank for rank, _ in got] == [0, 1]
    for rank, sources in got:
        assert sources["argv"] == sources["env"] == rank, sources
    assert "FutureWarning" in run.launcher_output, run.launcher_output
    assert all("FutureWarning" not in r.stderr for r in run.ranks)


def test_lesson_runs_under_plain_python():
    done = subprocess.run(
        [sys.executable, LAUNCH_LESSON],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        env={k: v for k, v in os.environ.items() if not k.startswith("LESSONLIB_")},
    )
    assert done.returncode == 0, done.stderr
    assert "all 1 ranks agree" in done.stdout, done.stdout


# --------------------------------------------------------------------------- the leak check itself


def test_leak_scan_sees_a_marked_process(leak_scan):
    """The autouse leak check must be able to fail: a process carrying the run marker is found."""
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, MARKS_VAR: "leak-scan-check"},
        start_new_session=True,
    )
    try:
        poll_until(
            lambda: sleeper.pid in {p.pid for p in leak_scan()},
            10,
            0.05,
            "the leak scan to see a process carrying the run marker",
        )
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert sleeper.pid not in {p.pid for p in leak_scan()}


# --------------------------------------------------------------------------- regressions


@pytest.mark.parametrize("how, exitcode", [("exit", 3), ("segv", -signal.SIGSEGV)])
def test_rank_dying_without_a_python_exception_is_still_the_root_cause(tmp_path, how, exitcode):
    """os._exit or a segfault leaves no exit record; the peers' "connection closed" errors must not win."""
    script = tmp_path / "die.py"
    script.write_text(
        "import ctypes, os, sys, torch, torch.distributed as dist, lessonlib\n"
        "ctx = lessonlib.setup()\n"
        "if ctx.rank == 1:\n"
        "    ctypes.string_at(0) if sys.argv[1] == 'segv' else os._exit(3)\n"
        "t = torch.ones(1); dist.all_reduce(t); lessonlib.teardown()\n"
    )
    run = lessonlib.launch(script, nproc=3, args=[how], timeout=90, show="none")
    assert not run.ok
    assert run.root_cause.rank == 1, run.describe_failure()
    assert run.ranks[1].exitcode == exitcode, run.describe_failure()
    assert "First failure (root cause): rank 1" in run.describe_failure()


def test_env_pythonpath_is_kept_after_the_course_root(tmp_path):
    script = tmp_path / "show_path.py"
    script.write_text("import os; print('PYTHONPATH=' + os.environ['PYTHONPATH'])\n")
    run = lessonlib.launch(script, nproc=1, env={"PYTHONPATH": str(tmp_path)}, timeout=60, show="none")
    run.raise_for_status()
    parts = run.ranks[0].stdout.strip().split("=", 1)[1].split(os.pathsep)
    assert parts[:2] == [str(ROOT), str(tmp_path)], parts


def test_relative_script_is_found_in_cwd(tmp_path, monkeypatch):
    (tmp_path / "here.py").write_text("import os; print('cwd', os.getcwd())\n")
    monkeypatch.chdir(tempfile.gettempdir())
    run = lessonlib.launch("here.py", nproc=1, cwd=tmp_path, timeout=60, show="none").raise_for_status()
    assert run.ranks[0].stdout.strip() == f"cwd {tmp_path}"


def test_timeout_before_any_rank_started_says_so(monkeypatch):
    # A fresh agent imports torch for seconds before it starts a rank: 0.3 s ends the run before that.
    # (An agent forked from the server can start and finish both ranks within 0.3 s.)
    monkeypatch.setenv(forkrank.FRESH_VAR, "1")
    run = lessonlib.launch(LAUNCH_LESSON, nproc=2, timeout=0.3, show="none")
    assert run.timed_out and not run.ok
    assert all(r.status == "not started" for r in run.ranks), [r.status for r in run.ranks]
    assert "before any rank had started" in run.describe_failure()


# --------------------------------------------------------------------------- the launch description and the run folder


def test_mpi_backend_is_refused_naming_what_is_allowed(monkeypatch):
    """No chapter uses MPI, so launch offers gloo and nccl only; 'mpi' is bad input, refused before anything starts."""
    spawned = []
    monkeypatch.setattr(psutil, "Popen", lambda *a, **kw: spawned.append(a) or pytest.fail("started a process"))
    with pytest.raises(
        ValueError,
        match=r"backend must be one of gloo, nccl or None \(pick automatically\); "
        r"got 'mpi'",
    ):
        lessonlib.launch(LAUNCH_LESSON, nproc=2, timeout=30, show="none", backend="mpi")
    assert spawned == []


def test_launch_description_is_checked_and_frozen(tmp_path):
    import dataclasses

    from lessonlib.launcher.request import check_launch

    script = tmp_path / "x.py"
    script.write_text("print('x')\n")
    spec = check_launch(
        script.name,
        3,
        ["--steps", 2],
        45,
        {"MY_FLAG": "1"},
        nnodes=2,
        backend="gloo",
        launcher="torchrun",
        rendezvous="static",
        cwd=tmp_path,
    )
    assert (spec.script, spec.shown, spec.args, spec.world_size) == (script, "x.py", ("--steps", "2"), 6)
    assert spec.cwd == tmp_path.resolve() and spec.env == {"MY_FLAG": "1"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.nproc = 4
    with pytest.raises(TypeError):
        spec.env["OTHER"] = "2"


@pytest.mark.unit
def test_run_folder_records_round_trip(tmp_path):
    from lessonlib.launcher import runfolder

    folder = str(tmp_path)
    assert runfolder.read_start(folder, 0) is None and runfolder.read_exit(folder, 0) is None
    assert runfolder.read_reports(folder, 0) == []
    assert runfolder.read_text(runfolder.output_file(folder, 0, "stdout")) == ""
    runfolder.write_start(folder, 1, {"rank": 1, "pid": 7, "time": 1.5})
    runfolder.write_exit(folder, 1, {"rank": 1, "exitcode": 3, "end": 2.5})
    runfolder.add_report(folder, 1, "loss", [0.5, 0.25])
    runfolder.add_report(folder, "1", "loss", {"step": 2})  # a rank as RANK gives it: text
    assert runfolder.read_start(folder, 1) == {"rank": 1, "pid": 7, "time": 1.5}
    assert runfolder.read_exit(folder, 1) == {"rank": 1, "exitcode": 3, "end": 2.5}
    assert runfolder.read_reports(folder, 1) == [("loss", [0.5, 0.25]), ("loss", {"step": 2})]
    assert sorted(os.listdir(folder)) == ["rank1.exit.json", "rank1.reports.jsonl", "rank1.start.json"]


# Each protocol's names, and the one module that spells them; every other side imports them from there.
PROTOCOLS = {
    "lessonlib/launcher/runfolder.py": (
        "LESSONLIB_RUN_DIR",
        "LESSONLIB_LAUNCHER_PID",
        "LESSONLIB_BACKEND",
        "LESSONLIB_STORES_ON",
        ".start.json",
        ".exit.json",
        ".reports.jsonl",
        "agent{",
        '.stdout"',
        '.stderr"',
    ),
    "lessonlib/processes/marks.py": ("LESSONLIB_MARKS",),  # the one variable that marks processes
}


@pytest.mark.unit
@pytest.mark.parametrize("home", PROTOCOLS, ids=lambda p: p.rsplit("/", 1)[-1])
def test_a_protocols_names_are_spelled_once(home):
    """The run folder's variable and file names live in launcher/runfolder.py, the process marks' variable in
    processes/marks.py; every other side imports them."""
    sides = [
        *sorted((ROOT / "lessonlib").rglob("*.py")),
        *(ROOT / "tests" / name for name in ("conftest.py", "rankfork.py", "test_lessons.py")),
    ]
    spelled = [
        (str(path.relative_to(ROOT)), name)
        for path in sides
        if path != ROOT / home
        for name in PROTOCOLS[home]
        if name in path.read_text()
    ]
    assert spelled == [], f"names spelled outside {home}: {spelled}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["torchrun", "torch.distributed.launch"])
def test_a_run_leaves_nothing_in_the_temporary_folder(tmp_path, launcher):
    """torchrun (and the deprecated launcher) write a torchelastic_* log folder per run into the
    temporary folder and never remove it; a launch puts it inside its run folder, which it removes."""
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    script = ROOT / "lessons" / "01_legacy_launch.py"  # runs under both launchers
    code = (
        f"import lessonlib\nlessonlib.launch({str(script)!r}, nproc=2, timeout=120, show='none', "
        f"launcher={launcher!r}).raise_for_status()\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "TMPDIR": str(own_tmp)},
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert sorted(p.name for p in own_tmp.iterdir()) == [], "left in the temporary folder"


def detached(wait):
    """The command that starts a child in a session of its own, prints its pid and sleeps `wait` s."""
    return [sys.executable, str(HELPERS / "detached_child.py"), str(wait)]


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("wait", [0, 600], ids=["finishes", "hangs"])
def test_run_bounded_leaves_no_process_whether_the_command_finishes_or_hangs(wait):
    """run_bounded (the tests', the book executor's and chapter 11's way to run a command) kills what
    the command started in another session, found by its mark, after a normal exit as after a timeout."""
    done = run_bounded(detached(wait), 8)
    assert done.timed_out == (wait > 0) and done.returncode == (-signal.SIGKILL if wait else 0), done
    child = int(done.stdout.split()[0])  # what it printed before the kill is kept
    assert _gone(child), f"pid {child}, started by the command in a session of its own, outlived it"


def test_run_bounded_reaches_a_bounded_command_inside_a_bounded_command():
    """The marks nest: killing the outer command at its deadline also ends what an inner run_bounded
    (with a longer bound) had started."""
    inner = f"from lessonlib import run_bounded\nrun_bounded({detached(600)!r}, 600)"
    tag = uuid.uuid4().hex  # this test's processes only: others running beside it sleep(600) too
    done = run_bounded([sys.executable, "-c", inner], 8, env={**os.environ, "TEST_TAG": tag})
    assert done.timed_out, done
    time.sleep(0.5)  # killed processes finish dying
    marked = [p for p in processes_with_env("TEST_TAG", tag) if not _gone(p.pid)]
    assert marked == [], f"left running: {marked}"


def test_sigterm_to_a_process_in_run_bounded_kills_the_command_first():
    """A process waiting in run_bounded and sent SIGTERM (pytest stopped by CI, `kill`) first kills the
    command and all it started (a process in a session of its own here), then ends as SIGTERM ends it."""
    code = f"from lessonlib import run_bounded\nrun_bounded({detached(600)!r}, 600)"
    waiter = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True
    )
    try:

        def children():
            assert waiter.poll() is None, f"the waiter exited {waiter.returncode} before the command's child started"
            found = psutil.Process(waiter.pid).children(recursive=True)
            return found if any(p.cmdline()[-1:] == ["import time; time.sleep(600)"] for p in found) else None

        started = poll_until(children, 60, what="the command's child to start")
        waiter.send_signal(signal.SIGTERM)
        assert waiter.wait(timeout=20) == -signal.SIGTERM, "it should end as SIGTERM ends a process"
        time.sleep(0.5)  # killed processes finish dying
        left = [p.pid for p in started if not _gone(p.pid)]
        assert left == [], f"pids {left}, started under run_bounded, outlived the SIGTERM"
    finally:
        if waiter.poll() is None:
            os.killpg(waiter.pid, signal.SIGKILL)
            waiter.wait()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fail_attempts, ok", [(1, True), (9, False)], ids=["fails once", "fails every time"])
def test_max_restarts_starts_every_rank_again_and_reports_the_last_attempt(fail_attempts, ok):
    """torchrun --max-restarts=1: after rank 1 fails, every rank starts again; each rank's output holds
    both attempts, and the outcome is the last attempt's (a stale exit record of the first is not read)."""
    script = HELPERS / "fails_on_early_attempts.py"
    run = lessonlib.launch(script, nproc=2, args=[fail_attempts], timeout=120, show="none", max_restarts=1)
    assert run.ok is ok, run.describe_failure()
    for r in run.ranks:
        assert f"rank {r.rank} attempt 0" in r.stdout and f"rank {r.rank} attempt 1" in r.stdout, r.stdout
    if not ok:
        assert run.root_cause.rank == 1 and "fails on attempt 1" in run.root_cause.error, run.describe_failure()


@pytest.mark.unit
def test_max_restarts_is_checked():
    with pytest.raises(ValueError, match="max_restarts must be from 0 to 5"):
        lessonlib.launch(HANG, nproc=2, max_restarts=6)
    with pytest.raises(ValueError, match="max_restarts needs launcher='torchrun'"):
        lessonlib.launch(HANG, nproc=2, max_restarts=1, launcher="torch.distributed.launch")


@pytest.mark.timeout(120)
def test_a_rank_that_exits_0_early_is_named_though_only_its_peers_failed():
    run = lessonlib.launch(HELPERS / "leaves_early.py", nproc=2, timeout=90, show="none")
    assert not run.ok and run.ranks[1].ok and run.failed_ranks == [0], run.describe_failure()
    story = run.describe_failure()
    assert run.left_early == [1] and "Rank(s) 1 exited 0 before the first failure" in story, story
    assert "  rank 1 (left early: look here first): exit 0, before the others failed" in story.splitlines(), story


@pytest.mark.parametrize("how", ["block ends", "bound fires"])
def test_started_kills_everything_it_started(how):
    from lessonlib import started

    with started(detached(600), timeout=3 if how == "bound fires" else 60) as job:
        child = job.poll_until(lambda: job.output().split() and int(job.output().split()[0]), timeout=30)
        if how == "bound fires":
            poll_until(lambda: job.proc.poll() is not None, 30, what="the bound to end the command")
    poll_until(lambda: _gone(child), 10, what=f"pid {child}, started by the command in a session of its own, to end")


def test_started_poll_until_gives_up_as_soon_as_the_command_exits():
    """Started.poll_until (lessonlib.processes.bounded.poll_until with the command's state): a check that can
    no longer come true because the command ended is said at once, with the command's output, not after
    the bound (that message exists only on this path)."""
    from lessonlib import started

    with started([sys.executable, "-c", "print('all done here')"], timeout=60) as job:
        with pytest.raises(TimeoutError, match=r"was never true: it exited 0; its output so far:\nall done here"):
            job.poll_until(lambda: False, timeout=60)


def test_run_bounded_types_its_input_and_a_command_that_never_reads_it_still_ends():
    done = run_bounded([sys.executable, "-c", "print(input()[::-1]); print(input())"], 60, input="abc\nxyz\n")
    assert done.returncode == 0 and done.output.split() == ["cba", "xyz"], done
    ignores = run_bounded([sys.executable, "-c", "import time; time.sleep(1)"], 60, input="x" * 200_000)
    assert ignores.returncode == 0 and not ignores.timed_out, ignores


def test_a_sigterm_while_the_rank_records_its_error_waits_for_the_record(tmp_path):
    """torchrun's SIGTERM can come while a rank whose collective failed writes its own traceback (a race
    seen in CI). Here the exception's message sends it, while the rank formats its traceback: the rank's
    error and traceback are still recorded, and then SIGTERM ends it, as it would have."""
    script = tmp_path / "term_while_recording.py"
    script.write_text(
        "import os, signal\n"
        "class Stopped(Exception):\n"
        "    def __str__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # as torchrun would, while the traceback is formatted\n"
        "        return 'the collective failed'\n"
        "def where_it_failed():\n"
        "    raise Stopped()\n"
        "where_it_failed()\n"
    )
    run = lessonlib.launch(script, nproc=1, timeout=60, show="none")
    rank = run.ranks[0]
    text = run.describe_failure()
    assert rank.error == "Stopped: the collective failed", text
    assert "in where_it_failed" in rank.traceback, text
    assert re.search(
        r"^  rank 0 \(root cause\): Stopped: the collective failed; at .*in where_it_failed", text, re.M
    ), text
    # The record came first; the SIGTERM was then delivered, not lost: torchrun saw the rank end by it.
    assert "exitcode  : -15" in run.launcher_output or "Signal 15" in run.launcher_output, run.launcher_output
