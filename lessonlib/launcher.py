"""Run a lesson under torchrun in a subprocess and keep each rank's output apart (chapter 1).

    run = lessonlib.launch("lessons/01_launch.py", nproc=2, args=["--steps", "3"], timeout=60)
    run.raise_for_status()
    run.ranks[1].stdout

What it guarantees, and how:

- Input is checked before anything starts; a mistake is a ValueError or FileNotFoundError that says
  what was wrong and what is allowed.
- torchrun is `python -m torch.distributed.run` with this interpreter, in its own session, with the
  rendezvous on 127.0.0.1 and port 0 (the kernel picks a free one), so launches never collide. It
  starts through `lessonlib._agent_main`, which only adds that it dies if this process dies.
- Every rank starts in `lessonlib._rank_main`, which sends its stdout and stderr to files of its own:
  nothing goes through a pipe, so nothing can deadlock however much a rank prints, and torchrun's own
  banner and warnings stay apart from what the ranks printed.
- Every process of the run carries a marker in its environment (LESSONLIB_RUN_ID). On timeout or
  interrupt the ranks still running print their Python stacks (SIGUSR1, faulthandler), then every
  process carrying the marker is killed; torchrun puts workers in sessions of their own, so killing
  torchrun's session alone would not be enough. The same scan runs after every launch, so no process
  of a run outlives it, whatever the outcome.
"""

import codecs
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .ports import reserve_port

ROOT = Path(__file__).resolve().parent.parent  # the course checkout: lessons/ and book/ live here
MAX_NPROC = 16  # ranks per node; each is a whole Python process with torch loaded (~0.3 GB each)
MAX_NNODES = 4  # simulated nodes on this one machine
MAX_TIMEOUT = 3600.0
BACKENDS = ("gloo", "nccl", "mpi")
LAUNCHERS = ("torchrun", "torch.distributed.launch")
RENDEZVOUS = ("c10d", "static")
SHOW = ("auto", "html", "text", "none")
RUN_ID_VAR = "LESSONLIB_RUN_ID"
# torchrun sets these for each rank; a value passed in `env` would be silently overwritten.
# PYTHONUNBUFFERED is lessonlib's: the live view needs every line flushed. (PYTHONPATH in `env` is kept,
# after the course root.)
RESERVED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED")
STACK_DUMP_GRACE = 2.0  # seconds a hung rank gets to print its stack before it is killed


