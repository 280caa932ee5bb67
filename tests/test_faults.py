"""Fault injection for lessonlib.launch: every way a run can break ends within a bound, says what broke,
and leaves nothing behind.

Each case runs with a TMPDIR of its own and ends with `FaultCase.finish()`: no process carrying the
case's tag is alive, its TMPDIR is empty (the run folder and torchrun's logs went with the run), and a
small launch right after it succeeds at once.

Cases tested in tests/test_launcher.py instead, not repeated here:
- a script that never ends, bounded by the launch timeout: the `hung_run` tests
  (test_timeout_is_reported_and_bounded, test_timeout_prints_each_hung_ranks_stack,
  test_timeout_kills_the_whole_tree);
- 100,000 lines per rank on stdout and stderr: test_100k_lines_per_rank_complete_and_ordered;
- Ctrl-C in a terminal (SIGINT to the launching process): test_interrupt_kills_the_run;
- bad launcher input (nproc 0, -1, "abc", 2.5, 10000, an unknown backend, a missing script, and more):
  test_bad_input_is_refused_before_anything_starts, which finds no process spawned and no run folder
  made, in under a second.

Bounds are small but leave room for a 2-core CI machine running three test workers at once: where a
launch's bound must strike it is 20 s (30 s when the ranks import torch first); where a failure must end
the run, the run's own bounds are long (a 120 s pg timeout, a 90 s launch timeout), so that only the
mechanism under test can end it in time. Each assertion says what it measured.
"""

import contextlib
import os
import re
import signal
import socket
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

import lessonlib
from conftest import HELPERS, ended_by, kill_processes, line_of, processes_with_env, still_found
from lessonlib import ROOT, run_bounded
from lessonlib.processes.bounded import poll_until

GONE_GRACE = 3.0  # seconds a process that was just killed gets to finish dying before it counts as left
KILLED_KERNEL_BOUND = 8.0  # seconds for every process of a run to go after its kernel is SIGKILLed
STARTUP = 60.0  # seconds the ranks get to reach the line where a case fails or hangs

# The rank script. Torch is imported only by the modes that need a process group, so the others start
# in a fraction of a second and reach their fault well within the bounds even on a loaded machine.
FAULTS = HELPERS / "faults.py"  # the rank script every case launches
FOLLOWED_UP = ["rank 0 of 2 follows up\n", "rank 1 of 2 follows up\n"]


def describe(proc):
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:160]}"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return f"pid {proc.pid} (gone while being described)"


class FaultCase:
    """One fault case: its tag (every process of its runs carries TEST_TAG=tag), its own TMPDIR, a folder
    where ranks say how far they got, the rank script, and the checks every case ends with."""

    def __init__(self, root):
        self.root = root
        self.tag = uuid.uuid4().hex
        self.tmp, self.ready = root / "tmp", root / "ready"
        self.tmp.mkdir()
        self.ready.mkdir()
        self.script, self.follow_up = FAULTS, HELPERS / "follow_up.py"
        self.returned_after = None

    def env(self, **extra):
        return {"TEST_TAG": self.tag, "TEST_READY_DIR": str(self.ready), **extra}

    def launch(self, *args, nproc=2, timeout=60, env=None):
        t0 = time.monotonic()
        run = lessonlib.launch(
            self.script, nproc=nproc, args=list(args), timeout=timeout, env=self.env(**(env or {})), show="none"
        )
        self.returned_after = time.monotonic() - t0
        return run

    def readied(self):
        return sorted(p.name for p in self.ready.iterdir() if not p.name.endswith(".tmp"))

    def wait_ready(self, names, timeout=STARTUP):
        poll_until(lambda: set(names) <= set(self.readied()), timeout, what=lambda: f"{names} (have {self.readied()})")

    def processes(self):
        return processes_with_env("TEST_TAG", self.tag)

    def left_after(self, seconds):
        """The case's processes still alive `seconds` from now (returns as soon as there are none)."""
        return still_found(self.processes, seconds)

    def tmp_contents(self):
        return sorted(str(p.relative_to(self.tmp)) for p in self.tmp.rglob("*"))

    def check_clean(self, when):
        left = self.left_after(GONE_GRACE)
        if left:
            text = "\n".join(describe(p) for p in left)
            kill_processes(left)
            pytest.fail(f"{when}: {len(left)} process(es) of the run still alive (now killed):\n{text}")
        assert self.tmp_contents() == [], f"{when}: left in the run's TMPDIR"

    def finish(self, follow_up=True):
        """The end of every case: nothing alive, nothing in TMPDIR, and a new launch works at once."""
        self.check_clean("after the case")
        if not follow_up:
            return
        run = lessonlib.launch(self.follow_up, nproc=2, timeout=90, env=self.env(), show="none")
        assert run.ok, f"the launch after the case failed:\n{run.describe_failure()}"
        assert [r.stdout for r in run.ranks] == FOLLOWED_UP, str(run)
        self.check_clean("after the follow-up launch")


