"""Chapter 18's additions to lessonlib.Slurm: slurm.conf settings and partitions of the caller's, `reconfigure`,
and `processes()` without Slurm's step managers; real Slurm daemons for what the chapter relies on.

Bad settings, partitions and reconfigurations are refused before anything is made (unit, like test_slurm.py's
refusals); the slurm.conf text they make is read back (unit). One real cluster then holds what chapter 18
needs of it: the settings in force (`scontrol show config`), both partitions, `reconfigure` changing a value,
`processes()` listing a job's processes and no `slurmstepd: [JOB.STEP]` (which the nodes do run), and a node
whose cable is pulled mid-job going DOWN, its job requeued, the node back once plugged in, and nothing of the
cluster left after it closes.
"""

import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from lessonlib.cluster.slurm import (
    FIXED_KEYS,
    Slurm,
    _partitions,
    _settings,
    _with_partitions,
    _with_settings,
    slurm_conf,
    unavailable,
)
from lessonlib.processes.bounded import poll_until
from test_slurm import refusal, wait_gone

pytestmark = pytest.mark.timeout(240)  # a backstop: every wait below has its own, shorter bound

DOWN_BOUND = 40.0  # seconds for a silent node to be DOWN: SlurmdTimeout=3 plus a ping's MessageTimeout=5 (9-16 s here)
BACK_BOUND = 30.0  # seconds for a node plugged back in to be in service (1 s here)
JOB_BOUND = 30.0  # seconds for a job of two shell loops to run on both nodes, or to be requeued
PREEMPTION = ["PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE"]  # chapter 18's partitions
NODE_FAILURE = ["SlurmdTimeout=3", "MessageTimeout=5"]  # chapter 18's: a silent node is DOWN within seconds
LOOP = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
srun --label bash -c 'while :; do echo "$(hostname) alive"; sleep 0.5; done'
"""


# --------------------------------------------------------------------------- refused before anything is made


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(settings="SlurmdTimeout=3"), "settings must be a list of slurm.conf lines Key=Value"),
        (dict(settings={"SlurmdTimeout": 3}), "settings must be a list of slurm.conf lines Key=Value"),
        (dict(settings=["SlurmdTimeout"]), "each of settings must be a string Key=Value with no space in it"),
        (dict(settings=["SlurmdTimeout= 3"]), "each of settings must be a string Key=Value with no space in it"),
        (dict(settings=["SlurmdTimeout=3\nSlurmUser=nobody"]), "each of settings must be a string Key=Value"),
        (dict(settings=["SlurmdTimeout=3\n"]), "each of settings must be a string Key=Value with no space in it"),
        (dict(settings=[3]), "each of settings must be a string Key=Value with no space in it"),
        (dict(settings=["SlurmctldPort=7000"]), "settings cannot set SlurmctldPort: the cluster sets it itself"),
        (dict(settings=["nodename=node9"]), "settings cannot set nodename: the cluster sets it itself"),
        (dict(settings=["PartitionName=x"]), "settings cannot set PartitionName: the cluster sets it itself"),
        (dict(settings=["KillWait=5", "killwait=7"]), "settings names killwait more than once"),
        (dict(partitions=[("batch", "")]), "partitions must be a dict {name: 'Key=Value ...'} of 1 to 4 partitions"),
        (dict(partitions={}), "partitions must be a dict {name: 'Key=Value ...'} of 1 to 4 partitions"),
        (dict(partitions={f"p{i}": "" for i in range(5)}), "of 1 to 4 partitions"),
        (dict(partitions={"9lives": ""}), "a partition's name must be a letter then up to 14 letters, digits, _ or -"),
        (dict(partitions={"a b": ""}), "a partition's name must be a letter then up to 14 letters, digits, _ or -"),
        (dict(partitions={"batch\n": ""}), "a partition's name must be a letter then up to 14 letters, digits, _ or -"),
        (dict(partitions={"batch": ["PriorityTier=1"]}), "partition batch's options are not a string"),
        (dict(partitions={"batch": "PriorityTier"}), "each of partition batch's options must be a string Key=Value"),
        (dict(partitions={"batch": "Nodes=node1"}), "partition batch's options cannot set Nodes"),
        (dict(partitions={"batch": "default=NO"}), "partition batch's options cannot set default"),
    ],
)
def test_bad_settings_and_partitions_are_refused_saying_what_is_allowed(kwargs, says):
    """Refused in the constructor, with the value named: no process (the unit mark's audit hook), no file,
    no namespace (test_slurm.refusal)."""
    error = refusal(kwargs)
    assert isinstance(error, ValueError), f"Slurm({kwargs}) was not refused"
    assert says in str(error), str(error)
    assert "got " in str(error), str(error)


@pytest.mark.unit
def test_reconfigure_refuses_bad_settings_before_it_touches_anything():
    """The same check as the constructor's, before the cluster is even looked at: a cluster never started
    refuses a bad setting with the setting's error, and a good one with 'not running'."""
    cluster = Slurm(nodes=1)
    with pytest.raises(ValueError, match="cannot set SlurmdSpoolDir"):
        cluster.reconfigure(["SlurmdSpoolDir=/tmp"])
    with pytest.raises(ValueError, match="must be a list"):
        cluster.reconfigure("SlurmdTimeout=3")
    with pytest.raises(RuntimeError, match="this cluster is not running"):
        cluster.reconfigure(["SlurmdTimeout=3"])


@pytest.mark.unit
def test_every_fixed_key_is_one_the_cluster_writes_or_one_that_would_replace_its_lines():
    """What settings= may not touch is what slurm_conf writes about hosts, ports, users, paths, credentials
    and tracking, plus the keys that would add nodes, partitions or files (so a refusal's list is not stale)."""
    host = SimpleNamespace(name="login", address="198.18.0.1")
    written = {line.split("=")[0] for line in slurm_conf("/f", host, [host], 2).splitlines()}
    extra = {"ControlMachine", "Include", "NodeSet"}  # not written, but each would change the cluster's shape
    assert set(FIXED_KEYS) - extra <= written, set(FIXED_KEYS) - written
    for key in ("SlurmdTimeout", "KillWait", "SchedulerParameters", "PreemptType", "ReturnToService"):
        assert key not in FIXED_KEYS and _settings([f"{key}=1"]) == (f"{key}=1",)


# --------------------------------------------------------------------------- the slurm.conf they make


def conf(settings=(), partitions=None):
    """slurm.conf as Slurm(settings=..., partitions=...).start() writes it, for two nodes."""
    nodes = [SimpleNamespace(name=f"node{i}", address=f"198.18.0.{i + 1}") for i in (1, 2)]
    text = slurm_conf("/f", SimpleNamespace(name="login", address="198.18.0.1"), nodes, 2)
    return _with_partitions(_with_settings(text, _settings(list(settings))), _partitions(partitions), nodes)


@pytest.mark.unit
def test_a_setting_replaces_the_clusters_line_or_comes_before_the_nodes():
    default = conf().splitlines()
    text = conf(["KillWait=7", "SlurmdTimeout=3"]).splitlines()
    assert "KillWait=5" in default and "KillWait=7" not in default
    assert text.count("KillWait=7") == 1 and "KillWait=5" not in text
    assert text.index("KillWait=7") == default.index("KillWait=5")  # in place
    assert text.index("SlurmdTimeout=3") < min(i for i, line in enumerate(text) if line.startswith("NodeName="))
    assert len(text) == len(default) + 1


@pytest.mark.unit
def test_partitions_each_have_every_node_and_the_first_is_the_default():
    assert [line for line in conf().splitlines() if line.startswith("PartitionName=")] == [
        "PartitionName=batch Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP"
    ]
    text = conf(partitions={"low": "PriorityTier=1 GraceTime=10", "high": "PriorityTier=2 MaxTime=5"})
    assert [line for line in text.splitlines() if line.startswith("PartitionName=")] == [
        "PartitionName=low Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=10",
        "PartitionName=high Nodes=node1,node2 Default=NO State=UP PriorityTier=2 MaxTime=5",  # its own MaxTime
    ]


# --------------------------------------------------------------------------- a real cluster


def node_state(cluster, node):
    out = cluster.run(["sinfo", "--Node", "--noheader", "--format=%N %t"], timeout=10).stdout
    return dict(line.split() for line in out.splitlines() if len(line.split()) == 2).get(node, "")


def step_managers(cluster):
    """The `slurmstepd: [JOB.STEP]` processes on the compute nodes, read from each namespace's pids."""
    found = []
    for node in cluster.nodes:
        pids = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True, text=True, timeout=10)
        for pid in pids.stdout.split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if cmd.startswith("slurmstepd"):
                found.append((node.name, int(pid), cmd))
    return found