class LaunchError(RuntimeError):
    """A launched lesson failed, hung or was interrupted; the message names the rank(s) and root cause."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


@dataclass
class RankOutput:
    """What one rank printed and how it ended."""

    rank: int
    stdout: str = ""
    stderr: str = ""
    exitcode: int | None = None  # None: the rank left no exit record (killed by a signal)
    status: str = "not started"  # ok | failed | hung | interrupted | terminated | not started
    pid: int | None = None
    start: float | None = None
    end: float | None = None
    error: str = ""  # "ValueError: ..." for an uncaught exception
    traceback: str = ""
    reports: list = field(default_factory=list)  # [(tag, value)] from lessonlib.report

    @property
    def ok(self):
        return self.exitcode == 0


@dataclass
class RunResult:
    """The outcome of `launch`: per-rank output, exit codes, wall time, and what went wrong."""

    script: str
    args: list
    nproc: int
    nnodes: int
    ranks: list
    launcher_output: str  # torchrun's own stdout and stderr, one block per node agent
    returncodes: list  # one per torchrun agent
    wall_time: float
    timeout: float
    timed_out: bool = False
    interrupted: bool = False
    leftovers: list = field(default_factory=list)  # processes that outlived the run and were killed
    agent_pids: list = field(default_factory=list)  # torchrun agent pid per node, in --node-rank order

    @property
    def world_size(self):
        return self.nproc * self.nnodes

    @property
    def ok(self):
        return (not self.timed_out and not self.interrupted
                and all(rc == 0 for rc in self.returncodes) and all(r.ok for r in self.ranks))

    @property
    def failed_ranks(self):
        return [r.rank for r in self.ranks if not r.ok]

    @property
    def root_cause(self):
        """The rank whose failure came first.

        A rank that failed only because a peer vanished ("Connection closed by peer") is a victim, so
        ranks that failed on their own come first; among those, the earliest to end. End times come
        from each rank's exit record or, for a rank that died without one (os._exit, a signal), from
        when the launcher saw its process disappear.
        """
        failed = [r for r in self.ranks if r.status == "failed"]
        if not failed:
            return None
        return min(failed, key=lambda r: (_is_collateral(r), r.end if r.end is not None else float("inf")))

    def reports(self, tag):
        """Values that ranks published with `lessonlib.report(tag, value)`, as [(rank, value), ...]."""
        return [(r.rank, value) for r in self.ranks for t, value in r.reports if t == tag]

    def reports_by_rank(self, tag):
        """The same values grouped by rank: {rank: [value, ...] in the order reported}, every rank a key."""
        grouped = {r.rank: [] for r in self.ranks}
        for rank, value in self.reports(tag):
            grouped[rank].append(value)
        return grouped

    def raise_for_status(self):
        """Raise LaunchError if the run did not succeed on every rank; return self otherwise."""
        if not self.ok:
            raise LaunchError(self.describe_failure(), self)
        return self

    def describe_failure(self):
        if self.ok:
            return f"{self.script}: all {self.world_size} ranks exited 0"
        if self.timed_out or self.interrupted:
            what = f"timed out after {self.timeout:g} s" if self.timed_out else "was interrupted"
            stuck = [r for r in self.ranks if r.status in ("hung", "interrupted")]
            if not stuck:
                return (f"{self.script} {what} before any rank had started its script (torchrun was "
                        f"still starting; everything was killed). torchrun said:\n{_tail(self.launcher_output, 30)}")
            lines = [f"{self.script} {what}; rank(s) {_list(r.rank for r in stuck)} were still "
                     "running and were killed. Their Python stacks at that moment:"]
            for r in stuck:
                lines += [f"--- rank {r.rank} stack ---",
                          _stack_dump(r.stderr) or _tail(r.stderr, 30) or "(no stack printed)"]
            cause = self.root_cause
            if cause is not None:
                lines += [f"Before that, rank {cause.rank} failed:", cause.traceback or cause.error]
            return "\n".join(lines)
        cause = self.root_cause
        lines = [f"{self.script} failed on rank(s) {_list(self.failed_ranks)} of {self.world_size}."]
        if cause is not None:
            when = f" at +{cause.end - self.ranks_start:.2f} s" if cause.end and self.ranks_start else ""
            lines.append(f"First failure (root cause): rank {cause.rank} exited {cause.exitcode}{when}"
                         + (f" with {cause.error}" if cause.error else ""))
            others = [r for r in self.ranks if not r.ok and r is not cause]
            for r in others:
                lines.append(f"Then rank {r.rank}: {r.status}"
                             + (f", exit code {r.exitcode}" if r.exitcode is not None else "")
                             + (f" ({r.error})" if r.error else ""))
                stack = _stack_dump(r.stderr) if r.status == "terminated" else ""
                if stack:
                    lines += [f"    where rank {r.rank} was when it was stopped:",
                              "    " + stack.replace("\n", "\n    ")]
            lines += [f"--- rank {cause.rank} traceback ---",
                      cause.traceback or _tail(cause.stderr, 30) or "(no traceback: see its stderr)"]
        else:
            lines.append("No rank recorded an error; torchrun said:")
            lines.append(_tail(self.launcher_output, 30))
        return "\n".join(lines)

    @property
    def ranks_start(self):
        starts = [r.start for r in self.ranks if r.start is not None]
        return min(starts) if starts else None

    def _repr_html_(self):
        from .display import render_html
        return render_html(self)

    def __str__(self):
        from .display import render_text
        return render_text(self)


COLLATERAL = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Socket closed|recvValue failed", re.I)


def _is_collateral(rank):
    """True when a rank's error only says that another rank went away."""
    return bool(COLLATERAL.search(rank.error or ""))


def _list(items):
    return ", ".join(str(i) for i in items)


def _tail(text, n):
    return "\n".join(text.rstrip("\n").splitlines()[-n:])


def _stack_dump(stderr):
    """The faulthandler dump in a rank's stderr (from its first 'Thread 0x' line), or '' if none."""
    hits = [i for i in (stderr.find("Thread 0x"), stderr.find("Current thread 0x")) if i >= 0]
    if not hits:
        return ""
    # The frames below the lesson (runpy, lessonlib._rank_main) are the launcher's, not the lesson's.
    lines = [ln for ln in stderr[min(hits):].splitlines()
             if "<frozen runpy>" not in ln and "lessonlib/_rank_main.py" not in ln]
    return "\n".join(lines).rstrip()


# --------------------------------------------------------------------------- input checks

def resolve_script(script, cwd=None):
    """The lesson file: as given (relative to `cwd`, else this directory), or in the course root
    (notebooks run in book/, lessons live in lessons/)."""
    if not isinstance(script, (str, os.PathLike)) or not str(script):
        raise ValueError(f"script must be a path to a .py file, e.g. 'lessons/01_launch.py'; got {script!r}")
    path = Path(script)
    bases = [Path(cwd)] if cwd is not None else []
    candidates = [path] if path.is_absolute() else [b / path for b in [*bases, Path.cwd(), ROOT]]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"lesson script {str(script)!r} not found (looked in: {looked})")