@pytest.fixture
def fault_case(tmp_path, monkeypatch):
    """A FaultCase whose launches (and kernels) use TMPDIR=<tmp_path>/tmp. The test calls .finish()."""
    case = FaultCase(tmp_path)
    monkeypatch.setenv("TMPDIR", str(case.tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # Python reads TMPDIR again
    yield case
    kill_processes(case.processes())  # a case that failed half-way leaves nothing to the next test


def stack_lines(run, rank):
    """The line numbers of the faults.py frames in the rank's stack, as describe_failure shows it."""
    text = run.describe_failure()
    part = text.split(f"--- rank {rank} stack ---", 1)
    assert len(part) == 2, f"no stack for rank {rank}:\n{text}"
    block = part[1].split("\n--- ", 1)[0].split("\nBefore that", 1)[0]
    return [int(n) for n in re.findall(r'faults\.py", line (\d+) in', block)]


# --------------------------------------------------------------------------- a rank fails


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_a_failing_peer_is_the_root_cause_within_seconds(fault_case, how):
    """Rank 1 raises, or SIGKILLs itself, while rank 0 waits for it in all_reduce (a 120 s pg timeout):
    rank 1's end ends the run, before the launch's 90 s bound (so before rank 0's pg timeout too), rank 1
    named as the root cause (with the signal). How soon after rank 1 it ends is a speed, not asserted."""
    run = fault_case.launch(how, timeout=90)
    seconds_after_rank1 = time.time() - run.ranks[1].end if run.ranks[1].end else None
    text = run.describe_failure()
    assert "rank0.ready" in fault_case.readied(), f"rank 0 never reached all_reduce:\n{text}"
    assert not run.ok and not run.timed_out, text
    assert run.root_cause is not None and run.root_cause.rank == 1, text
    assert run.ranks[0].status in ("failed", "terminated"), text
    if how == "raise":
        assert run.root_cause.error == "RuntimeError: rank 1 fails on purpose", text
        assert re.search(r"First failure \(root cause\): rank 1 exited 1\b.*rank 1 fails on purpose", text), text
        assert re.search(
            r"^  rank 1 \(root cause\): RuntimeError: rank 1 fails on purpose; at .*faults\.py:\d+ ", text, re.M
        ), text
    else:
        assert run.root_cause.exitcode == -signal.SIGKILL and run.root_cause.error == "killed by SIGKILL", text
        assert re.search(r"First failure \(root cause\): rank 1 was killed by SIGKILL \(exit -9\)", text), text
        assert "\n  rank 1 (root cause): killed by SIGKILL (exit -9)\n" in text, text
    # Rank 0 was waiting for it: its line says where, in the script's own code.
    waited = line_of(FAULTS, "# FAULT-PEER-WAIT")
    assert re.search(rf"^  rank 0: .*; at .*faults\.py:{waited} in peer_fails: dist\.all_reduce\(", text, re.M), text
    assert seconds_after_rank1 is not None, f"rank 1's end was not recorded:\n{text}"
    assert run.leftovers == []
    fault_case.finish()


@pytest.mark.timeout(120)
def test_mismatched_shapes_are_named_under_debug_detail(fault_case):
    """all_reduce of 3 elements on rank 0 and 4 on rank 1, TORCH_DISTRIBUTED_DEBUG=DETAIL: each rank's
    error names both shapes, at once rather than at the 5 s pg timeout."""
    run = fault_case.launch("shapes", timeout=90, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    text = run.describe_failure()
    assert not run.ok and not run.timed_out, text
    for rank, mine, theirs in [(0, 3, 4), (1, 4, 3)]:
        error = run.ranks[rank].error
        assert "Detected mismatch between collectives" in error, f"rank {rank}: {error}"
        assert f"Tensor shapes: {mine}vs {theirs}" in error, f"rank {rank}: {error}"
        assert "Timed out" not in error, f"rank {rank} waited for the pg timeout: {error}"
    assert run.root_cause is not None and "Tensor shapes: " in text, text
    fault_case.finish()


# --------------------------------------------------------------------------- the launch's bound strikes

# Launch timeouts, seconds: the ranks must be up and stuck before they strike, on a loaded 2-core machine
# (at load 10, a torchrun agent alone takes 7 s to start). Ranks that import torch need longer.
BOUND = 30
BOUND_NO_TORCH = 35  # beside the book build, torchrun alone can take over 20 s to start its ranks
FAIL_AFTER = 10  # test_a_rank_that_ignores_sigterm...: rank 0 fails this long after both ranks are up


@pytest.mark.timeout(150)
def test_barrier_only_rank_0_reaches_shows_every_live_ranks_stack(fault_case):
    """`if rank == 0: dist.barrier()` then an all_reduce: rank 0 waits in the barrier, rank 1 in the
    all_reduce, both for ever (pg timeout 600 s). The launch's bound ends it, and the failure shows
    where each live rank was: rank 0 at the barrier line, rank 1 at the all_reduce line."""
    run = fault_case.launch("rank0-barrier", timeout=BOUND)
    text = run.describe_failure()
    assert fault_case.readied() == ["rank0.ready", "rank1.ready"], f"the ranks never got stuck:\n{text}"
    assert run.timed_out and [r.status for r in run.ranks] == ["hung", "hung"], text
    assert ended_by(BOUND, fault_case.returned_after), (
        f"bound {BOUND} s, returned after {fault_case.returned_after:.1f}"
    )
    barrier, collective = line_of(FAULTS, "# FAULT-RANK0-BARRIER"), line_of(FAULTS, "# FAULT-NEXT-COLLECTIVE")
    assert barrier in stack_lines(run, 0) and collective in stack_lines(run, 1), text
    # The failure leads with where each rank waited: two different collectives, the bug in one glance.
    lines = text.splitlines()[1:3]
    assert re.match(rf"  rank 0: hung: .*faults\.py:{barrier} in rank0_barrier: dist\.barrier\(\)$", lines[0]), text
    assert re.match(rf"  rank 1: hung: .*faults\.py:{collective} in rank0_barrier: dist\.all_reduce\(", lines[1]), text
    fault_case.finish()


@pytest.mark.timeout(150)
def test_a_rank_that_ignores_sigterm_is_killed_at_the_bound(fault_case):
    """Rank 0 fails; torchrun sends rank 1 SIGTERM, which rank 1 ignores (torchrun would wait 30 s before
    its own SIGKILL). The launch's bound strikes first: rank 1's stack is shown, then it is SIGKILLed,
    and everything is gone within the bound plus a few seconds. Rank 0 fails FAIL_AFTER seconds after
    both ranks are up, so that torchrun's SIGKILL (30 s later) cannot come before the bound however fast
    the ranks started, and the failure itself comes before the bound unless they took over 25 s."""
    run = fault_case.launch(
        "sleep", "--ignore-sigterm", "1", "--fail-rank", "0", "--fail-after", str(FAIL_AFTER), timeout=BOUND_NO_TORCH
    )
    text = run.describe_failure()
    assert fault_case.readied() == ["rank0.ready", "rank1.ready"], f"the ranks never got there:\n{text}"
    rank1 = run.ranks[1].pid
    assert re.search(rf"Sending process {rank1} closing signal SIGTERM", run.launcher_output), (
        f"torchrun never asked rank 1 (pid {rank1}) to stop:\n{run.launcher_output[-3000:]}"
    )
    assert run.timed_out, text
    assert run.ranks[0].error == "RuntimeError: rank 0 fails on purpose", text
    assert run.ranks[1].status == "hung", text  # still running at the bound, SIGTERM notwithstanding
    assert line_of(FAULTS, "# FAULT-SLEEP") in stack_lines(run, 1), text
    assert "Before that, rank 0 failed" in text, text
    took = fault_case.returned_after
    assert ended_by(BOUND_NO_TORCH, took), f"bound {BOUND_NO_TORCH} s, returned after {took:.1f} s"
    assert fault_case.left_after(GONE_GRACE) == [], "processes of the run outlived the launch"
    assert run.leftovers == []
    fault_case.finish()


# --------------------------------------------------------------------------- torchrun itself


@pytest.mark.timeout(150)
def test_a_static_port_already_taken_fails_clearly_and_standalone_does_not(fault_case):
    """Bare torchrun told to rendezvous on a port that a socket of this test listens on fails at once,
    naming the port and EADDRINUSE; --standalone (what lessonlib.launch uses) picks its own and runs."""
    hello = fault_case.root / "hello.py"
    hello.write_text("import os\nprint('hello from rank', os.environ['RANK'], flush=True)\n")
    env = {**os.environ, "TEST_TAG": fault_case.tag}  # TMPDIR is the case's own

    def torchrun(*how):
        logs = fault_case.root / f"logs-{len(how)}"  # torchrun's own log folder, outside TMPDIR
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", *how, f"--log-dir={logs}", hello]
        return run_bounded(argv, 90, cwd=fault_case.root, env=env)

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        taken = torchrun("--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}")
        standalone = torchrun("--standalone")
    assert not taken.timed_out and taken.returncode != 0, taken.output[-3000:]
    said = taken.output[-3000:]
    assert str(port) in said and ("EADDRINUSE" in said or "address already in use" in said.lower()), said
    assert "hello from rank" not in taken.output
    assert not standalone.timed_out and standalone.returncode == 0, standalone.output[-3000:]
    assert "hello from rank 0" in standalone.output, standalone.output[-3000:]
    fault_case.finish()


# --------------------------------------------------------------------------- many launches at once

CONCURRENT = 4  # each with a fresh torchrun agent (an environment of its own): some 3-4 CPU-s each


@pytest.mark.timeout(300)
def test_concurrent_launches_each_see_only_their_own_output(fault_case):
    """CONCURRENT 2-rank launches from as many threads at once, each with an environment of its own (so a
    fresh torchrun agent each), each printing lines that name it, a different number per launch: every
    run's ranks hold exactly their own lines, in order, and nothing of the others. (tests/test_launcher.py
    runs four forked ones at once and checks their ports.)"""
    counts = {f"run{k}": 5 + k for k in range(CONCURRENT)}

    def one(token):
        return fault_case.launch("say", "--token", token, "--lines", counts[token], timeout=180)

    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        runs = dict(zip(counts, pool.map(one, counts)))
    for token, run in runs.items():
        assert run.ok, run.describe_failure()
        for r in run.ranks:
            for stream, lines in (("out", r.stdout), ("err", r.stderr)):
                want = [f"{token} rank {r.rank} {stream} {i}" for i in range(counts[token])]
                assert lines.splitlines() == want, f"{token}, rank {r.rank}, std{stream}:\n{lines}"
    fault_case.finish()


# --------------------------------------------------------------------------- notebooks and kernels

KERNEL_LAUNCH = """import lessonlib
lessonlib.launch({script!r}, nproc=2, args={args!r}, timeout=120, show="none", env={env!r})
"""


def kernel_manager(case, asynchronous=False):
    """A python3 kernel manager whose connection file lies outside the case's TMPDIR (the client's to
    make and remove; it is not the run's). The kernel inherits this process's environment: TMPDIR too.
    nbclient needs the asynchronous one: with a blocking client its cell timeout never strikes."""
    from jupyter_client import AsyncKernelManager, KernelManager

    manager = AsyncKernelManager if asynchronous else KernelManager
    return manager(kernel_name="python3", connection_file=str(case.root / "kernel.json"))


@contextlib.contextmanager
def running_kernel(case, env=None):
    km = kernel_manager(case)
    km.start_kernel(cwd=str(ROOT), **({} if env is None else {"env": {**os.environ, **env}}))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        kc.execute_interactive("import lessonlib, lessonlib.launcher.core", timeout=60)  # not part of any bound
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)  # also reaps a kernel the test killed, and removes the connection file


# Seconds nbclient waits for the hanging cell (the launch in it has 120): time for the torchrun agent to
# import torch and start both ranks first, on 2 cores with the book executing beside this test.
CELL_TIMEOUT = 45


@pytest.mark.timeout(180)
def test_a_cell_timeout_interrupts_the_launch_and_the_next_cell_launches_again(fault_case):
    """nbclient runs a notebook whose cell launches ranks that never end (launch timeout 120 s) under a
    15 s cell timeout: nbclient interrupts the kernel, the launch's KeyboardInterrupt path kills every
    process of the run (a grandchild in a session of its own too) before the cell ends, and the next
    cell, in the same kernel, finds none of them and launches again successfully."""
    import nbformat
    from jupyter_core.utils import run_sync
    from nbclient import NotebookClient

    hang = KERNEL_LAUNCH.format(script=str(fault_case.script), args=["sleep", "--grandchild"], env=fault_case.env())
    after = f"""from lessonlib.processes.marks import marked_processes
left = marked_processes({fault_case.tag!r}, var="TEST_TAG")
assert left == [], f"left after the interrupt: {{left}}"
run = lessonlib.launch({str(fault_case.follow_up)!r}, nproc=2, timeout=90, show="none", env={fault_case.env()!r})
assert run.ok, run.describe_failure()
print("launched again:", [r.stdout for r in run.ranks])
"""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import lessonlib, lessonlib.launcher.core"),
        nbformat.v4.new_code_cell(hang, metadata={"test_timeout": CELL_TIMEOUT}),
        nbformat.v4.new_code_cell(after),
    ]
    km = kernel_manager(fault_case, asynchronous=True)
    client = NotebookClient(
        nb,
        km=km,
        timeout_func=lambda cell: cell.metadata.get("test_timeout", 120),
        interrupt_on_timeout=True,
        allow_errors=True,
        resources={"metadata": {"path": str(ROOT)}},
    )
    try:
        client.execute()
        kernel = psutil.Process(km.provisioner.process.pid)
    finally:  # nbclient shuts down only a kernel it started itself: this one is the test's to end
        run_sync(km.shutdown_kernel)(now=True)
    assert not kernel.is_running() or kernel.status() == psutil.STATUS_ZOMBIE, (
        f"the kernel {kernel.pid} outlived the test"
    )
    errors = [[o for o in c.outputs if o.output_type == "error"] for c in nb.cells]
    assert errors[0] == [] and errors[2] == [], f"cells failed: {errors}"
    assert [e.ename for e in errors[1]] == ["KeyboardInterrupt"], errors[1]
    assert fault_case.readied() == ["grandchild.pid", "rank0.ready", "rank1.ready"], (
        f"the cell timeout struck before the ranks were up: {fault_case.readied()}"
    )
    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert f"launched again: {FOLLOWED_UP}" in printed, nb.cells[2].outputs
    timing = nb.cells[1].metadata.execution
    seconds = _seconds(timing["iopub.execute_input"], timing["shell.execute_reply"])
    # Only the upper bound: the kernel's clock starts the cell after nbclient's has started its timeout.
    assert seconds < 2 * CELL_TIMEOUT, f"the interrupted cell took {seconds:.1f} s (cell timeout {CELL_TIMEOUT} s)"
    fault_case.finish(follow_up=False)  # the notebook's last cell was the follow-up launch


def _seconds(start, end):
    from datetime import datetime

    return (datetime.fromisoformat(end.rstrip("Z")) - datetime.fromisoformat(start.rstrip("Z"))).total_seconds()


def kernel_and_launch_env(case, agent):
    """A fresh agent: the case's variables given to the launch (env=...). A forked one: given to the
    kernel instead, so that the launch has no env of its own and forks its agent from the kernel's agent
    server (lessonlib.launcher.fastpath.agentserver), which then carries the case's tag too."""
    return (None, case.env()) if agent == "fresh" else (case.env(), None)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("agent", ["fresh", "forked"])
def test_a_killed_kernel_takes_the_agent_and_every_rank_with_it(fault_case, agent):
    """SIGKILL the kernel while its launch runs: nobody is left to run the launcher's cleanup, so the
    torchrun agent (SIGTERM when its parent dies) and the ranks (SIGKILL when theirs does) must go by
    themselves (lessonlib.processes.lifeline), within a few seconds; and so must the agent server, where the
    agent was forked from one."""
    kernel_env, launch_env = kernel_and_launch_env(fault_case, agent)
    with running_kernel(fault_case, kernel_env) as (km, kc):
        kc.execute(KERNEL_LAUNCH.format(script=str(fault_case.script), args=["sleep"], env=launch_env))
        fault_case.wait_ready(["rank0.ready", "rank1.ready"])
        running = fault_case.processes()
        # Forked: the kernel, its agent server, the agent and two ranks all carry the tag; all but the
        # kernel show the server's command line.
        expected = 3 if agent == "fresh" else 5
        assert len(running) == expected, f"expected {expected}: {[describe(p) for p in running]}"
        if agent == "forked":
            assert sum("lessonlib.launcher.fastpath.agentserver" in " ".join(p.cmdline()) for p in running) == 4, (
                running
            )
        os.kill(km.provisioner.pid, signal.SIGKILL)
        left = fault_case.left_after(KILLED_KERNEL_BOUND)
        assert left == [], f"alive {KILLED_KERNEL_BOUND} s after the kernel was killed: {[describe(p) for p in left]}"
    fault_case.finish()  # the run folder too: the agent removed it (lessonlib.launcher._agent_main)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("agent", ["fresh", "forked"])
def test_a_killed_kernel_leaves_nothing_behind(fault_case, agent):
    """As above, but the run has what a real one may have: rank 0 started a process in a session of its
    own (a server, a detached worker) and rank 1 ignores SIGTERM. Within a few seconds of the kernel's
    death every process carrying the run's marker must be gone, and its run folder with them."""
    args = ["sleep", "--grandchild", "--ignore-sigterm", "1"]
    kernel_env, launch_env = kernel_and_launch_env(fault_case, agent)
    with running_kernel(fault_case, kernel_env) as (km, kc):
        kc.execute(KERNEL_LAUNCH.format(script=str(fault_case.script), args=args, env=launch_env))
        fault_case.wait_ready(["grandchild.pid", "rank0.ready", "rank1.ready"])
        roles = {int((fault_case.ready / f"rank{r}.ready").read_text()): f"rank {r}" for r in (0, 1)}
        roles[int((fault_case.ready / "grandchild.pid").read_text())] = "rank 0's grandchild"
        os.kill(km.provisioner.pid, signal.SIGKILL)
        left = fault_case.left_after(KILLED_KERNEL_BOUND)
        survivors = [f"{roles.get(p.pid, 'torchrun agent')} ({describe(p)})" for p in left]
        kill_processes(left)
    problems = [f"alive {KILLED_KERNEL_BOUND} s after the kernel was killed: {s}" for s in survivors]
    problems += [f"left in TMPDIR: {name}" for name in fault_case.tmp_contents() if "/" not in name]
    assert problems == [], "\n".join(problems)
    fault_case.finish()