def test_settings_partitions_reconfigure_processes_and_a_node_that_dies():
    """Chapter 18's cluster, one job: what it relies on, each with a check that could fail."""
    if reason := unavailable():
        pytest.skip(reason)
    partitions = {"batch": "PriorityTier=1 GraceTime=10", "urgent": "PriorityTier=2 PreemptMode=OFF"}
    with Slurm(nodes=2, settings=[*PREEMPTION, *NODE_FAILURE], partitions=partitions) as c:
        token, folder = c.net.token, c.folder
        config = re.sub(r" +", " ", c.run(["scontrol", "show", "config"], timeout=10).stdout)
        assert "SlurmdTimeout = 3 sec" in config and "MessageTimeout = 5 sec" in config, config
        assert "PreemptType = preempt/partition_prio" in config, config
        sinfo = c.run(["sinfo", "--noheader", "--format=%P %N"], timeout=10).stdout.split()
        assert sinfo == ["batch*", "node[1-2]", "urgent", "node[1-2]"], sinfo
        c.reconfigure(["KillWait=7"])
        assert "KillWait = 7 sec" in re.sub(r" +", " ", c.run(["scontrol", "show", "config"], timeout=10).stdout)

        job = c.sbatch(LOOP, options=["--open-mode=append"])
        poll_until(lambda: "node2 alive" in c.output(job), JOB_BOUND, 0.2, f"job {job}'s loop on node2")
        listed = c.processes("alive")
        loops = {node: pid for node, pid, cmd in listed if cmd.startswith("/usr/bin/bash")}  # srun's tasks
        assert sorted(loops) == ["node1", "node2"], listed
        managers = step_managers(c)
        assert any(cmd == f"slurmstepd: [{job}.0]" for _, _, cmd in managers), managers  # so the next can fail
        assert not [p for p in c.processes() if p[2].startswith("slurmstepd")], c.processes()

        c.net.set_link("node2", False)
        poll_until(lambda: node_state(c, "node2").startswith("down"), DOWN_BOUND, 0.2, "node2 to be DOWN")
        poll_until(lambda: c.job(job)["Restarts"] == "1", JOB_BOUND, 0.2, f"job {job} to be requeued")
        assert c.job(job)["JobState"] in ("PENDING", "REQUEUED", "CONFIGURING", "RUNNING"), c.job(job)
        assert loops["node2"] in {pid for _, pid, _ in c.processes("alive")}  # cut off, not dead: it runs on
        c.net.set_link("node2", True)
        poll_until(lambda: node_state(c, "node2") in ("idle", "mix", "alloc"), BACK_BOUND, 0.2, "node2 back")
        poll_until(
            lambda: loops["node2"] not in {pid for _, pid, _ in c.processes("alive")},
            JOB_BOUND,
            0.2,
            "node2's slurmd to end the loop of the job the controller requeued",
        )
    assert wait_gone(token, folder) == [], "a cluster that lost and got back a node left something"
    assert not os.path.exists(folder)