def _check_int(name, value, low, high, why):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int from {low} to {high}; got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise ValueError(f"{name} must be from {low} to {high} ({why}); got {value}")


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
        if k in RESERVED_ENV or k.startswith("LESSONLIB_"):
            raise ValueError(f"env[{k!r}] is set by torchrun or lessonlib for each rank and cannot be "
                             f"overridden; reserved: {', '.join(RESERVED_ENV)} and LESSONLIB_*")
    return dict(env)


def check_backend(backend, ranks_per_node):
    """Refuse a backend that is unknown or cannot run here, with the reason (no torch import for gloo)."""
    if backend is None:
        return
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None (pick automatically); got {backend!r}")
    if backend == "nccl":
        if not sys.platform.startswith("linux") or not list(Path("/dev").glob("nvidia[0-9]*")):
            raise ValueError("backend 'nccl' needs NVIDIA GPUs and this machine has none "
                             "(no /dev/nvidia* device); use 'gloo' or backend=None, which picks gloo on CPU")
        import torch
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False here; use 'gloo'")
        if torch.cuda.device_count() < ranks_per_node:
            raise ValueError(f"backend 'nccl' needs one GPU per rank: {ranks_per_node} ranks per node but "
                             f"{torch.cuda.device_count()} GPU(s); lower nproc or use 'gloo'")
    if backend == "mpi":
        import torch.distributed as dist
        if not dist.is_mpi_available():
            raise ValueError("backend 'mpi' is not built into this torch; use 'gloo'")


# --------------------------------------------------------------------------- processes

