"""Faults of the machine, named in one line (lessonlib.launcher.faults): real small tmpfs disks, real ranks.

Before anything starts: a TMPDIR that does not exist or is not a folder (a FileNotFoundError), a temporary
folder that is read-only, not writable for this user, or nearly full (an EnvironmentFault, an OSError).
After a run: a disk that filled up during the run, too many open files (EMFILE), a rank killed by a
SIGKILL the launcher did not send, each in RunResult.fault and at the head of the failure story; and
`python -m lessonlib run` saying an environment fault in one line, exit status 1, no traceback.

Each disk is a tmpfs mounted for the test under its tmp_path (`mount -t tmpfs -o size=...`) and unmounted in
`finally`; without root, or where mount fails, the test is skipped with the reason. Every run's TMPDIR is
checked afterwards: the run folder went with the run (what a helper rank wrote on purpose aside).
"""

import contextlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

import lessonlib
from conftest import HELPERS
from lessonlib import ROOT
from lessonlib.launcher.faults import FULL_BELOW, MIN_FREE, EnvironmentFault, TmpdirMissing
from lessonlib.launcher.result import LaunchError, RankOutput, RunResult
from lessonlib.view.html import render_html
from lessonlib.view.story import describe_failure


@contextlib.contextmanager
def tmpfs(folder, size, *options):
    """A tmpfs of `size` (mount's syntax: '4m') mounted on `folder` (made here) while inside; unmounted after,
    whatever happens. Skips the test without root or when the mount fails."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root; this process runs as uid {os.geteuid()}")
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(folder)]
    try:
        done = subprocess.run(mount, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no `mount` command here")
    if done.returncode != 0:
        pytest.skip(f"`{' '.join(mount)}` failed: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        done = subprocess.run(["umount", str(folder)], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:  # something still holds it: detach it now, it goes when released
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)
        assert not os.path.ismount(folder), f"{folder} is still mounted: {done.stderr}"


def launch(script, nproc=2, **kwargs):
    return lessonlib.launch(HELPERS / script, nproc=nproc, show="none", **{"timeout": 90, **kwargs})


def assert_told_first(run, *words):
    """The fault is named, and the failure story, str(run) and LaunchError's message open with it."""
    assert run.fault, f"no fault named:\n{run.describe_failure()}"
    for word in words:
        assert word in run.fault, f"{word!r} not in the fault: {run.fault}"
    assert "\n" not in run.fault, run.fault
    cause = f"Cause: {run.fault}"
    assert run.describe_failure().startswith(cause), run.describe_failure()
    assert str(run).startswith(cause), str(run)[:2000]
    with pytest.raises(LaunchError) as caught:
        run.raise_for_status()
    assert str(caught.value).startswith(cause), str(caught.value)


# --------------------------------------------------------------------------- before anything starts


@pytest.mark.unit
@pytest.mark.parametrize("what", ["missing", "a file"])
def test_a_tmpdir_that_is_not_a_folder_is_refused_saying_so(tmp_path, use_tmpdir, what):
    """Python's tempfile would quietly use /tmp instead (and so would every rank): refused, before any
    process or folder, as a FileNotFoundError that names the variable, the path and what to do."""
    tmpdir = tmp_path / "tmp"
    if what == "a file":
        tmpdir.write_text("not a folder")
    use_tmpdir(tmpdir)
    with pytest.raises(FileNotFoundError) as caught:
        launch("print_lines.py")
    assert isinstance(caught.value, TmpdirMissing) and isinstance(caught.value, EnvironmentFault)
    message = str(caught.value)
    why = "does not exist" if what == "missing" else "is not a folder"
    assert f"TMPDIR is {str(tmpdir)!r}, which {why}" in message and "set TMPDIR to a writable" in message, message
    assert "\n" not in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if what == "missing" else ["tmp"])


@pytest.mark.unit
def test_a_tmpdir_for_the_ranks_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(TmpdirMissing, match=r"env\['TMPDIR'\] is .*which does not exist"):
        launch("print_lines.py", env={"TMPDIR": str(tmp_path / "missing")})


def test_a_read_only_temporary_folder_is_refused_before_anything_starts(tmp_path, use_tmpdir):
    with tmpfs(tmp_path / "disk", "4m", "ro") as disk:
        use_tmpdir(disk)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        with pytest.raises(EnvironmentFault) as caught:
            launch("print_lines.py")
        after = {p.pid for p in psutil.Process().children(recursive=True)}
    message = str(caught.value)
    assert message.startswith(f"cannot make the run folder in {disk}: it is on a read-only file system (EROFS)"), (
        message
    )
    assert "set TMPDIR to a writable folder with space" in message and "\n" not in message, message
    assert isinstance(caught.value, OSError) and caught.value.errno == 30  # EROFS
    assert after <= before, f"started {after - before} before refusing"


