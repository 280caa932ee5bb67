"""lessonlib.Slurm (chapter 17): real Slurm daemons on real network namespaces, real jobs, real gloo; no mocks.

What is refused before anything is made; why a machine cannot run a cluster; how lessonlib.dist maps an srun
step's variables to torchrun's (plain dicts); what a running cluster does (idle nodes, srun on both nodes, a
torchrun job and an srun job of 4 ranks whose rank mapping 17_ranks.py checks, a job cancelled mid-run whose
ranks are gone at once); and that a cluster leaves nothing behind, whether its block ends normally, by an
exception, by Ctrl-C or by its process being killed.

A cluster starts in about 1.5 s, but every torch process costs about 1.5 CPU-seconds: the job tests share one
cluster (one xdist group) and run three jobs in all; the cleanup tests each start a one-node cluster.
"""

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import still_found
from lessonlib import ROOT
from lessonlib.cluster.hosts import unavailable as hosts_unavailable
from lessonlib.cluster.slurm import PROGRAMS, Slurm, gres_confs, slurm_conf, unavailable
from lessonlib.dist import _tasks_on_node, from_slurm
from lessonlib.processes.bounded import poll_until
from test_hosts import NETNS_RUN, read_line
from test_hosts import leftovers as network_leftovers

GONE_BOUND = 15.0  # seconds for everything of a cluster to be removed once its owner ends or dies
START_BOUND = 60.0  # seconds for a child to start a cluster (the helper's own bound for idle nodes is 30 s)
JOB_BOUND = 120.0  # seconds for a job of 4 torch ranks to end (about 10 s here)
STEP_BOUND = 60.0  # seconds for a job's ranks to print their first steps
CANCEL_BOUND = 15.0  # seconds for a cancelled job's ranks to be gone (0.7 s here)
DAEMONS = {"slurmctld", "slurmd", "munged"}
GROUP = pytest.mark.xdist_group("slurm-cluster")  # the tests of the shared cluster: one worker, in order

pytestmark = pytest.mark.timeout(240)  # a backstop: every wait below has its own, shorter bound

# A process that owns a one-node cluster and is then interrupted or killed (a notebook kernel): it prints the
# cluster's token and folder once start() has returned (every node idle), then waits.
OWNER = """
import time
from lessonlib.cluster.slurm import Slurm
with Slurm(nodes=1) as cluster:
    print(cluster.net.token, cluster.folder, flush=True)
    time.sleep(120)
"""


@pytest.fixture
def can_run_slurm():
    if reason := unavailable():
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster():
    """Two compute nodes of 2 CPUs, shared by the job tests (GROUP); checked to leave nothing when closed."""
    if reason := unavailable():
        pytest.skip(reason)
    with Slurm(nodes=2) as cluster:
        yield cluster
    assert wait_gone(cluster.net.token, cluster.folder) == []


def carrying(text):
    """Processes (not this one) whose command line contains `text`, as (pid, argv)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        if argv and text in " ".join(argv):  # a zombie's command line is empty: it is gone
            found.append((int(entry.name), argv))
    return found


def programs(processes):
    return {os.path.basename(argv[0]) for _, argv in processes}


def leftovers(token, folder):
    """What of the cluster `token` still exists: namespaces, /etc/netns folders, its folder, its processes."""
    left = network_leftovers(token) + ([str(folder)] if Path(folder).exists() else [])
    return left + [f"pid {pid}: {' '.join(argv)}" for pid, argv in carrying(str(folder))]


def wait_gone(token, folder, bound=GONE_BOUND):
    """Wait until nothing of cluster `token` is left (leftovers); return what is."""
    return still_found(lambda: leftovers(token, folder), bound)


def assert_running(token, folder):
    """The cluster's namespaces, folder and three daemons exist: what the cleanup tests then see removed."""
    assert {f"lh{token}-login", f"lh{token}-node1", f"lh{token}-switch"} <= set(os.listdir(NETNS_RUN))
    assert (Path(folder) / "slurm.conf").is_file()
    assert DAEMONS <= programs(carrying(str(folder))), carrying(str(folder))


# --------------------------------------------------------------------------- refused before anything is made


def _made():
    """This machine's namespaces and cluster folders: what a cluster would add."""
    tmp = {str(p) for p in Path("/tmp").glob("lessonlib-slurm-*")}
    return (set(os.listdir(NETNS_RUN)) if NETNS_RUN.is_dir() else set()) | tmp