def run_processes(run_id):
    """Every live process whose environment carries this run's marker (children of children too)."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(RUN_ID_VAR) == run_id:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return found


def _kill_all(procs):
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


class _Tail:
    """Reads the lines a rank has appended to a file since the last call (a partial line waits)."""

    def __init__(self, path):
        self.path, self.offset, self.partial = path, 0, ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def new_lines(self, final=False):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        text = self.partial + self.decoder.decode(data, final=final)
        lines = text.split("\n")
        self.partial = "" if final else lines.pop()
        if final and lines and lines[-1] == "":
            lines.pop()
        return lines


def _read(path):
    try:
        return Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def _read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _torchrun_failures(text):
    """{rank: exitcode} from torchrun's failure summary, for ranks that left no exit record."""
    found = {}
    for m in re.finditer(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", text):
        found.setdefault(int(m.group(1)), int(m.group(2)))
    return found


# --------------------------------------------------------------------------- launch

def launch(script, nproc=2, args=None, timeout=120, env=None, *, nnodes=1, backend=None,
           launcher="torchrun", rendezvous="c10d", show="auto", cwd=None, stop=None):
    """Run `script` under torchrun with `nproc` ranks per node and return a RunResult.

    nnodes > 1 starts that many torchrun agents on this machine that meet through a rendezvous on
    127.0.0.1 (`rendezvous` 'c10d', the default, or 'static'), as separate machines would.
    `backend` forces the process-group backend that `lessonlib.setup()` picks (default: gloo on CPU,
    nccl with enough GPUs). `launcher='torch.distributed.launch'` uses the deprecated launcher.
    `show`: 'auto' (live HTML in a notebook, prefixed text in a terminal), 'html', 'text' or 'none'
    (or a view object, as the run panel passes: see lessonlib.display.NullView).
    `stop`: a threading.Event; setting it (from another thread: the run panel's Stop button) ends the
    run as an interrupt does, every process killed, and the result has `interrupted` set.
    Does not raise when the lesson fails: call `.raise_for_status()` for that.
    """
    # Check everything before starting anything.
    path = resolve_script(script, cwd)
    _check_int("nproc", nproc, 1, MAX_NPROC, "each rank is a full Python process with torch loaded")
    _check_int("nnodes", nnodes, 1, MAX_NNODES, "simulated nodes share this one machine")
    args = _check_args(args)
    env = _check_env(env)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}]; got {timeout!r}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    if rendezvous not in RENDEZVOUS:
        raise ValueError(f"rendezvous must be one of {', '.join(RENDEZVOUS)}; got {rendezvous!r}")
    if show is True or show is None:
        show = "auto"
    elif show is False:
        show = "none"
    if isinstance(show, str) and show not in SHOW or not isinstance(show, str) and not hasattr(show, "finish"):
        raise ValueError(f"show must be one of {', '.join(SHOW)} (or True/False); got {show!r}")
    if stop is not None and not callable(getattr(stop, "is_set", None)):
        raise ValueError(f"stop must be a threading.Event (or None); got {stop!r}")
    check_backend(backend, nproc)
    cwd = Path(cwd).resolve() if cwd is not None else ROOT
    if not cwd.is_dir():
        raise FileNotFoundError(f"cwd {str(cwd)!r} is not a directory")

    from .display import make_view
    shown = os.path.relpath(path, cwd) if path.is_relative_to(cwd) else str(path)
    run_id = uuid.uuid4().hex
    run_dir = Path(tempfile.mkdtemp(prefix=f"lessonlib-{run_id[:8]}-"))
    world = nproc * nnodes
    child_env = {**os.environ, **env, RUN_ID_VAR: run_id, "LESSONLIB_RUN_DIR": str(run_dir),
                 "LESSONLIB_LAUNCHER_PID": str(os.getpid()),
                 "PYTHONUNBUFFERED": "1",  # ranks write to files: flush each line for the live view
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))]))}
    if backend:
        child_env["LESSONLIB_BACKEND"] = backend
    view = make_view(show, shown, args, nproc, nnodes) if isinstance(show, str) else show

    # Several agents must be told one rendezvous port in advance; a single --standalone agent picks its own.
    with reserve_port() if nnodes > 1 else contextlib.nullcontext() as port:
        agents, agent_files = [], []
        tails = {(r, s): _Tail(run_dir / f"rank{r}.{s}") for r in range(world) for s in ("stdout", "stderr")}
        watch = _RankWatch(run_dir, world)
        timed_out = interrupted = False
        t0 = time.monotonic()
        try:
            for node in range(nnodes):
                # lessonlib._agent_main is torch.distributed.run (or .launch) that dies with this process.
                cmd = [sys.executable, "-m", "lessonlib._agent_main", *(["--legacy"] if launcher != "torchrun" else []),
                       f"--nproc-per-node={nproc}", "--local-addr=127.0.0.1"]
                if launcher == "torchrun":  # its log folder, else a torchelastic_* folder in /tmp per run, never removed
                    cmd += [f"--log-dir={run_dir / f'torchrun{node}'}"]
                if nnodes == 1:
                    cmd += ["--standalone"]
                elif rendezvous == "c10d":
                    cmd += [f"--nnodes={nnodes}", f"--node-rank={node}", "--rdzv-backend=c10d",
                            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}"]
                else:
                    cmd += [f"--nnodes={nnodes}", f"--node-rank={node}", "--master-addr=127.0.0.1",
                            f"--master-port={port}"]
                cmd += ["-m", "lessonlib._rank_main", shown, *args]
                out = open(run_dir / f"agent{node}.log", "wb")
                agent_files.append(out)
                agents.append(psutil.Popen(cmd, cwd=cwd, env=child_env, stdin=subprocess.DEVNULL,
                                           stdout=out, stderr=out, start_new_session=True))
            deadline = t0 + timeout
            while True:
                if view.live:  # with nothing to show live, the files are read once at the end
                    for (rank, stream), tail in tails.items():
                        lines = tail.new_lines()
                        if lines:
                            view.lines(rank, stream, lines)
                view.tick(time.monotonic() - t0)
                watch.poll()
                if all(a.poll() is not None for a in agents):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    _dump_stacks_then_kill(run_id, watch)
                    break
                if stop is not None and stop.is_set():
                    interrupted = True
                    _dump_stacks_then_kill(run_id, watch)
                    break
                # Returns as soon as the (first still running) agent exits, so the end is seen at once
                # whatever the interval; a slow interval leaves the cores to the ranks.
                try:
                    next(a for a in agents if a.poll() is None).wait(timeout=view.interval)
                except (psutil.TimeoutExpired, StopIteration):
                    pass
        except KeyboardInterrupt:
            interrupted = True
            _dump_stacks_then_kill(run_id, watch)
            raise
        finally:
            def cleanup():
                _kill_all(run_processes(run_id) + [a for a in agents if a.poll() is None])
                for a in agents:
                    a.wait()
                for f in agent_files:
                    f.close()
                wall = time.monotonic() - t0
                watch.poll()
                for (rank, stream), tail in tails.items():
                    lines = tail.new_lines(final=True)
                    if lines:
                        view.lines(rank, stream, lines)
                leftovers = run_processes(run_id)  # must be empty; a process here is a launcher bug
                _kill_all(leftovers)
                result = _collect(shown, args, nproc, nnodes, run_dir, agents, wall, timeout,
                                  timed_out, interrupted, leftovers, watch.ended)
                shutil.rmtree(run_dir, ignore_errors=True)
                view.finish(result)
                return result

            result = _despite_interrupts(cleanup)
    return result


