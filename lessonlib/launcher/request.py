"""What `lessonlib.launch` is asked to run, checked before anything starts (chapter 1).

`check_launch` turns launch's arguments into one frozen LaunchSpec, or raises a ValueError or
FileNotFoundError that says what was wrong and what is allowed (a TMPDIR that is not a folder too:
lessonlib.launcher.faults.TmpdirMissing, a FileNotFoundError). Only the standard library is needed
here (torch only to check 'nccl'), so `python -m lessonlib --help` can read the bounds without
importing `launch` (lessonlib.launcher.core) or psutil.
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ..machine import nvidia_devices
from ..paths import ROOT, find_script, script_candidates
from .faults import check_tmpdir
from .runfolder import PREFIX

MAX_NPROC = 16  # ranks per node; each is a whole Python process with torch loaded (~0.3 GB each)
MAX_NNODES = 4  # simulated nodes on this one machine
MAX_TIMEOUT = 3600.0
MAX_RESTARTS = 5  # torchrun --max-restarts: whole-group restarts after a failure (chapter 12)
BACKENDS = ("gloo", "nccl")
LAUNCHERS = ("torchrun", "torch.distributed.launch")
RENDEZVOUS = ("c10d", "static")
# torchrun sets these for each rank; a value passed in `env` would be silently overwritten. Without
# them (plain `python lessons/X.py`), lessonlib.setup makes a group of one.
TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# PYTHONUNBUFFERED is lessonlib's: the live view needs every line flushed. (PYTHONPATH in `env` is kept,
# after the course root.)
RESERVED_ENV = (*TORCHRUN_ENV, "PYTHONUNBUFFERED")
# torchrun options a launch may add (torchrun_args=): the launcher sets the others itself.
TORCHRUN_OPTIONS = ("--rdzv-endpoint", "--rdzv-conf", "--nnodes", "--monitor-interval")


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """One launch, checked: what runs, how many times, for how long, and where."""

    script: Path  # the lesson file, resolved
    shown: str  # the script as results and views name it: relative to cwd when it lies inside
    args: tuple  # the lesson's own arguments, as strings
    nproc: int  # ranks per node
    nnodes: int  # torchrun agents, each standing for a machine
    timeout: float  # seconds for the whole run
    env: MappingProxyType  # variables every rank gets on top of this process's environment
    backend: str | None  # forced process-group backend; None lets lessonlib.setup() pick
    launcher: str  # 'torchrun' or the deprecated 'torch.distributed.launch'
    rendezvous: str  # how several agents meet: 'c10d' or 'static'
    cwd: Path  # where the agents and ranks run
    max_restarts: int = 0  # torchrun restarts every rank this many times at most after one fails
    hosts: tuple = ()  # the lessonlib.cluster.hosts.Host of each agent (chapter 16); () for this machine
    torchrun_args: tuple = ()  # more torchrun options, after the launcher's own (the last of a repeated one wins)

    @property
    def world_size(self):
        return self.nproc * self.nnodes


def check_launch(
    script,
    nproc,
    args,
    timeout,
    env,
    *,
    nnodes,
    backend,
    launcher,
    rendezvous,
    cwd,
    max_restarts=0,
    hosts=None,
    torchrun_args=None,
):
    """launch's arguments as a LaunchSpec; raises ValueError or FileNotFoundError before anything starts."""
    path = resolve_script(script, cwd)
    _refuse("nproc", ranks_problem(nproc))
    hosts = _check_hosts(hosts)
    if hosts:
        if nnodes not in (1, len(hosts)):
            raise ValueError(f"nnodes is one per host with hosts=: {len(hosts)}, or leave it out; got {nnodes!r}")
        if launcher != "torchrun":
            raise ValueError(f"hosts= needs launcher='torchrun'; got {launcher!r}")
        nnodes = len(hosts)
    torchrun_args = _check_torchrun_args(torchrun_args)
    _check_int("nnodes", nnodes, 1, MAX_NNODES, "simulated nodes share this one machine")
    _check_int("max_restarts", max_restarts, 0, MAX_RESTARTS, "each restart starts every rank again")
    args = _check_args(args)
    env = _check_env(env)
    _refuse("timeout", timeout_problem(timeout))
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    if max_restarts and launcher != "torchrun":
        raise ValueError(
            f"max_restarts needs launcher='torchrun' (the deprecated launcher has no restarts); got {launcher!r}"
        )
    if rendezvous not in RENDEZVOUS:
        raise ValueError(f"rendezvous must be one of {', '.join(RENDEZVOUS)}; got {rendezvous!r}")
    check_backend(backend, nproc)
    cwd = Path(cwd).resolve() if cwd is not None else ROOT
    if not cwd.is_dir():
        raise FileNotFoundError(f"cwd {str(cwd)!r} is not a directory")
    check_tmpdir(env)  # a TMPDIR (this process's, or env's for the ranks) that is not a folder: a FileNotFoundError
    shown = os.path.relpath(path, cwd) if path.is_relative_to(cwd) else str(path)
    return LaunchSpec(
        script=path,
        shown=shown,
        args=tuple(args),
        nproc=nproc,
        nnodes=nnodes,
        timeout=timeout,
        env=MappingProxyType(env),
        backend=backend,
        launcher=launcher,
        rendezvous=rendezvous,
        cwd=cwd,
        max_restarts=max_restarts,
        hosts=hosts,
        torchrun_args=torchrun_args,
    )


