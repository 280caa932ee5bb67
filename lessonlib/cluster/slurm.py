"""A Slurm cluster on one Linux machine: a login host and compute nodes on `lessonlib.Hosts` (chapter 17).

    with lessonlib.Slurm(nodes=2) as cluster:          # hosts login, node1, node2 on one switch
        print(cluster.run(["srun", "-N2", "hostname"]).stdout)     # run on the login host, as a user would
        job = cluster.sbatch(script_text)               # a batch script; returns the job id
        cluster.wait(job)                               # its state when it ends ("COMPLETED", ...)
        print(cluster.output(job))                      # what it printed (slurm-JOBID.out)

The login host runs `slurmctld` (the controller) and `munged` (the credential daemon); each compute node
runs its own `slurmd` under its own hostname (`slurmd -N node1`), so `srun -N2` really starts tasks in two
network namespaces, and a task's `hostname` is its node's. Every file the cluster needs (slurm.conf,
cgroup.conf, a munge key, state, spool and log folders, job scripts and their output) is in one temporary
folder, shared by all hosts as a cluster's shared filesystem is: the namespaces share this machine's disk.

Settings a container's network namespaces need (each found by an error without it; chapter 17 shows them):
- cgroup.conf `CgroupPlugin=cgroup/v1`: `ip netns exec` mounts a fresh /sys, with no cgroup filesystem in
  it, and slurmd 22.05 always initialises a cgroup plugin ("No filesystem mounted on /sys/fs/cgroup").
  Nothing uses cgroups here: ProctrackType=proctrack/linuxproc tracks a job's processes by parentage, and
  TaskPlugin=task/none binds nothing.
- a spool folder per node (SlurmdSpoolDir=.../%n), made before slurmd starts.
- the node's layout as `slurmd -C` prints it (Sockets, CoresPerSocket, ThreadsPerCore), else slurmd
  reports "Node reconfigured socket/core boundaries".
- MailProg=/bin/true, since this machine has no mail program.
- munged's socket folder readable by all (mode 755); one munged serves every host, since a Unix socket
  is found through the filesystem, which the namespaces share.

GPUs, without any (`Slurm(nodes, gpus=N)`): each node lists N GPUs as a generic resource (GRES:
`GresTypes=gpu`, `Gres=gpu:N` on its line, gres.conf `Name=gpu File=...`), and the files gres.conf names
are character devices made with mknod in the folder's dev/ (nvidia0, nvidia1, ...), with /dev/null's
numbers, so that nothing that opens one reaches hardware. Slurm only counts them and sets each task's
CUDA_VISIBLE_DEVICES; nothing isolates them (no cgroups: TaskPlugin=task/none). They exist from the start:
slurmd reads gres.conf when it starts, and `scontrol reconfigure` refuses a change of GresTypes.

Cleanup. The folder's name and every daemon are in the Hosts' care before they exist: closing (normally,
by an exception, by Ctrl-C) cancels every job, stops the daemons and removes everything; when this process
dies without running any code (a notebook kernel killed), the Hosts' keeper kills every process in the
namespaces, daemons and jobs included, and removes the folder.

Needs what Hosts needs (Linux, iproute2, root) and Slurm (Debian: apt install slurm-wlm munge).
`unavailable()` says which is missing, or None.
"""

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from ..paths import ROOT
from ..processes.bounded import poll_until
from .hosts import Hosts, HostsUnavailable
from .hosts import unavailable as hosts_unavailable