def _despite_interrupts(step, tries=10):
    """Run an idempotent cleanup `step` to the end even if Ctrl-C arrives again meanwhile."""
    for _ in range(tries - 1):
        try:
            return step()
        except KeyboardInterrupt:
            continue
    return step()


class _RankWatch:
    """Notes when each rank's process disappears: the end time of a rank that left no exit record."""

    def __init__(self, run_dir, world):
        self.run_dir, self.world = run_dir, world
        self.procs, self.ended = {}, {}

    def poll(self):
        now = time.time()
        for rank in range(self.world):
            if rank in self.ended:
                continue
            if rank not in self.procs:
                start = _read_json(self.run_dir / f"rank{rank}.start.json")
                if start is None:
                    continue
                try:
                    self.procs[rank] = psutil.Process(start["pid"])
                except psutil.NoSuchProcess:
                    self.ended[rank] = now
                    continue
            p = self.procs[rank]
            try:
                gone = p.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                self.ended[rank] = now

    def running(self):
        """Ranks whose process has started and not yet ended."""
        self.poll()
        return [rank for rank in self.procs if rank not in self.ended]


def _dump_stacks_then_kill(run_id, watch):
    """Ask every rank still running for its Python stack, give it a moment to print, then kill all."""
    signalled = []
    for rank in watch.running():
        try:
            watch.procs[rank].send_signal(signal.SIGUSR1)  # psutil refuses if the pid was reused
            signalled.append(watch.run_dir / f"rank{rank}.stderr")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    # faulthandler writes from its signal handler at once; wait until the stderr files stop growing.
    end = time.monotonic() + STACK_DUMP_GRACE
    sizes = None
    while signalled and time.monotonic() < end:
        time.sleep(0.1)
        now = [p.stat().st_size if p.exists() else 0 for p in signalled]
        if now == sizes:
            break
        sizes = now
    _kill_all(run_processes(run_id))


def _collect(script, args, nproc, nnodes, run_dir, agents, wall, timeout, timed_out, interrupted, leftovers,
             ended):
    launcher_output = "\n".join(
        (f"--- torchrun agent for node {i} ---\n" if nnodes > 1 else "") + _read(run_dir / f"agent{i}.log")
        for i in range(nnodes))
    returncodes = [a.returncode for a in agents]
    from_torchrun = _torchrun_failures(launcher_output)
    ranks = []
    for rank in range(nproc * nnodes):
        r = RankOutput(rank, _read(run_dir / f"rank{rank}.stdout"), _read(run_dir / f"rank{rank}.stderr"))
        start = _read_json(run_dir / f"rank{rank}.start.json")
        done = _read_json(run_dir / f"rank{rank}.exit.json")
        for line in _read(run_dir / f"rank{rank}.reports.jsonl").splitlines():
            item = json.loads(line)
            r.reports.append((item["tag"], item["value"]))
        if start:
            r.pid, r.start, r.status = start["pid"], start["time"], "terminated"
        if done:
            r.exitcode, r.end = done["exitcode"], done["end"]
            r.status = "ok" if r.exitcode == 0 else "failed"
            if done.get("exc_type"):
                r.error = f"{done['exc_type']}: {done.get('message', '')}".rstrip(": ")
                r.traceback = done.get("traceback", "")
        elif start:
            r.end = ended.get(rank)  # when the launcher saw the process go (no record of its own)
            if timed_out or interrupted:
                r.status = "hung" if timed_out else "interrupted"
            elif all(rc == 0 for rc in returncodes):
                r.exitcode, r.status = 0, "ok"  # torchrun saw it exit 0 (e.g. via os._exit)
            else:
                r.exitcode = from_torchrun.get(rank)
                if r.exitcode is not None and r.exitcode > 0:
                    r.status = "failed"  # os._exit(n): no Python-level record, but a real failure
                    r.error = f"exit code {r.exitcode}"
                elif r.exitcode is not None and r.exitcode < 0:
                    sig = -r.exitcode
                    name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
                    r.status, r.error = "failed", f"killed by {name}"
                    if sig == signal.SIGTERM:
                        r.status = "terminated"  # torchrun stopping the group after another failure
        ranks.append(r)
    return RunResult(script, args, nproc, nnodes, ranks, launcher_output, returncodes, wall, timeout,
                     timed_out, interrupted, [f"pid {p.pid}" for p in leftovers], [a.pid for a in agents])

