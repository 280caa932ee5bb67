"""Run a lesson under torchrun in a subprocess and keep each rank's output apart (chapter 1).

    run = lessonlib.launch("lessons/01_launch.py", nproc=2, args=["--steps", "3"], timeout=60)
    run.raise_for_status()
    run.ranks[1].stdout

What it guarantees, and how:

- Input is checked before anything starts; a mistake is a ValueError or FileNotFoundError that says
  what was wrong and what is allowed (lessonlib.launcher.request). So is the machine: a TMPDIR that is
  missing, or a temporary folder that cannot be written or is nearly full, is an EnvironmentFault in
  one line (lessonlib.launcher.faults).
- torchrun is `python -m torch.distributed.run` with this interpreter, in its own session, with the
  rendezvous on 127.0.0.1 and port 0 (the kernel picks a free one), so launches never collide. It
  starts through `lessonlib.launcher._agent_main`, which only adds that if this process dies, the agent
  ends the run itself: every process of it killed, the run folder removed. `start_agent` starts it
  (lessonlib.launcher.agents): a fresh process, or the same agent forked from a server that has
  imported torch once (the fast path).
- Every rank starts in `lessonlib.launcher._rank_main`, which sends its stdout and stderr to files of its own
  in the run folder (lessonlib.launcher.runfolder): nothing goes through a pipe, so nothing can deadlock
  however much a rank prints, and torchrun's own banner and warnings stay apart from the ranks'.
- Every process of the run carries the run's id as its mark (lessonlib.processes.marks). On timeout or
  interrupt the ranks still running print their Python stacks (SIGUSR1, faulthandler), then every
  process carrying the mark is killed (lessonlib.launcher.watch); torchrun puts workers in sessions of
  their own, so killing torchrun's session alone would not be enough. The same scan runs after every
  launch, so no process of a run outlives it, whatever the outcome.
- What the ranks recorded, and what the launcher saw, become a RunResult (lessonlib.launcher.result),
  shown as it goes by a view (lessonlib.view.live). What the launcher saw includes the machine: the
  lowest free space on the run folder's disk and the OOM kills counted, from which a failed run's
  `fault` is named (lessonlib.launcher.faults).
- A SIGTERM to the launching process, while a launch runs in its main thread, ends the run as an
  interrupt does before the process ends (lessonlib.processes.bounded.sigterm_cleans_up): every process
  killed, the run folder removed. A launcher killed together with its agents (SIGKILL to them all)
  leaves its run folder; its name carries the launcher's pid and start time, and the next launch
  removes it (lessonlib.processes.owners).
- While the book build executes a chapter, each launch adds a line to the build's record of what ran
  (lessonlib.book.launchrecord); anywhere else nothing is written.
"""

import codecs
import contextlib
import os
import shutil
import sys
import time

import psutil

from ..book import launchrecord
from ..machine import loopback_interface
from ..paths import ROOT
from ..processes import owners
from ..processes.bounded import Terminated, sigterm_cleans_up
from ..processes.marks import add_mark, kill_all, new_mark
from . import runfolder
from .agents import READ_AFTER_IMPORT, start_agent
from .faults import EnvironmentWatch, make_run_folder, temporary_folder
from .ports import reserve_port
from .request import check_launch
from .result import Ending, read_result
from .watch import RankWatch, dump_stacks_then_kill, run_processes

SHOW = ("auto", "html", "text", "none")


