"""What a dead owner left is swept at the next start (lessonlib.processes.owners); a SIGTERM to a launch cleans up.

- A process running `lessonlib.launch` sent SIGTERM, alone or with every process of its run at once (as
  Slurm's scancel or a container's stop sends it): the launcher itself kills the run and removes its run
  folder before it ends; nothing is left.
- The same process SIGKILLed with every process of its run: nothing can run, the run folder is left; the
  next launch in that temporary folder removes it, since its name carries the dead launcher's pid and
  start time.
- A live owner's folder is never swept, nor one whose pid now belongs to another process (another start
  time), nor a name that carries no owner.
- A `lessonlib.Hosts` network whose owner and keeper were both SIGKILLed: its namespaces, /etc/netns folders
  and the processes inside them stay, until the next Hosts starts (root and iproute2; skipped otherwise);
  another owner's live network is untouched. The keeper removes a kept file as well as a folder.
- The book build's scratch folder, left by a build killed outright, is removed by the next build.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

import lessonlib
from conftest import HELPERS, kill_processes, processes_with_env
from lessonlib import ROOT
from lessonlib.book import rebuild
from lessonlib.cluster import hosts
from lessonlib.launcher.runfolder import FOLDER_PREFIX
from lessonlib.processes import owners

READY_BOUND = 90.0  # seconds for both ranks of the launch to be up (a loaded 2-core machine)
GONE_BOUND = 15.0  # seconds for what was killed to be gone

# A process that launches 2 ranks that say they are ready and sleep (tests/helpers/sleeper.py).
LAUNCHER = """
import sys
import lessonlib
lessonlib.launch(sys.argv[1], nproc=2, timeout=300, show="none")
"""


class Launcher:
    """A child process running LAUNCHER with its own TMPDIR; every process of it carries TEST_TAG=tag."""

    def __init__(self, root):
        self.tag, self.tmp, self.ready = uuid.uuid4().hex, root / "tmp", root / "ready"
        root.mkdir()
        self.tmp.mkdir()
        self.ready.mkdir()
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TMPDIR": str(self.tmp),
            "TEST_READY_DIR": str(self.ready),
            "TEST_TAG": self.tag,
        }
        self.log = open(root / "launcher.log", "w+")
        argv = [sys.executable, "-c", LAUNCHER, str(HELPERS / "sleeper.py")]
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + READY_BOUND
        while sorted(p.name for p in self.ready.iterdir()) != ["rank0.ready", "rank1.ready"]:
            assert self.proc.poll() is None, f"the launcher ended first:\n{self.output()}"
            assert time.monotonic() < deadline, f"the ranks were not up after {READY_BOUND} s:\n{self.output()}"
            time.sleep(0.1)

    def output(self):
        self.log.seek(0)
        return self.log.read()[-3000:]

    def processes(self):
        """Every live process of it: the launcher, its agent server, agent and ranks."""
        return processes_with_env("TEST_TAG", self.tag)

    def run_folders(self):
        return sorted(p.name for p in self.tmp.iterdir() if p.name.startswith("lessonlib-"))

    def signal_all(self, sig):
        """`sig` to the launcher and every process of its run at once (scancel, a container's stop)."""
        for p in [psutil.Process(self.proc.pid), *self.processes()]:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def left_after(self, seconds):
        deadline = time.monotonic() + seconds
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        kill_processes(self.processes())
        self.log.close()


@pytest.fixture
def launcher(tmp_path):
    started = []

    def start():
        started.append(Launcher(tmp_path / f"launcher{len(started)}"))
        return started[-1]

    yield start
    for one in started:
        one.close()


def quick_launch():
    run = lessonlib.launch(HELPERS / "print_lines.py", nproc=1, args=["--lines", "1"], timeout=90, show="none")
    assert run.ok, run.describe_failure()


# --------------------------------------------------------------------------- a launch's own run folder


@pytest.mark.timeout(180)
@pytest.mark.parametrize("who", ["the launcher", "every process"])
def test_a_launch_sent_sigterm_leaves_nothing(launcher, who):
    """SIGTERM to the launching process (main thread) ends the run as an interrupt does, then the process ends
    as SIGTERM ends it. Sent to the launcher alone, or to every process of the run at once (then torchrun
    exits by itself, and its watch for a dead launcher, which would remove the folder, goes with it): the run
    folder is gone by the time the launcher has ended, and no process of the run is left."""
    one = launcher()
    folders = one.run_folders()
    assert len(folders) == 1 and folders[0].startswith(f"{FOLDER_PREFIX}{one.proc.pid}-"), folders
    if who == "the launcher":
        one.proc.send_signal(signal.SIGTERM)
    else:
        one.signal_all(signal.SIGTERM)
    assert one.proc.wait(timeout=GONE_BOUND) == -signal.SIGTERM, one.output()
    assert one.run_folders() == [], f"the launcher ended before removing its run folder:\n{one.output()}"
    left = one.left_after(GONE_BOUND)
    assert left == [], f"left running: {[p.cmdline() for p in left]}"
    assert sorted(p.name for p in one.tmp.iterdir()) == []


@pytest.mark.timeout(180)
def test_a_launch_killed_with_its_run_leaves_its_folder_to_the_next_launch(launcher, use_tmpdir):
    """SIGKILL to the launcher and every process of its run: nothing runs to clean up, and the run folder
    stays. The next launch in that temporary folder removes it: its owner, named in it, is gone."""
    one = launcher()
    one.signal_all(signal.SIGKILL)
    assert one.proc.wait(timeout=GONE_BOUND) == -signal.SIGKILL
    assert one.left_after(GONE_BOUND) == []
    left = one.run_folders()
    assert len(left) == 1 and left[0].startswith(f"{FOLDER_PREFIX}{one.proc.pid}-"), left
    use_tmpdir(one.tmp)
    quick_launch()
    assert sorted(p.name for p in one.tmp.iterdir()) == [], "the next launch did not sweep the dead launcher's folder"


def _tag_of_a_dead_process():
    """'PID-START' of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-S", "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    tag = owners.tag(child.pid)
    child.communicate(timeout=30)
    return tag


@pytest.mark.timeout(120)
def test_a_live_owners_folder_is_never_swept(tmp_path, use_tmpdir):
    """Beside the folder of a dead owner, which goes: a live owner's stays (another process, and this one),
    and so do a name whose pid now belongs to a process that started at another time (the pid was used
    again: that owner is dead, so it goes) and a name that carries no owner (an older lessonlib's)."""
    live = subprocess.Popen(["sleep", "120"])
    try:
        pid, start = owners.tag(live.pid).split("-")
        names = {
            f"{FOLDER_PREFIX}{pid}-{start}-live": True,
            f"{owners.owned_prefix(FOLDER_PREFIX)}this-process": True,
            f"{FOLDER_PREFIX}{_tag_of_a_dead_process()}-dead": False,
            f"{FOLDER_PREFIX}{pid}-{int(start) + 1}-pid-used-again": False,
            "lessonlib-0123abcd-from-an-older-lessonlib": True,
            f"{FOLDER_PREFIX}no-owner": True,
        }
        for name in names:
            (tmp_path / name).mkdir()
            (tmp_path / name / "rank0.stdout").write_text("hello\n")
        use_tmpdir(tmp_path)
        quick_launch()
        kept = sorted(p.name for p in tmp_path.iterdir())
        assert kept == sorted(name for name, stays in names.items() if stays), kept
    finally:
        live.kill()
        live.wait()


@pytest.mark.timeout(60)
def test_a_start_time_is_read_past_a_command_name_with_spaces_and_parentheses():
    """/proc/PID/stat puts the command name in parentheses, and it may hold both: the start time read is the
    one psutil computes from the same file another way."""
    child = subprocess.Popen(
        [sys.executable, "-S", "-c", "open('/proc/self/comm', 'w').write('a) (b c'); print(1, flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child.stdout.readline()
        assert psutil.Process(child.pid).name() == "a) (b c"
        ticks = owners.start_time(child.pid)
        expected = (psutil.Process(child.pid).create_time() - psutil.boot_time()) * os.sysconf("SC_CLK_TCK")
        assert ticks is not None and abs(ticks - expected) < 2, (ticks, expected)
    finally:
        child.kill()
        child.wait()
    assert owners.start_time(child.pid) is None


# --------------------------------------------------------------------------- the book build's scratch folder

# A build that has made its scratch folder and is then killed outright: execute_notebooks' loop replaced by
# one that prints the folder and waits.
BUILD = """
import time
from lessonlib.book import rebuild
def hang(pending, running, done, *args):
    print(done.scratch, flush=True)
    time.sleep(300)
rebuild._execute_all = hang
rebuild.execute_notebooks([], 10, 1, 10)
"""


@pytest.mark.timeout(120)
def test_the_book_builds_scratch_folder_left_by_a_killed_build_goes_at_the_next_build(tmp_path, use_tmpdir):
    """Two builds make their scratch folders; one is SIGKILLed. The next build (rebuild.execute_notebooks,
    with nothing to execute) removes the dead build's folder and leaves the live one's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    builds = [
        subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    try:
        killed, live = (Path(b.stdout.readline().strip()) for b in builds)
        assert killed.name.startswith(f"{rebuild.SCRATCH_PREFIX}{builds[0].pid}-"), killed
        builds[0].kill()
        builds[0].wait()
        assert killed.is_dir() and live.is_dir()
        use_tmpdir(tmp_path)
        done = rebuild.execute_notebooks([], 10, 1, 10)
        try:
            assert not killed.exists(), "the killed build's scratch folder is still there"
            assert live.is_dir(), "the live build's scratch folder was removed"
        finally:
            done.scratch.rmdir()
    finally:
        for b in builds:
            b.kill()
            b.wait()
            b.stdout.close()
    owners.sweep(str(tmp_path), rebuild.SCRATCH_PREFIX)  # the other build is dead now too: its folder goes
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- Hosts


def test_the_keeper_removes_a_kept_file_as_well_as_a_folder(tmp_path):
    """The keeper (run as Hosts runs it) told of a folder and a file removes both when its input ends."""
    folder, file = tmp_path / "folder", tmp_path / "file"
    folder.mkdir()
    (folder / "inside").write_text("x")
    file.write_text("x")
    told = "".join(json.dumps({"path": str(p)}) + "\n" for p in (folder, file))
    done = subprocess.run(
        [sys.executable, "-S", str(hosts.KEEPER)], input=told, capture_output=True, text=True, timeout=30
    )
    assert json.loads(done.stdout) == {"removed": 2, "left": []}, done
    assert list(tmp_path.iterdir()) == []


# A process that owns a network: prints its token once a process runs on host1, then waits.
OWNER = """
import subprocess, time
from lessonlib.cluster.hosts import Hosts
with Hosts(2) as net:
    net.popen("host1", ["sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(net.token, flush=True)
    time.sleep(120)
"""


def network_left(token):
    """What of network `token` exists: namespaces, /etc/netns folders, its registry file."""
    found = [
        p for folder in (Path("/run/netns"), hosts.NETNS_ETC) if folder.is_dir() for p in folder.glob(f"lh{token}-*")
    ]
    return [str(p) for p in found] + [str(p) for p in [hosts.REGISTRY / f"{token}.jsonl"] if p.exists()]


def start_owner():
    child = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().strip()
    if not line:
        child.kill()
        pytest.fail(f"the owner did not make its hosts: {child.communicate(timeout=10)[1][-3000:]}")
    return child, line


def in_namespace(token, host):
    out = subprocess.run(["ip", "netns", "pids", f"lh{token}-{host}"], capture_output=True, text=True, timeout=10)
    return [int(p) for p in out.stdout.split()]


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(180)
def test_a_network_whose_owner_and_keeper_were_killed_goes_at_the_next_hosts():
    """Two owners each make Hosts(2) with `sleep 120` on host1. The first's keeper, then the first owner, are
    SIGKILLed: nothing removes its network (a second later it is all still there, the sleep running). The
    next `Hosts` to start removes it, the process inside killed, as the keeper would have; the second
    owner's network, whose owner lives, is untouched."""
    if reason := hosts.unavailable():
        pytest.skip(reason)
    doomed, doomed_token = start_owner()
    live, live_token = start_owner()
    try:
        head = json.loads((hosts.REGISTRY / f"{doomed_token}.jsonl").read_text().splitlines()[0])
        assert head["owner"].startswith(f"{doomed.pid}-"), head
        keeper = int(head["keeper"].split("-")[0])
        sleeps = in_namespace(doomed_token, "host1")
        assert sleeps, "no process on the first owner's host1"
        os.kill(keeper, signal.SIGKILL)
        doomed.kill()
        doomed.communicate(timeout=GONE_BOUND)
        deadline = time.monotonic() + GONE_BOUND
        while _alive(keeper) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # nothing is left to remove it
        left = network_left(doomed_token)
        assert len(left) == 3 + 2 + 1, left  # switch and 2 hosts, 2 /etc/netns folders, the registry
        assert all(_alive(p) for p in sleeps), "the process inside the host was killed"
        live_before = network_left(live_token)
        with hosts.Hosts(2):
            assert network_left(doomed_token) == [], "the next Hosts did not remove the dead owner's network"
            assert network_left(live_token) == live_before, "a live owner's network was touched"
        assert not any(_alive(p) for p in sleeps), "the process inside the dead owner's host is still running"
    finally:
        for child in (doomed, live):
            child.send_signal(signal.SIGINT)  # the live owner's `with` block removes its network
            child.communicate(timeout=GONE_BOUND)
        hosts.sweep_dead_networks()  # the doomed network, if the test failed before the sweep
    assert network_left(doomed_token) == [] and network_left(live_token) == []