def _check_hosts(hosts):
    """() or the hosts as a tuple of lessonlib.cluster.hosts.Host, each still there."""
    if hosts is None:
        return ()
    from ..cluster.hosts import Host, Hosts

    if isinstance(hosts, Hosts):
        if hosts.closed:
            raise ValueError("hosts= names a Hosts that is closed: launch inside its `with` block")
        hosts = hosts.hosts
    if not isinstance(hosts, (list, tuple)) or not all(isinstance(h, Host) for h in hosts):
        raise ValueError(f"hosts must be a lessonlib.Hosts or a list of its hosts; got {hosts!r}")
    if not 1 <= len(hosts) <= MAX_NNODES or len(set(hosts)) != len(hosts):
        raise ValueError(f"hosts must be 1 to {MAX_NNODES} different hosts, one torchrun agent each; got {hosts!r}")
    for h in hosts:
        if not Path(f"/run/netns/{h.namespace}").exists():
            raise ValueError(
                f"host {h.name} is gone (no network namespace {h.namespace}): launch inside its `with` block"
            )
    return tuple(hosts)


def _check_torchrun_args(options):
    if options is None:
        return ()
    if isinstance(options, str) or not isinstance(options, (list, tuple)):
        raise ValueError(f"torchrun_args must be a list of '--option=value' strings; got {options!r}")
    for o in options:
        if not isinstance(o, str) or "=" not in o or o.split("=", 1)[0] not in TORCHRUN_OPTIONS:
            raise ValueError(
                f"torchrun_args takes '--option=value' for the options {', '.join(TORCHRUN_OPTIONS)} "
                f"(the launcher sets the others); got {o!r}"
            )
    return tuple(options)


def resolve_script(script, cwd=None):
    """The lesson file: as given (relative to `cwd`, else this directory), or in the course root."""
    if not isinstance(script, (str, os.PathLike)) or not str(script):
        raise ValueError(f"script must be a path to a .py file, e.g. 'lessons/01_launch.py'; got {script!r}")
    bases = [cwd] if cwd is not None else []
    path = find_script(script, bases)
    if path is None:
        looked = ", ".join(str(c) for c in script_candidates(script, bases))
        raise FileNotFoundError(f"lesson script {str(script)!r} not found (looked in: {looked})")
    return path


def ranks_problem(n, high=MAX_NPROC):
    """What is wrong with `n` as a number of ranks, from 1 to `high`, or None. The one check of it: launch,
    the terminal runner (-n) and the run panel (which allows fewer) put their own name in front."""
    return _int_problem(n, 1, high, "each rank is a whole Python process with torch loaded")


def timeout_problem(seconds):
    """What is wrong with `seconds` as a run's timeout, or None (launch and the terminal runner's --timeout)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_TIMEOUT:
        return f"must be a number of seconds in (0, {MAX_TIMEOUT:g}]; got {seconds!r}"
    return None


def _int_problem(value, low, high, why):
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an int from {low} to {high}; got {value!r} ({type(value).__name__})"
    if not low <= value <= high:
        return f"must be from {low} to {high} ({why}); got {value}"
    return None


def _refuse(name, problem):
    if problem:
        raise ValueError(f"{name} {problem}")


def _check_int(name, value, low, high, why):
    _refuse(name, _int_problem(value, low, high, why))


def _check_args(args):
    if args is None:
        return []
    if isinstance(args, (str, bytes)):
        raise ValueError(f"args must be a list of strings, e.g. ['--steps', '3']; got the single string {args!r}")
    if not isinstance(args, (list, tuple)):
        raise ValueError(f"args must be a list of strings, e.g. ['--steps', '3']; got {type(args).__name__}")
    out = []
    for a in args:
        if isinstance(a, bool) or not isinstance(a, (str, int, float, os.PathLike)):
            raise ValueError(f"each arg must be a string (or a number or path); got {a!r} in {args!r}")
        out.append(os.fspath(a) if isinstance(a, os.PathLike) else str(a))
    return out


def _check_env(env):
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise ValueError(f"env must be a dict of str to str; got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ValueError(f"env keys must be variable names like 'MY_FLAG'; got {k!r}")
        if not isinstance(v, str):
            raise ValueError(f"env[{k!r}] must be a str (environment values are text); got {v!r}")
        if k in RESERVED_ENV or k.startswith(PREFIX):
            raise ValueError(
                f"env[{k!r}] is set by torchrun or lessonlib for each rank and cannot be "
                f"overridden; reserved: {', '.join(RESERVED_ENV)} and {PREFIX}*"
            )
    return dict(env)


def check_backend(backend, ranks_per_node):
    """Refuse a backend that is unknown or cannot run here, with the reason (no torch import for gloo)."""
    if backend is None:
        return
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None (pick automatically); got {backend!r}")
    if backend == "nccl":
        if not nvidia_devices():
            raise ValueError(
                "backend 'nccl' needs NVIDIA GPUs and this machine has none "
                "(no /dev/nvidia* device); use 'gloo' or backend=None, which picks gloo on CPU"
            )
        import torch

        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False here; use 'gloo'")
        if torch.cuda.device_count() < ranks_per_node:
            raise ValueError(
                f"backend 'nccl' needs one GPU per rank: {ranks_per_node} ranks per node but "
                f"{torch.cuda.device_count()} GPU(s); lower nproc or use 'gloo'"
            )