def test_a_nearly_full_temporary_folder_is_refused_before_anything_starts(tmp_path, use_tmpdir):
    with tmpfs(tmp_path / "disk", "512k") as disk:
        use_tmpdir(disk)
        with pytest.raises(EnvironmentFault) as caught:
            launch("print_lines.py")
        assert list(disk.iterdir()) == [], "made a run folder before refusing"
    message = str(caught.value)
    assert f"the temporary folder {disk} has 512.0 KiB free, less than the 1.0 MiB a launch needs" in message, message
    assert MIN_FREE == 1 << 20 and "set TMPDIR to a writable folder with space" in message, message


def test_a_temporary_folder_this_user_cannot_write_is_refused(tmp_path):
    """A folder of mode 555 and a launch by a process that may not override permissions (root without
    CAP_DAC_OVERRIDE, through util-linux's setpriv): permission denied, in one line."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to drop the capability to override permissions")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    code = (
        "import lessonlib\n"
        "from lessonlib.launcher.faults import EnvironmentFault\n"
        "try:\n"
        f"    lessonlib.launch({str(HELPERS / 'print_lines.py')!r}, nproc=1, show='none')\n"
        "except EnvironmentFault as e:\n"
        "    print(e)\n"
    )
    drop = "-dac_override,-dac_read_search"
    argv = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", "--", sys.executable, "-c", code]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(folder)}
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    finally:
        folder.chmod(0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip()
    assert said.startswith(f"cannot make the run folder in {folder}: permission denied (EACCES)"), said
    assert list(folder.iterdir()) == []


# --------------------------------------------------------------------------- after a run


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["a rank fills it", "the ranks print a lot"])
def test_a_disk_that_fills_up_during_the_run_is_named(tmp_path, use_tmpdir, how):
    """TMPDIR on a 4 MiB tmpfs, which holds the ranks' output too. Filled by a file a rank writes, or by what
    the ranks print: a rank that can no longer write fails with exit code 1 and no traceback, its stderr
    empty or cut short (the symptom); the fault names the disk, how full it got, and what to do."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        use_tmpdir(disk)
        if how == "a rank fills it":
            run = launch("fills_disk.py")
        else:
            run = launch("print_lines.py", args=["--lines", "400000"])
        left = sorted(p.name for p in disk.iterdir())
    assert not run.ok, str(run)[:3000]
    cause = run.root_cause
    assert cause is not None and cause.exitcode == 1 and not cause.traceback, run.describe_failure()
    if how == "a rank fills it":
        assert cause.stderr == "", cause.stderr  # the symptom: nothing said, no traceback
        assert all(name.startswith("fill-rank") for name in left), f"left in TMPDIR: {left}"
    else:
        assert left == [], f"left in TMPDIR: {left}"
    assert_told_first(run, "the disk of the run folder filled up during the run", f"({disk}: ", "set TMPDIR")
    lowest = re.search(rf"\({re.escape(str(disk))}: (\d+ B|[\d.]+ KiB) free of 4\.0 MiB at the lowest\)", run.fault)
    assert lowest, run.fault
    assert lowest.group(1).endswith(" B") or float(lowest.group(1).split()[0]) * 1024 < FULL_BELOW, run.fault