_writes = None  # a list while a refusal runs: the folders and files this process makes (audit events)


def _note_writes(event, args):
    if _writes is None:
        return
    if event == "os.mkdir" or (
        event == "open" and (any(c in str(args[1]) for c in "wax+") or (args[2] or 0) & (os.O_CREAT | os.O_WRONLY))
    ):
        _writes.append((event, str(args[0])))


sys.addaudithook(_note_writes)


def refusal(kwargs):
    """Slurm(**kwargs)'s ValueError, and what appeared meanwhile: the folders and files this process made,
    and new namespaces and cluster folders. Another process (another xdist worker's cluster) may make one at
    that moment, so the constructor is tried three times: what it makes itself, it makes every time."""
    global _writes
    appeared, error = [], None
    for _ in range(3):
        before, _writes = _made(), []
        try:
            Slurm(**kwargs)
        except ValueError as e:
            error = e
        finally:
            writes, _writes = _writes, None
        assert writes == [], f"Slurm({kwargs}) made {writes} before refusing"
        appeared.append(_made() - before)
        if not appeared[-1]:
            break
    assert not all(appeared), f"each of three Slurm({kwargs}) added {appeared}"
    return error


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(nodes=0), "nodes (compute nodes, besides the login host) must be an int from 1 to 3"),
        (dict(nodes=4), "nodes (compute nodes, besides the login host) must be an int from 1 to 3"),
        (dict(nodes=True), "nodes (compute nodes, besides the login host) must be an int from 1 to 3"),
        (dict(nodes="2"), "nodes (compute nodes, besides the login host) must be an int from 1 to 3"),
        (dict(nodes=2.0), "nodes (compute nodes, besides the login host) must be an int from 1 to 3"),
        (dict(cpus=0), "cpus (each node's CPUs, as Slurm counts them) must be an int from 1 to 16"),
        (dict(cpus=17), "cpus (each node's CPUs, as Slurm counts them) must be an int from 1 to 16"),
    ],
)
def test_bad_input_is_refused_saying_what_is_allowed(kwargs, says):
    """Refused in the constructor: no process started (the unit mark's audit hook), no file, no namespace."""
    error = refusal(kwargs)
    assert isinstance(error, ValueError), f"Slurm({kwargs}) was not refused"
    assert says in str(error) and f"got {next(iter(kwargs.values()))!r}" in str(error), str(error)


# --------------------------------------------------------------------------- why a machine cannot run one


def test_without_slurm_unavailable_names_it_and_how_to_install(tmp_path):
    """A child whose PATH has ip, tc, unshare, python and true (Hosts' probe runs `unshare --uts true`) and no
    Slurm program; then, as the control, this PATH: the same check says None."""
    if reason := hosts_unavailable():
        pytest.skip(reason)
    for program in ("ip", "tc", "unshare", "true"):
        (tmp_path / program).symlink_to(shutil.which(program))
    (tmp_path / "python").symlink_to(sys.executable)
    code = (
        "import os, sys; from lessonlib.cluster.slurm import unavailable; print(unavailable()); "
        "os.environ['PATH'] = sys.argv[1]; print(unavailable())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, os.environ["PATH"]],
        env={**os.environ, "PYTHONPATH": str(ROOT), "PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    without, control = out.stdout.splitlines()
    assert "slurmctld" in without and "apt install slurm-wlm munge" in without, without
    assert all(p in without for p in PROGRAMS), without
    assert control == "None", out.stdout


# --------------------------------------------------------------------------- srun's variables as torchrun's


def step(**extra):
    """The environment of task 3 of an srun step of 4 tasks on 2 nodes (2 each), with rank 0's address."""
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "20001",
    }
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.unit
def test_from_slurm_maps_an_srun_step_to_torchrun_variables():
    env = step()
    names = from_slurm(env)
    assert sorted(names) == sorted(["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"])
    assert {n: env[n] for n in names} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
    }
    # Without SLURM_STEP_NUM_TASKS, the job's SLURM_NTASKS; node 1 of "3,1" runs 1 task.
    env = step(SLURM_STEP_NUM_TASKS=None, SLURM_STEP_TASKS_PER_NODE="3,1", SLURM_LOCALID="0")
    assert from_slurm(env) and (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["LOCAL_RANK"]) == ("4", "1", "0")