def launch(
    script,
    nproc=2,
    args=None,
    timeout=120,
    env=None,
    *,
    nnodes=1,
    backend=None,
    launcher="torchrun",
    rendezvous="c10d",
    show="auto",
    cwd=None,
    stop=None,
    max_restarts=0,
    hosts=None,
    torchrun_args=None,
):
    """Run `script` under torchrun with `nproc` ranks per node and return a RunResult.

    nnodes > 1 starts that many torchrun agents on this machine that meet through a rendezvous on
    127.0.0.1 (`rendezvous` 'c10d', the default, or 'static'), as separate machines would.
    `backend` forces the process-group backend that `lessonlib.setup()` picks (default: gloo on CPU,
    nccl with enough GPUs). `launcher='torch.distributed.launch'` uses the deprecated launcher.
    `show`: 'auto' (live HTML in a notebook, prefixed text in a terminal), 'html', 'text' or 'none'
    (or a view object, as the run panel passes: see lessonlib.view.live.NullView).
    `stop`: a threading.Event; setting it (from another thread: the run panel's Stop button) ends the
    run as an interrupt does, every process killed, and the result has `interrupted` set.
    `max_restarts`: torchrun's --max-restarts (chapter 12): after a rank fails, every rank is stopped
    and started again, at most this many times. Each rank's output files then hold every attempt, one
    after the other, and its status is the last attempt's.
    `hosts`: a lessonlib.Hosts (or a list of its hosts), chapter 16: one torchrun agent on each host, in its
    network namespace, with the c10d rendezvous on the first host's address, as on separate machines.
    `torchrun_args`: more torchrun options, e.g. ['--rdzv-conf=read_timeout=5'] (see request.TORCHRUN_OPTIONS).
    On this machine's own network (no `hosts`), the ranks' gloo listens on the loopback interface only
    (GLOO_SOCKET_IFNAME, and NCCL_SOCKET_IFNAME), unless this process's environment or `env` sets it.
    Does not raise when the lesson fails: call `.raise_for_status()` for that.
    """
    # Check everything before starting anything.
    spec = check_launch(
        script,
        nproc,
        args,
        timeout,
        env,
        nnodes=nnodes,
        backend=backend,
        launcher=launcher,
        rendezvous=rendezvous,
        cwd=cwd,
        max_restarts=max_restarts,
        hosts=hosts,
        torchrun_args=torchrun_args,
    )
    if show is True or show is None:
        show = "auto"
    elif show is False:
        show = "none"
    if isinstance(show, str) and show not in SHOW or not isinstance(show, str) and not hasattr(show, "finish"):
        raise ValueError(f"show must be one of {', '.join(SHOW)} (or True/False); got {show!r}")
    if stop is not None and not callable(getattr(stop, "is_set", None)):
        raise ValueError(f"stop must be a threading.Event (or None); got {stop!r}")

    from ..view.live import make_view

    # The machine, checked before anything shows or starts: the run folder made, or an EnvironmentFault. First
    # what launchers that died together with their agents left.
    owners.sweep(temporary_folder(), runfolder.FOLDER_PREFIX)
    run_id = new_mark()  # the run's id is its mark: every process of it carries it
    run_dir = make_run_folder(f"{owners.owned_prefix(runfolder.FOLDER_PREFIX)}{run_id[:8]}-")
    try:
        view = make_view(show, spec.shown, list(spec.args), spec.nproc, spec.nnodes) if isinstance(show, str) else show
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    # Several agents must be told one rendezvous port in advance; a single --standalone agent picks its own.
    with (
        sigterm_cleans_up(),  # in the main thread: a SIGTERM ends the run (finally, below) before the process
        reserve_port() if spec.nnodes > 1 and not spec.hosts else contextlib.nullcontext() as port,
    ):
        run = _Run(spec, view, run_id, run_dir)
        try:
            run.start(port)
            run.wait(stop)
        except KeyboardInterrupt:
            run.stop(interrupted=True)
            raise
        except Terminated:
            run.interrupted = True  # no stacks asked for: whoever sent SIGTERM wants this process gone soon
            raise
        finally:
            result = _despite_interrupts(run.finish)
    # While the book build executes a chapter, it records what ran (lessonlib.book.launchrecord).
    launchrecord.record_launch(spec, result)
    return result


class _Run:
    """One launch while it runs: its torchrun agents, its run folder, and how it is going."""

    def __init__(self, spec, view, run_id, run_dir):
        self.spec, self.view = spec, view
        self.id, self.dir = run_id, run_dir
        self.machine = EnvironmentWatch(self.dir)
        self.agents, self.agent_logs = [], []
        self.tails = {
            (rank, stream): _Tail(runfolder.output_file(self.dir, rank, stream))
            for rank in range(spec.world_size)
            for stream in runfolder.STREAMS
        }
        self.watch = RankWatch(self.dir, spec.world_size)
        self.timed_out = self.interrupted = False
        self.t0 = time.monotonic()

    def start(self, port):
        env = _environment(self.spec, self.id, self.dir)
        for node in range(self.spec.nnodes):
            log = open(runfolder.agent_log(self.dir, node), "wb")
            self.agent_logs.append(log)
            cmd = _agent_command(self.spec, node, self.id, self.dir, port)
            # On a lessonlib.Hosts host, in that host's namespaces (the command's prefix).
            prefix = self.spec.hosts[node].prefix() if self.spec.hosts else ()
            own_env = bool(set(self.spec.env) - set(READ_AFTER_IMPORT))
            self.agents.append(start_agent(cmd, env, self.spec.cwd, log, own_env=own_env, prefix=prefix))

    def wait(self, stop):
        """Until every agent has exited, the time is up, or `stop` is set; show the ranks' lines meanwhile."""
        deadline = self.t0 + self.spec.timeout
        while True:
            if self.view.live:  # with nothing to show live, the files are read once at the end
                self._show_new_lines()
            self.view.tick(time.monotonic() - self.t0)
            self.watch.poll()
            self.machine.sample()
            if all(a.poll() is not None for a in self.agents):
                return
            if time.monotonic() > deadline:
                self.stop(timed_out=True)
                return
            if stop is not None and stop.is_set():
                self.stop(interrupted=True)
                return
            # Returns as soon as the (first still running) agent exits, so the end is seen at once
            # whatever the interval; a slow interval leaves the cores to the ranks.
            try:
                next(a for a in self.agents if a.poll() is None).wait(timeout=self.view.interval)
            except (psutil.TimeoutExpired, StopIteration):
                pass

    def stop(self, *, timed_out=False, interrupted=False):
        """End the run early: every rank still running prints its stack, then every process is killed."""
        self.timed_out |= timed_out  # a Ctrl-C while a timed-out run is being stopped leaves both set
        self.interrupted |= interrupted
        dump_stacks_then_kill(self.id, self.watch)

    def finish(self):
        """Kill whatever is left, read the run folder into a RunResult and remove it. Safe to run again."""
        kill_all(run_processes(self.id) + [a for a in self.agents if a.poll() is None])
        for a in self.agents:
            a.wait()
        for log in self.agent_logs:
            log.close()
        wall = time.monotonic() - self.t0
        self.watch.poll()
        self._show_new_lines(final=True)
        leftovers = run_processes(self.id)  # must be empty; a process here is a launcher bug
        kill_all(leftovers)
        ending = Ending(
            returncodes=[a.returncode for a in self.agents],
            agent_pids=[a.pid for a in self.agents],
            wall_time=wall,
            timed_out=self.timed_out,
            interrupted=self.interrupted,
            gone_at=self.watch.ended,
            leftovers=leftovers,
            seen=self.machine.seen(),
        )
        result = read_result(self.spec, self.dir, ending)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.view.finish(result)
        return result

    def _show_new_lines(self, final=False):
        for (rank, stream), tail in self.tails.items():
            lines = tail.new_lines(final)
            if lines:
                self.view.lines(rank, stream, lines)


