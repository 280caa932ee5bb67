"""Chapter 17's job scripts (lessons/slurm/*.sbatch), as a reader copies them, on the chapter's kind of cluster.

Each script activates the virtual environment and sets OMP_NUM_THREADS before its srun line, and each srun
line passes `--export=ALL` (sbatch --export=NONE would otherwise reach the tasks through srun, and no task
would find python), `--kill-on-bad-exit=1` (Slurm's default, KillOnBadExit=0, leaves the other tasks
waiting) and `--cpus-per-task` again (since Slurm 22.05 srun does not inherit sbatch's). On a real two-node
lessonlib.Slurm cluster: torchrun.sbatch runs a correct job of 4 ranks; when one node's torchrun fails while
the other's rank waits without any collective, Slurm ends the waiting one within seconds, and with the
option set to 0 it does not (the control), and the waiting rank had the task's CPUs as its threads;
srun.sbatch submitted with --export=NONE still runs the venv's python with one thread per rank; and
requeue.sbatch comes back after a real preemption (Slurm's SIGTERM to the ranks, none to the script) and
resumes exactly. The chapter runs srun.sbatch, requeue.sbatch under its time limit's signal and without
`B:`, and the pair with and without --kill-on-bad-exit itself; tests/test_slurm.py runs srun.sbatch too.
"""

import re
import time
from pathlib import Path

import pytest

from lessonlib import ROOT
from lessonlib.cluster.slurm import Slurm, unavailable
from lessonlib.processes.bounded import poll_until

SCRIPTS = sorted((ROOT / "lessons" / "slurm").glob("*.sbatch"))
JOB_BOUND = 120.0  # seconds for a job of torch ranks to end (about 10 s here)
STEP_BOUND = 60.0  # seconds for a job's ranks to print their first steps
KILLED_BOUND = 30.0  # seconds for Slurm to end the waiting node after the other failed (a few here)
WAITING = 10.0  # seconds the control job must still be running after its other node failed
GROUP = pytest.mark.xdist_group("ch17-scripts")  # one cluster, one worker, the tests in file order

# A rank that fails on the second node while the first node's rank waits, in no collective (so nothing in
# torch ends it): only Slurm can end the first node's torchrun.
FAIL_OR_WAIT = """import os, sys, time
if os.environ["GROUP_RANK"] == "1":
    sys.exit("node 1's rank fails")
print(f"node 0's rank: waiting, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
time.sleep(300)
"""

# What a task of srun.sbatch reports: the Python that runs it and its threads.
WHICH_PYTHON = """import os, sys
print(f"python={sys.prefix} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
"""
ACTIVATE = 'source "${VIRTUAL_ENV:-$SLURM_SUBMIT_DIR/.venv}/bin/activate"'


def srun_lines(path):
    """The script's srun commands, each with its continuation lines joined."""
    text = path.read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().startswith("srun ")]


@pytest.mark.unit
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_srun_line_ends_the_step_on_a_bad_exit_and_asks_for_the_cpus_again(path):
    lines = srun_lines(path)
    assert lines, f"{path.name} runs no srun"
    for line in lines:
        assert "--kill-on-bad-exit=1" in line, f"{path.name}: {line}"
        assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in line, f"{path.name}: {line}"
        assert "--export=ALL" in line, f"{path.name}: {line}"


@pytest.mark.unit
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_script_activates_the_venv_and_sets_the_threads_before_its_first_srun(path):
    lines = [line.strip() for line in path.read_text().splitlines()]
    first_srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert ACTIVATE in lines[:first_srun], f"{path.name} does not activate the venv before srun"
    threads = [line for line in lines[:first_srun] if line.startswith("export OMP_NUM_THREADS=")]
    assert threads, f"{path.name} does not set OMP_NUM_THREADS before srun"
    if path.name == "torchrun.sbatch":  # several ranks share the task's CPUs
        assert "SLURM_CPUS_PER_TASK / ranks_per_node" in threads[0], threads
    else:  # one rank per task
        assert threads[0].startswith("export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}"), threads


@pytest.fixture(scope="module")
def cluster():
    if reason := unavailable():
        pytest.skip(reason)
    with Slurm(nodes=2) as cluster:
        yield cluster


@GROUP
@pytest.mark.timeout(240)
def test_torchrun_sbatch_runs_a_correct_job_of_4_ranks(cluster):
    job = cluster.sbatch("lessons/slurm/torchrun.sbatch", "lessons/17_ranks.py", "--expect-world", "4")
    fields, out = cluster.wait(job, JOB_BOUND), cluster.output(job)
    assert fields["JobState"] == "COMPLETED", out
    assert out.count("a correct job of 4 ranks") == 4, out