@pytest.mark.unit
@pytest.mark.parametrize(
    "spec, node, tasks",
    [("2(x2)", 0, 2), ("2(x2)", 1, 2), ("3,1", 0, 3), ("3,1", 1, 1), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1)],
)
def test_tasks_on_node_reads_slurms_compressed_list(spec, node, tasks):
    assert _tasks_on_node(spec, node) == tasks


@pytest.mark.unit
@pytest.mark.parametrize(
    "env",
    [
        # The batch script: SLURM_PROCID and SLURM_NTASKS too, but one process, no step.
        step(SLURM_STEP_ID=None, SLURM_STEP_NUM_TASKS=None, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"),
        step(RANK="2", WORLD_SIZE="4"),  # torchrun has set them (torchrun under srun)
        step(SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1", SLURM_PROCID="0"),  # a one-task step
    ],
    ids=["batch-script", "torchrun-set-rank", "one-task-step"],
)
def test_from_slurm_leaves_other_environments_alone(env):
    before = dict(env)
    assert from_slurm(env) == []
    assert env == before


@pytest.mark.unit
@pytest.mark.parametrize("missing", ["MASTER_PORT", "MASTER_ADDR"])
def test_from_slurm_without_rank_zeros_address_names_what_is_missing(missing):
    with pytest.raises(RuntimeError, match=f"{missing} is not set"):
        from_slurm(step(**{missing: None}))


# --------------------------------------------------------------------------- a running cluster


@GROUP
def test_every_node_is_idle_and_srun_runs_a_task_on_each(cluster):
    sinfo = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
    assert sinfo.returncode == 0, sinfo.stdout
    assert dict(line.split() for line in sinfo.stdout.splitlines()) == {"node1": "idle", "node2": "idle"}
    assert cluster.run(["hostname"], timeout=10).stdout.strip() == "login"  # clients run on the login host
    out = cluster.run(["srun", "-N2", "-l", "hostname"], timeout=30)
    assert out.returncode == 0, out.stdout
    assert sorted(out.stdout.split("\n")[:-1]) == ["0: node1", "1: node2"], out.stdout
    # Each task's hostname is its node's: the one Slurm says it runs on.
    out = cluster.run(["srun", "-N2", "-l", "sh", "-c", 'echo "$(hostname) $SLURMD_NODENAME"'], timeout=30)
    assert out.returncode == 0, out.stdout
    assert sorted(out.stdout.split("\n")[:-1]) == ["0: node1 node1", "1: node2 node2"], out.stdout


@GROUP
def test_scancel_ends_a_running_jobs_ranks_at_once(cluster):
    """One rank per node, started by srun alone, with lessonlib.setup mapping Slurm's variables (chapter 17
    runs srun.sbatch and torchrun.sbatch to the end, asserts each rank's numbers, and cancels the torchrun
    form; this job is the one it does not run)."""
    lesson = ["lessons/12_preempt.py", "--no-handler", "--steps", "100", "--step-time", "0.5"]
    job = cluster.sbatch("lessons/slurm/srun.sbatch", *lesson, options=["--ntasks-per-node=1"])
    poll_until(lambda: "step 2 done" in cluster.output(job), STEP_BOUND, 0.2, f"'step 2 done' from job {job}")
    running = cluster.processes("lessons/")  # the batch script, srun and the ranks
    ranks = sorted(node for node, _, cmd in running if cmd.split()[0].endswith("python") and "slurm_script" not in cmd)
    assert ranks == ["node1", "node2"], running  # so the check below can fail
    cancelled = cluster.run(["scancel", job], timeout=10)
    assert cancelled.returncode == 0, cancelled.stdout
    poll_until(
        lambda: not cluster.processes("lessons/"),
        CANCEL_BOUND,
        what=lambda: f"every process of job {job} to end after scancel (left: {cluster.processes('lessons/')})",
    )
    assert cluster.wait(job, CANCEL_BOUND)["JobState"] == "CANCELLED"


# --------------------------------------------------------------------------- nothing left behind


def test_closing_normally_removes_everything(can_run_slurm):
    with Slurm(nodes=1) as cluster:
        token, folder = cluster.net.token, cluster.folder
        assert_running(token, folder)
    assert wait_gone(token, folder) == []


def test_an_exception_in_the_block_removes_everything_and_propagates(can_run_slurm):
    with pytest.raises(RuntimeError, match="raised inside"):
        with Slurm(nodes=1) as cluster:
            token, folder = cluster.net.token, cluster.folder
            assert_running(token, folder)
            raise RuntimeError("raised inside the with block")
    assert wait_gone(token, folder) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_an_interrupted_or_killed_owner_leaves_nothing(can_run_slurm, sig):
    """Ctrl-C: the block's exit stops the daemons and removes everything. SIGKILL (a notebook kernel killed):
    no code of the owner runs, and the keeper kills the daemons and removes the hosts and the folder."""
    child = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        token, folder = read_line(child, START_BOUND, "token from the child that starts the cluster").split()
        assert_running(token, folder)
        os.kill(child.pid, sig)
        child.wait(timeout=GONE_BOUND)
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in child.stderr.read()
        assert wait_gone(token, folder) == []
    finally:
        child.kill()  # its keeper then removes its cluster
        child.communicate(timeout=GONE_BOUND)


# --------------------------------------------------------------------------- fake GPUs (gpus=N)


@pytest.mark.unit
@pytest.mark.parametrize("gpus", [-1, 9, True, "2", 2.0])
def test_bad_gpus_are_refused_before_anything_is_made(gpus):
    error = refusal(dict(gpus=gpus))
    assert isinstance(error, ValueError), f"Slurm(gpus={gpus!r}) was not refused"
    says = "gpus (fake GPUs per node, as Slurm's GRES) must be an int from 0 to 8"
    assert says in str(error) and f"got {gpus!r}" in str(error), str(error)


@pytest.mark.unit
@pytest.mark.parametrize("gpus, files", [(2, "nvidia[0-1]"), (1, "nvidia0")])
def test_gres_confs_give_every_node_its_gpus_and_name_their_files(gpus, files):
    login = SimpleNamespace(name="login", address="198.18.0.1")
    nodes = [SimpleNamespace(name=f"node{i}", address=f"198.18.0.{i + 1}") for i in (1, 2)]
    text = slurm_conf("/f", login, nodes, 2)
    with_gpus, gres = gres_confs(text, "/f", gpus)
    lines = with_gpus.splitlines()
    node_lines = [i for i, line in enumerate(lines) if line.startswith("NodeName=")]
    assert lines.count("GresTypes=gpu") == 1 and lines.index("GresTypes=gpu") == node_lines[0] - 1, with_gpus
    assert all(lines[i].endswith(f" Gres=gpu:{gpus} State=UNKNOWN") for i in node_lines), with_gpus
    unchanged = [line.replace(f" Gres=gpu:{gpus}", "") for line in lines if line != "GresTypes=gpu"]
    assert unchanged == text.splitlines(), "gres_confs changed another line"
    assert gres == f"Name=gpu File=/f/dev/{files}\n"


def test_a_cluster_with_gpus_gives_each_task_its_own_and_leaves_nothing(can_run_slurm):
    """Two fake GPUs on one node, as GRES from the start: the device files exist, `--gpus-per-task=1` gives
    two tasks one each, a third GPU is refused, and closing removes the files with everything else."""
    with Slurm(nodes=1, gpus=2) as cluster:
        token, folder = cluster.net.token, cluster.folder
        devices = sorted((folder / "dev").iterdir())
        assert [d.name for d in devices] == ["nvidia0", "nvidia1"]
        assert all(stat.S_ISCHR(d.stat().st_mode) for d in devices), devices
        sinfo = cluster.run(["sinfo", "-h", "-N", "-o", "%N %G"], timeout=10)
        assert sinfo.stdout.split() == ["node1", "gpu:2"], sinfo.stdout
        show = 'echo "$SLURM_LOCALID $CUDA_VISIBLE_DEVICES"'
        out = cluster.run(["srun", "-n2", "--gpus-per-task=1", "--label", "bash", "-c", show], timeout=30)
        assert out.returncode == 0, out.stdout
        assert sorted(re.findall(r"^\d: (\d) (\S+)$", out.stdout, re.M)) == [("0", "0"), ("1", "1")], out.stdout
        too_many = cluster.run(["srun", "--gpus=3", "true"], timeout=30)
        assert too_many.returncode != 0 and "Requested node configuration is not available" in too_many.stdout
    assert wait_gone(token, folder) == []