@pytest.mark.timeout(120)
def test_too_many_open_files_names_the_ranks_limits_and_how_to_raise_them(tmp_path, use_tmpdir):
    """Rank 1 lowers its own soft RLIMIT_NOFILE to 32 and opens files until EMFILE, keeping them open past its
    script's end: its exit record is still written (the wrapper held a descriptor back for it), and the
    fault names rank 1's own limits, not the launcher's."""
    use_tmpdir(tmp_path)
    run = launch("opens_files.py", args=["--limit", "32"])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    assert run.root_cause is not None and run.root_cause.rank == 1, run.describe_failure()
    assert run.root_cause.error.startswith("OSError: [Errno 24] Too many open files"), run.describe_failure()
    assert run.root_cause.nofile_limit == (32, hard), run.root_cause.nofile_limit
    assert_told_first(
        run, "too many open files (EMFILE) on rank 1", f"soft 32, hard {hard_text}", f"`ulimit -n {hard_text}`"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_sigkill_the_launcher_did_not_send_is_likely_the_oom_killer(tmp_path, use_tmpdir):
    """Rank 1 SIGKILLs itself, standing in for the out-of-memory killer (which a test cannot summon safely):
    the fault says that the launcher did not send it, likely the OOM killer, how to check (dmesg,
    journalctl -k) and what the OOM counter of this cgroup (or machine) counted during the run."""
    use_tmpdir(tmp_path)
    run = launch("kills_itself.py")
    assert run.root_cause is not None and run.root_cause.exitcode == -signal.SIGKILL, run.describe_failure()
    assert_told_first(
        run, "rank 1 was killed by SIGKILL, which the launcher did not send: likely the out-of-memory killer"
    )
    assert "dmesg" in run.fault and "journalctl -k" in run.fault, run.fault
    counters = ("memory.events", "memory.oom_control", "/proc/vmstat")
    assert any(f"{c} counted" in run.fault for c in counters) or "no OOM counter" in run.fault, run.fault
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_the_launchers_own_kill_at_a_timeout_is_no_fault(tmp_path, use_tmpdir):
    """A rank the launcher killed at its timeout reads 'hung', as before, with no fault named."""
    use_tmpdir(tmp_path)
    ready = tmp_path / "ready"
    ready.mkdir()
    run = launch("sleeper.py", nproc=1, timeout=15, env={"TEST_READY_DIR": str(ready)})
    assert run.timed_out and run.fault is None, run.describe_failure()
    assert not run.describe_failure().startswith("Cause:"), run.describe_failure()


# --------------------------------------------------------------------------- the terminal runner


def run_cli(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "lessonlib", "run", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(240)
def test_the_terminal_runner_says_an_environment_fault_in_one_line(tmp_path):
    """`python -m lessonlib run` with a TMPDIR that does not exist, then on a read-only disk: one line on
    stderr, exit status 1, no traceback, no usage text. A run that failed for the machine (a SIGKILL) opens
    its lines on stderr with `Cause: ...`, exit status 1."""
    script = str(HELPERS / "kills_itself.py")
    missing = run_cli(script, "-n", "2", env={"TMPDIR": str(tmp_path / "missing")})
    assert missing.returncode == 1, missing
    assert missing.stderr.count("\n") == 1 and missing.stderr.startswith("lessonlib run: TMPDIR is "), missing.stderr
    with tmpfs(tmp_path / "disk", "4m", "ro") as disk:
        read_only = run_cli(script, "-n", "2", env={"TMPDIR": str(disk)})
    assert read_only.returncode == 1, read_only
    assert read_only.stderr == (
        f"lessonlib run: cannot make the run folder in {disk}: it is on a read-only file system (EROFS); "
        "set TMPDIR to a writable folder with space (e.g. `mkdir -p ~/tmp && export TMPDIR=~/tmp`)\n"
    ), read_only.stderr
    for done in (missing, read_only):
        assert "Traceback" not in done.stderr + done.stdout and "usage:" not in done.stderr, done
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    killed = run_cli(script, "-n", "2", env={"TMPDIR": str(scratch)})
    assert killed.returncode == 1, killed
    assert "Cause: rank 1 was killed by SIGKILL, which the launcher did not send" in killed.stderr, killed.stderr
    assert list(scratch.iterdir()) == []


# --------------------------------------------------------------------------- how it is told


@pytest.mark.unit
def test_every_view_of_a_failed_run_opens_with_its_cause():
    """A RunResult with a fault: the failure story (also without details, as the terminal runner prints it),
    str(run) and the HTML view's summary each say `Cause: ...` before anything about the ranks; a run
    without one reads as before."""
    ranks = [
        RankOutput(0, exitcode=0, status="ok"),
        RankOutput(1, exitcode=-9, status="failed", error="killed by SIGKILL"),
    ]
    common = dict(script="x.py", args=[], nproc=2, nnodes=1, launcher_output="", returncodes=[1], timeout=60)
    run = RunResult(ranks=ranks, wall_time=1.0, fault="rank 1 was killed by SIGKILL, ...", **common)
    for text in (run.describe_failure(), describe_failure(run, details=False), str(run)):
        assert text.startswith("Cause: rank 1 was killed by SIGKILL, ...\n"), text
    page = render_html(run)
    assert page.index("Cause: rank 1 was killed by SIGKILL") < page.index("<b>rank 0</b>"), page
    plain = RunResult(ranks=ranks, wall_time=1.0, **common)
    assert "Cause:" not in plain.describe_failure() + str(plain) + render_html(plain)