@GROUP
@pytest.mark.timeout(240)
def test_a_failing_node_makes_slurm_end_the_waiting_one_and_without_the_option_it_waits(cluster):
    script = cluster.jobs / "fail_or_wait.py"
    script.write_text(FAIL_OR_WAIT)
    one_rank = (ROOT / "lessons/slurm/torchrun.sbatch").read_text().replace("ranks_per_node=2", "ranks_per_node=1")
    assert "--kill-on-bad-exit=1" in one_rank and "ranks_per_node=1" in one_rank
    for kill in (1, 0):
        text = one_rank.replace("--kill-on-bad-exit=1", f"--kill-on-bad-exit={kill}")
        job = cluster.sbatch(text, script)
        poll_until(
            lambda job=job: re.search(r"srun: error: node2: task 1: Exited", cluster.output(job)),
            JOB_BOUND,
            0.2,
            f"srun to report task 1's failure in job {job}",
        )
        failed = time.monotonic()
        # One rank per node, the node's 2 CPUs: its threads, where torchrun alone would set none.
        assert "node 0's rank: waiting, OMP_NUM_THREADS=2" in cluster.output(job), cluster.output(job)
        if kill:
            fields = cluster.wait(job, KILLED_BOUND)
            took = time.monotonic() - failed
            assert fields["JobState"] == "FAILED" and took < KILLED_BOUND, (fields["JobState"], took)
            assert re.search(r"STEP \d+\.0 ON node1 CANCELLED", cluster.output(job)), cluster.output(job)
        else:
            time.sleep(WAITING)
            state = cluster.job(job)["JobState"]
            cluster.run(["scancel", job], timeout=10)
            assert state == "RUNNING", f"with --kill-on-bad-exit=0 the job was {state} {WAITING:.0f} s later"
            cluster.wait(job, 30)


@GROUP
@pytest.mark.timeout(120)
def test_srun_sbatch_submitted_without_the_environment_runs_the_venvs_python(cluster):
    """sbatch --export=NONE: the batch script gets no PATH of the submitter's and srun would pass that on
    (SLURM_EXPORT_ENV); the script activates the repository's .venv and gives srun --export=ALL."""
    venv = ROOT / ".venv"
    if not (venv / "bin" / "activate").is_file():
        pytest.skip(f"no virtual environment at {venv} (make setup makes it), which the script falls back to")
    script = cluster.jobs / "which_python.py"
    script.write_text(WHICH_PYTHON)
    job = cluster.sbatch("lessons/slurm/srun.sbatch", script, options=["--export=NONE"])
    fields, out = cluster.wait(job, JOB_BOUND), cluster.output(job)
    assert fields["JobState"] == "COMPLETED", out
    found = re.findall(r"^\d+: python=(\S+) OMP_NUM_THREADS=(\S+)$", out, re.M)
    assert len(found) == 4, out
    assert {(str(Path(p).resolve()), n) for p, n in found} == {(str(venv.resolve()), "1")}, out


@GROUP
@pytest.mark.timeout(300)
def test_requeue_sbatch_comes_back_after_a_real_preemption_and_resumes_exactly(cluster):
    """Partition `urgent` may preempt `batch` (PreemptMode=REQUEUE, GraceTime 30 s), as in the chapter. The
    script gets no signal; the ranks get SIGTERM and save; the script sees PreemptTime and requeues."""
    conf = cluster.conf.read_text()
    batch = next(line for line in conf.splitlines() if line.startswith("PartitionName=batch"))
    conf = conf.replace(batch, f"{batch} PriorityTier=1 GraceTime=30")
    conf += "PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE\n"
    conf += "PartitionName=urgent Nodes=node1,node2 PriorityTier=2 PreemptMode=OFF\n"
    cluster.conf.write_text(conf)
    assert cluster.run(["scontrol", "reconfigure"], timeout=30).returncode == 0
    ckpt = cluster.folder / "checkpoints" / "test-preempt"
    lesson = ["lessons/12_preempt.py", "--dir", ckpt, "--steps", "8", "--every", "100", "--step-time", "0.5"]
    job = cluster.sbatch("lessons/slurm/requeue.sbatch", *lesson)
    poll_until(lambda: "step 2 done" in cluster.output(job), STEP_BOUND, 0.2, f"step 2 of job {job}")
    urgent = cluster.sbatch("#!/bin/bash\n#SBATCH --nodes=2\nsrun hostname\n", options=["--partition=urgent"])
    fields = cluster.wait(job, JOB_BOUND + 60, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"))
    out = cluster.output(job)
    assert cluster.wait(urgent, 30)["JobState"] == "COMPLETED"
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", out
    assert "batch: preempted" in out and "batch: SIGUSR1" not in out, out
    saved = set(re.findall(r"SIGTERM: saved step (\d+)", out))
    assert len(saved) == 1 and set(re.findall(r"starting at step (\d+)", out)) == {"0", *saved}, out
    gaps = re.findall(r"gap to one uninterrupted process: (\S+)", out)
    assert len(gaps) == 2 and all(float(g) <= 1e-12 for g in gaps), out