def _environment(spec, run_id, run_dir):
    """Every process of the run: this process's environment, the caller's `env`, the run's mark (last of
    its marks) and the run folder's variables."""
    env = {
        **add_mark({**os.environ, **spec.env}, run_id),
        runfolder.RUN_DIR_VAR: run_dir,
        runfolder.LAUNCHER_PID_VAR: str(os.getpid()),
        "PYTHONUNBUFFERED": "1",  # ranks write to files: flush each line for the live view
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), spec.env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))])
        ),
    }
    if spec.backend:
        env[runfolder.BACKEND_VAR] = spec.backend
    loopback = None if spec.hosts else loopback_interface()
    if loopback:
        # The rendezvous is on 127.0.0.1, but gloo and NCCL pick their own interface, from what this machine's
        # hostname resolves to: on a laptop, its address on the LAN, where every rank would listen while the
        # lesson runs. A one-machine run needs loopback alone (chapter 16).
        # torch's stores listen on every address unless told a socket: lessonlib.launcher.torchpatches.
        if not any(var in spec.env or var in os.environ for var in runfolder.INTERFACE_VARS):
            env.update(dict.fromkeys(runfolder.INTERFACE_VARS, loopback), **{runfolder.STORES_ON_VAR: "127.0.0.1"})
    if spec.max_restarts and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in spec.env:
        # torch 2.14.1, --standalone: ranks started again sometimes read the previous attempt's gloo
        # addresses from the rendezvous store they share with the agent, and fail to connect ("Connection
        # refused"; pytorch/pytorch#135712). A store of their own for each attempt avoids it (chapter 12).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _agent_command(spec, node, run_id, run_dir, port):
    """The command line of torchrun agent `node`: lessonlib.launcher._agent_main, which is torch.distributed.run
    (or .launch) that dies with this process, starting lessonlib.launcher._rank_main on the script."""
    legacy = spec.launcher != "torchrun"
    host = spec.hosts[node] if spec.hosts else None
    cmd = [
        *(host.prefix() if host else []),
        sys.executable,
        "-m",
        "lessonlib.launcher._agent_main",
        *(["--legacy"] if legacy else []),
        f"--nproc-per-node={spec.nproc}",
        f"--local-addr={host.address if host else '127.0.0.1'}",
    ]
    # On hosts (chapter 16), the rendezvous is on the first host's address, at a port no other run can
    # hold (each Hosts is a network of its own); on this machine, 127.0.0.1 and the port the launch reserved.
    address, port = (spec.hosts[0].address, spec.hosts[0].port) if host else ("127.0.0.1", port)
    # Its log folder in the run folder: otherwise each run leaves a torchelastic_* folder in /tmp for good
    # (the deprecated launcher too: it takes the same option).
    cmd += [f"--log-dir={runfolder.torchrun_log_dir(run_dir, node)}"]
    if spec.max_restarts:
        cmd += [f"--max-restarts={spec.max_restarts}"]
    if spec.nnodes == 1 and not host:
        cmd += ["--standalone"]
    elif spec.rendezvous == "c10d":
        cmd += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={address}:{port}",
            f"--rdzv-id={run_id}",
        ]
    else:
        cmd += [f"--nnodes={spec.nnodes}", f"--node-rank={node}", f"--master-addr={address}", f"--master-port={port}"]
    return cmd + [*spec.torchrun_args, "-m", "lessonlib.launcher._rank_main", spec.shown, *spec.args]


def _despite_interrupts(step, tries=10):
    """Run an idempotent cleanup `step` to the end even if Ctrl-C (or SIGTERM) arrives again meanwhile."""
    for _ in range(tries - 1):
        try:
            return step()
        except (KeyboardInterrupt, Terminated):
            continue
    return step()


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