MIN_NODES, MAX_NODES = 1, 3  # plus the login host: Hosts makes 2 to 4
MIN_CPUS, MAX_CPUS = 1, 16
MIN_GPUS, MAX_GPUS = 0, 8  # fake GPUs per node (GRES); 0: none
PROGRAMS = ("slurmctld", "slurmd", "munged", "srun", "sbatch", "scontrol", "scancel", "sinfo", "squeue")
CONTROLLER_PORT, NODE_PORT = 6817, 6818  # Slurm's defaults: free in fresh namespaces, which nothing else shares
CRED_EXPIRE = 10  # seconds; Slurm's default is 120 (see slurm_conf)
SCHED_INTERVAL = 2  # seconds; Slurm's defaults are 60 (main loop) and 30 (backfill)
IDLE_BOUND = 30.0  # seconds for every node to report idle
STOP_BOUND = 15.0  # seconds for jobs to end after scancel, and daemons after `scontrol shutdown`
CLIENT_BOUND = 30.0  # default seconds for one client command (srun, sbatch, ...)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL")


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the cluster; the message says why."""


def unavailable():
    """Why a cluster cannot run here (a sentence), or None."""
    if reason := hosts_unavailable():
        return reason
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"Slurm's {', '.join(missing)} not found (Debian: apt install slurm-wlm munge)"
    return None


def _check(nodes, cpus):
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not MIN_NODES <= nodes <= MAX_NODES:
        raise ValueError(
            f"nodes (compute nodes, besides the login host) must be an int from {MIN_NODES} to {MAX_NODES}; "
            f"got {nodes!r}"
        )
    if isinstance(cpus, bool) or not isinstance(cpus, int) or not MIN_CPUS <= cpus <= MAX_CPUS:
        raise ValueError(
            f"cpus (each node's CPUs, as Slurm counts them) must be an int from {MIN_CPUS} to {MAX_CPUS}; got {cpus!r}"
        )


def slurm_conf(folder, controller, nodes, cpus):
    """slurm.conf for a controller Host and compute node Hosts, everything in `folder`."""
    lines = [
        "ClusterName=lessons",
        f"SlurmctldHost={controller.name}({controller.address})",
        f"SlurmctldPort={CONTROLLER_PORT}",
        f"SlurmdPort={NODE_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: how long a job's credential lives, which is also how long a requeued job waits before
        # it may start again (120 s by default); sched_interval: how often pending jobs are looked at (60 s).
        f"AuthInfo=socket={folder}/munge/munge.sock,cred_expire={CRED_EXPIRE}",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool/%n",
        f"SlurmctldPidFile={folder}/run/slurmctld.pid",
        f"SlurmdPidFile={folder}/run/slurmd.%n.pid",
        f"SlurmctldLogFile={folder}/log/slurmctld.log",
        f"SlurmdLogFile={folder}/log/slurmd.%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/backfill",
        f"SchedulerParameters=sched_interval={SCHED_INTERVAL},bf_interval={SCHED_INTERVAL}",
        "InactiveLimit=0",
        "KillWait=5",
        "MailProg=/bin/true",
    ]
    for node in nodes:
        layout = f"CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1"
        lines.append(f"NodeName={node.name} NodeAddr={node.address} {layout} State=UNKNOWN")
    names = ",".join(n.name for n in nodes)
    lines.append(f"PartitionName=batch Nodes={names} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


# --- the caller's settings and partitions (chapter 18) -----------------------------------------------------
#
# Slurm(settings=["Key=Value", ...]) puts each line in slurm.conf in place of the cluster's own line for that
# key (KillWait=7 replaces KillWait=5), or before the node lines; Slurm.reconfigure(settings) does the same to
# a running cluster. Slurm(partitions={name: "Key=Value ...", ...}) replaces the one partition, batch, with
# these: each has every node, the first is the default, and each runs with MaxTime=INFINITE State=UP unless
# its options say otherwise. Refused, before anything is made: the keys below, which the cluster sets itself
# and cannot do without (its hosts, ports, users, paths and credentials, and how it tracks and binds
# processes inside namespaces: the module's docstring), and the nodes and default of a partition.
FIXED_KEYS = (
    "ClusterName SlurmctldHost ControlMachine SlurmctldPort SlurmdPort SlurmUser SlurmdUser AuthType CredType "
    "AuthInfo StateSaveLocation SlurmdSpoolDir SlurmctldPidFile SlurmdPidFile SlurmctldLogFile SlurmdLogFile "
    "ProctrackType TaskPlugin MailProg Include NodeName PartitionName NodeSet"
).split()
PARTITION_FIXED = ("PartitionName", "Nodes", "Default")  # every partition has every node; the first is the default
MAX_PARTITIONS = 4
SETTING = re.compile(r"([A-Za-z][A-Za-z0-9]*)=(\S+)")  # slurm.conf's Key=Value (fullmatch); keys ignore case
PARTITION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,14}")  # fullmatch


def _setting_problem(item, fixed, what):
    if not isinstance(item, str) or not (m := SETTING.fullmatch(item)):
        return f"each of {what} must be a string Key=Value with no space in it (e.g. 'SlurmdTimeout=3'); got {item!r}"
    if m[1].lower() in {k.lower() for k in fixed}:
        return f"{what} cannot set {m[1]}: the cluster sets it itself (as it does {', '.join(fixed)}); got {item!r}"
    return None


def _settings(settings):
    """`settings` as a tuple of checked Key=Value strings, or a ValueError saying what is wrong."""
    if isinstance(settings, str) or not isinstance(settings, (list, tuple)):
        raise ValueError(
            f"settings must be a list of slurm.conf lines Key=Value (e.g. ['SlurmdTimeout=3']); got {settings!r}"
        )
    for item in settings:
        if problem := _setting_problem(item, FIXED_KEYS, "settings"):
            raise ValueError(problem)
    keys = [item.split("=", 1)[0].lower() for item in settings]
    if dupes := sorted({k for k in keys if keys.count(k) > 1}):
        raise ValueError(f"settings names {', '.join(dupes)} more than once; got {settings!r}")
    return tuple(settings)


def _partitions(partitions):
    """`partitions` as a dict {name: (Key=Value, ...)}, or a ValueError saying what is wrong."""
    if partitions is None:
        return {"batch": ()}
    usage = "partitions must be a dict {name: 'Key=Value ...'} of 1 to %d partitions (e.g. {'batch': 'PriorityTier=1'})"
    if not isinstance(partitions, dict) or not 1 <= len(partitions) <= MAX_PARTITIONS:
        raise ValueError(f"{usage % MAX_PARTITIONS}; got {partitions!r}")
    checked = {}
    for name, options in partitions.items():
        if not isinstance(name, str) or not PARTITION_NAME.fullmatch(name):
            raise ValueError(f"a partition's name must be a letter then up to 14 letters, digits, _ or -; got {name!r}")
        if not isinstance(options, str):
            raise ValueError(f"{usage % MAX_PARTITIONS}: partition {name}'s options are not a string; got {options!r}")
        for item in options.split():
            if problem := _setting_problem(item, PARTITION_FIXED, f"partition {name}'s options"):
                raise ValueError(problem)
        checked[name] = tuple(options.split())
    return checked


def _with_settings(text, settings):
    """slurm.conf `text` with each of `settings` in place of the line that sets the same key, or added before
    the first node line."""
    lines = text.splitlines()
    for item in settings:
        key = item.split("=", 1)[0].lower()
        at = [i for i, line in enumerate(lines) if line.split("=", 1)[0].lower() == key]
        if at:
            lines[at[0]] = item
        else:
            first_node = next(i for i, line in enumerate(lines) if line.startswith("NodeName="))
            lines.insert(first_node, item)
    return "\n".join(lines) + "\n"


def _with_partitions(text, partitions, nodes):
    """slurm.conf `text` with `partitions` ({name: options}) in place of its partition lines: every node in
    each, the first the default."""
    lines = [line for line in text.splitlines() if not line.startswith("PartitionName=")]
    names = ",".join(n.name for n in nodes)
    for i, (name, options) in enumerate(partitions.items()):
        head = f"PartitionName={name} Nodes={names} Default={'YES' if i == 0 else 'NO'}"
        given = {o.split("=", 1)[0].lower() for o in options}
        rest = [o for o in ("MaxTime=INFINITE", "State=UP") if o.split("=", 1)[0].lower() not in given]
        lines.append(" ".join([head, *rest, *options]))
    return "\n".join(lines) + "\n"


def _check_gpus(gpus):
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not MIN_GPUS <= gpus <= MAX_GPUS:
        raise ValueError(
            f"gpus (fake GPUs per node, as Slurm's GRES) must be an int from {MIN_GPUS} to {MAX_GPUS}; got {gpus!r}"
        )


def gpu_files(folder, gpus):
    """The device files of a node's `gpus` fake GPUs: folder/dev/nvidia0, nvidia1, ... (every node names the
    same files, as every machine has its own /dev/nvidia0)."""
    return [Path(folder) / "dev" / f"nvidia{i}" for i in range(gpus)]


def gres_confs(slurm_text, folder, gpus):
    """slurm.conf's text with `gpus` GPUs on every node (GresTypes, Gres=gpu:N), and gres.conf's text."""
    files = gpu_files(folder, gpus)
    names = str(files[0]) if gpus == 1 else f"{files[0].parent}/nvidia[0-{gpus - 1}]"
    lines = []
    for line in slurm_text.splitlines():
        if line.startswith("NodeName="):
            if not lines or not lines[-1].startswith(("NodeName=", "GresTypes=")):
                lines.append("GresTypes=gpu")
            line = line.replace(" State=", f" Gres=gpu:{gpus} State=")
        lines.append(line)
    return "\n".join(lines) + "\n", f"Name=gpu File={names}\n"


class Slurm:
    """A login host and `nodes` compute nodes (1 to 3) of `cpus` CPUs each; see the module's docstring.
    `Slurm.unavailable()` says why a cluster cannot run here, or None."""

    unavailable = staticmethod(unavailable)
    CRED_EXPIRE = CRED_EXPIRE  # seconds a requeued job waits before it may start again (chapter 17)

    def __init__(self, nodes=2, *, cpus=2, settings=(), partitions=None, gpus=0):
        _check(nodes, cpus)
        _check_gpus(gpus)
        self.settings = _settings(settings)  # chapter 18: slurm.conf lines of the reader's, checked here
        self.partitions = _partitions(partitions)
        self.gpus = gpus
        self.cpus = cpus
        self.net = Hosts(nodes + 1, names=["login", *(f"node{i}" for i in range(1, nodes + 1))])
        self.login, *self.nodes = self.net.hosts
        self.folder = Path("/tmp") / f"lessonlib-slurm-{self.net.token}"
        self.conf = self.folder / "slurm.conf"
        self.jobs = self.folder / "jobs"
        self._daemons = {}
        self._submitted = 0
        self._started = False

    # --- lifetime ---------------------------------------------------------------------------------------

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def start(self):
        """Start the cluster and wait until every node is idle (bounded); then call close()."""
        if self._started:
            raise RuntimeError("this cluster is started already")
        if reason := unavailable():
            raise SlurmUnavailable(reason)
        self._started = True
        self.net.start()
        try:
            self.net.keep(self.folder)  # the keeper removes it even if this process dies
            self._write_files()
            self._start_daemons()
            self._wait_idle()
        except BaseException:
            self.close()
            raise
        return self

    def _write_files(self):
        f = self.folder
        for sub in ("munge", "state", "log", "run", "jobs", "tmp", *(f"spool/{n.name}" for n in self.nodes)):
            (f / sub).mkdir(parents=True, exist_ok=True)
        for path in (f, f / "munge"):
            path.chmod(0o755)  # munged: "execute permissions for all required" on its socket's folders
        key = f / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        text = slurm_conf(f, self.login, self.nodes, self.cpus)
        self.conf.write_text(_with_partitions(_with_settings(text, self.settings), self.partitions, self.nodes))
        (f / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")  # skips probing /sys/fs/cgroup
        if self.gpus:
            self._make_gpus()

    def _daemon(self, name, host, argv):
        with open(self.folder / "log" / f"{name}.out", "wb") as log:  # the daemon keeps its own copy open
            self._daemons[name] = self.net.popen(host, argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT)

    def _start_daemons(self):
        m = self.folder / "munge"
        munge = ["munged", "-F", f"--socket={m}/munge.sock", f"--key-file={m}/munge.key"]
        munge += [f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed", f"--log-file={m}/munged.log"]
        self._daemon("munged", self.login, munge)
        self._poll(lambda: (m / "munge.sock").exists(), 10, "munged to make its socket")
        self._daemon("slurmctld", self.login, ["slurmctld", "-D", "-f", self.conf])
        for node in self.nodes:
            self._daemon(f"slurmd.{node.name}", node, ["slurmd", "-D", "-N", node.name, "-f", self.conf])

    def _wait_idle(self):
        def idle():
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
            states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
            return out.returncode == 0 and len(states) == len(self.nodes) and set(states.values()) == {"idle"}

        self._poll(idle, IDLE_BOUND, "every node to be idle")

    def _poll(self, check, bound, what):
        def done():
            if check():
                return True
            for name, proc in self._daemons.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n{self.logs()}")
            return False

        poll_until(done, bound, 0.2, lambda: f"{what}; the daemons' logs:\n{self.logs()}")

    def logs(self, lines=15):
        """The last `lines` lines of each daemon's log, for an error message."""
        parts = []
        for path in sorted((self.folder / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def close(self):
        """Cancel every job, stop the daemons, remove the hosts and every file. Idempotent."""
        if not self._started or self.net.closed:
            return
        try:
            if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
                self._cancel_all()
                self.run(["scontrol", "shutdown"], timeout=STOP_BOUND)  # slurmctld and every slurmd
                self._daemons["munged"].send_signal(signal.SIGTERM)  # no client needs it any more
                deadline = time.monotonic() + STOP_BOUND
                for proc in self._daemons.values():
                    try:
                        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass  # the Hosts' close kills it
        finally:
            self.net.close()  # kills whatever is left in the hosts, removes them and the folder

    def _cancel_all(self):
        jobs = self.run(["squeue", "-h", "-o", "%i"], timeout=10).stdout.split()
        if not jobs:
            return
        self.run(["scancel", *jobs], timeout=10)
        with contextlib.suppress(TimeoutError):  # close() then shuts the daemons down all the same
            poll_until(lambda: not self.run(["squeue", "-h", "-o", "%i"], timeout=10).stdout.split(), STOP_BOUND, 0.2)

    # --- using it -------------------------------------------------------------------------------------

    def env(self):
        """The environment of a command on this cluster: this process's, without any SLURM_ variable (this
        notebook may itself run inside a real Slurm job), with SLURM_CONF naming this cluster's slurm.conf and
        this Python's folder first on PATH (so that jobs find this `python` and `torchrun`), and TMPDIR in the
        cluster's folder, as many clusters give each job a temporary folder of its own."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env["TMPDIR"] = str(self.folder / "tmp")  # jobs' temporary files (torchrun's logs) go with the cluster
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
        return env

    def run(self, argv, timeout=CLIENT_BOUND, *, host=None, input=None):
        """Run a command on `host` (the login host by default) in the repository's root, bounded; returns
        its Finished (returncode, stdout with stderr, seconds, timed_out). For `srun` and other commands that
        end with their work: on a timeout it kills what the command started, jobs' tasks included."""
        from ..processes.bounded import run_bounded

        self._live()
        prefix = self.net.prefix(host or self.login)
        return run_bounded([*prefix, *map(str, argv)], timeout, cwd=ROOT, env=self.env(), input=input)

    def sbatch(self, script, *args, options=(), timeout=CLIENT_BOUND):
        """Submit a batch script from the login host, in the repository's root, with `args` after it (what the
        script reads as "$@"), and sbatch's `options` before it; return the job id. `script` is a file's path
        (relative to the repository's root), or a script's text (anything with a newline), which is written
        to the cluster's jobs/ folder first. The job's output goes to jobs/slurm-JOBID.out (read it with
        output()) unless `options` say otherwise."""
        self._live()
        if "\n" in str(script):
            self._submitted += 1
            path = self.jobs / f"script-{self._submitted}.sbatch"
            path.write_text(script)
        else:
            path = ROOT / script
            if not path.is_file():
                raise ValueError(f"no batch script {script}: give a file's path (from {ROOT}) or a script's text")
        argv = ["sbatch", "--parsable", f"--output={self.jobs}/slurm-%j.out", *map(str, options), path, *args]
        # Not run_bounded: the job inherits this environment, and run_bounded's mark would have its end kill it.
        out = subprocess.run(
            [*self.net.prefix(self.login), *map(str, argv)],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"sbatch refused {path.name}: {(out.stderr or out.stdout).strip()}")
        return out.stdout.strip().split(";")[0]

    def job(self, job):
        """scontrol's fields of a job (JobState, NodeList, Restarts, ExitCode, ...) as a dict."""
        out = self.run(["scontrol", "-o", "show", "job", str(job)], timeout=10)
        if out.returncode != 0:
            raise RuntimeError(f"no job {job}: {out.stdout.strip()}")
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def wait(self, job, timeout=120, *, states=ENDED):
        """Wait until the job's state is one of `states` (by default: it has ended); return its fields.
        TimeoutError after `timeout` seconds (the job is left running: close() cancels it)."""
        last = {}

        def ended():
            last.clear()
            last.update(self.job(job))
            return dict(last) if last.get("JobState") in states else None

        return poll_until(
            ended, timeout, 0.2, lambda: f"job {job} to be {' or '.join(states)} (it is {last.get('JobState')})"
        )

    def output(self, job):
        """What the job has written to jobs/slurm-JOBID.out so far ('' before it starts)."""
        path = self.jobs / f"slurm-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def processes(self, pattern=""):
        """Processes running on the compute nodes whose command line contains `pattern`, as (node, pid,
        command line), Slurm's own daemons and step managers left out: what a job left behind."""
        found = []
        for node in self.nodes:
            out = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True, text=True, timeout=10)
            for pid in out.stdout.split():
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                except OSError:
                    continue
                # slurmstepd renames itself "slurmstepd: [JOB.STEP]": its first word ends with a colon
                program = os.path.basename(cmd.split(" ")[0]).rstrip(":") if cmd else ""
                if cmd and program not in ("slurmd", "slurmstepd", "unshare", "ip") and pattern in cmd:
                    found.append((node.name, int(pid), cmd))
        return found

    def _live(self):
        if not self._started or self.net.closed:
            raise RuntimeError("this cluster is not running: use it inside its `with` block")

    def reconfigure(self, settings, timeout=CLIENT_BOUND):
        """Change slurm.conf's lines for `settings` (Key=Value strings, as the constructor's `settings=` takes,
        checked the same way before anything changes) and have every daemon re-read it (`scontrol
        reconfigure`, bounded), as an administrator would (chapter 18). RuntimeError with scontrol's answer
        and the daemons' logs if they refuse it."""
        settings = _settings(settings)
        self._live()
        self.conf.write_text(_with_settings(self.conf.read_text(), settings))
        out = self.run(["scontrol", "reconfigure"], timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"scontrol reconfigure refused {list(settings)}: {out.stdout.strip()}\n{self.logs()}")

    # --- fake GPUs (gpus=N) -----------------------------------------------------------------------------

    def _make_gpus(self):
        """Each node's GPUs as GRES: the device files (character devices with /dev/null's numbers, in the
        cluster's folder, which the keeper removes), Gres=gpu:N on every node line, and gres.conf."""
        files = gpu_files(self.folder, self.gpus)
        files[0].parent.mkdir(exist_ok=True)
        for path in files:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        text, gres = gres_confs(self.conf.read_text(), self.folder, self.gpus)
        self.conf.write_text(text)
        (self.folder / "gres.conf").write_text(gres)


__all__ = ["Slurm", "SlurmUnavailable", "HostsUnavailable", "unavailable", "slurm_conf", "gres_confs"]
