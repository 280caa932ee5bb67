"""What a launch left behind, read into a RunResult, and which rank failed first (chapter 1).

    run.ok, run.ranks[1].stdout, run.root_cause, run.raise_for_status()

How a run is told (its status line, one line per rank, the failure story, the HTML and text views) is
lessonlib.view's; the methods here that return text call it. How each rank ended is a RunStatus
(lessonlib.launcher.status).

`read_result` builds the RunResult from two sources. The ranks' own records in the run folder
(lessonlib.launcher.runfolder) come first: their output, when each started and ended, the exception that
ended it. A rank that left no exit record (os._exit, a signal, a kill on timeout) is judged from what
the launcher saw instead (an Ending): when its process disappeared, whether the run timed out or was
interrupted, and the exit code torchrun reported for it. A run that failed because of the machine (a
full disk, too many open files, a rank the out-of-memory killer likely killed) has it named in one line
in `fault` (lessonlib.launcher.faults).
"""

import re
import signal
from dataclasses import dataclass, field

from . import runfolder
from .faults import Seen, name_fault
from .status import RunStatus


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
    status: RunStatus = RunStatus.NOT_STARTED
    pid: int | None = None
    start: float | None = None
    end: float | None = None
    error: str = ""  # "ValueError: ..." for an uncaught exception
    traceback: str = ""
    reports: list = field(default_factory=list)  # [(tag, value)] from lessonlib.report
    nofile_limit: tuple | None = None  # its RLIMIT_NOFILE (soft, hard) as it ended, from its exit record

    @property
    def ok(self):
        return self.exitcode == 0


@dataclass(kw_only=True)
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
    # What in the machine made the run fail, in one line (lessonlib.launcher.faults): a disk that filled up,
    # too many open files, a rank killed by SIGKILL that the launcher did not send; None if nothing was seen.
    fault: str | None = None

    @property
    def world_size(self):
        return self.nproc * self.nnodes

    @property
    def ok(self):
        return (
            not self.timed_out
            and not self.interrupted
            and all(rc == 0 for rc in self.returncodes)
            and all(r.ok for r in self.ranks)
        )

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
        failed = [r for r in self.ranks if r.status == RunStatus.FAILED]
        if not failed:
            return None
        return min(failed, key=lambda r: (_is_collateral(r), r.end if r.end is not None else float("inf")))

    @property
    def left_early(self):
        """Ranks that exited 0 before the first failure, when every failure only says a peer went away.

        A rank that leaves cleanly while the others still call collectives (it thought the data had
        run out) fails nothing itself, and its peers fail with "Connection closed by peer": then the
        culprit is among these, not among the failed ranks (chapter 12).
        """
        failed = [r for r in self.ranks if r.status == RunStatus.FAILED]
        if not failed or not all(_is_collateral(r) for r in failed):
            return []
        first = min((r.end for r in failed if r.end is not None), default=None)
        return [r.rank for r in self.ranks if r.ok and r.end is not None and (first is None or r.end < first)]

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
        """What went wrong: a headline, one line per rank (how it ended, where it was), then the root
        cause's traceback and the stacks of ranks that were stopped (the text is lessonlib.view.story's)."""
        from ..view.story import describe_failure

        return describe_failure(self)

    @property
    def ranks_start(self):
        starts = [r.start for r in self.ranks if r.start is not None]
        return min(starts) if starts else None

    def _repr_html_(self):
        from ..view.html import render_html

        return render_html(self)

    def _ipython_display_(self):
        # As _repr_html_, but not again in the cell whose launch view already shows this run.
        from ..view.live import display_result

        display_result(self)

    def __str__(self):
        from ..view.story import render_text

        return render_text(self)

    def __repr__(self):
        # Short: the ranks' whole output is in str(run), and a repr is what a REPL or a failed assert prints.
        state = "ok" if self.ok else "timed out" if self.timed_out else "interrupted" if self.interrupted else "failed"
        return (
            f"<RunResult {self.script} {state}: {self.world_size} rank(s), failed {self.failed_ranks}, "
            f"{self.wall_time:.2f} s>"
        )


COLLATERAL = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Socket closed|recvValue failed", re.I)


def _is_collateral(rank):
    """True when a rank's error only says that another rank went away."""
    return bool(COLLATERAL.search(rank.error or ""))


# --------------------------------------------------------------------------- reading a run folder


@dataclass(frozen=True, kw_only=True)
class Ending:
    """How the run ended as the launcher saw it: what the ranks could not record themselves."""

    returncodes: list  # one per torchrun agent
    agent_pids: list
    wall_time: float
    timed_out: bool
    interrupted: bool
    gone_at: dict  # {rank: time.time() when the launcher saw its process disappear}
    leftovers: list  # processes found alive after the run's own kill (a launcher bug if any)
    # {rank: exit code} as the ranks' parent saw it, where that is the caller itself (the lesson tests
    # fork their ranks); under torchrun, its failure summary says it instead.
    exitcodes: dict = field(default_factory=dict)
    seen: Seen | None = None  # what the launcher saw of the machine during the run (faults.EnvironmentWatch)


def read_result(spec, run_dir, ending):
    """The RunResult of the launch `spec` (a LaunchSpec) from its run folder and how it ended."""
    launcher_output = "\n".join(
        (f"--- torchrun agent for node {i} ---\n" if spec.nnodes > 1 else "")
        + runfolder.read_text(runfolder.agent_log(run_dir, i))
        for i in range(spec.nnodes)
    )
    from_torchrun = _torchrun_failures(launcher_output)
    ranks = []
    for rank in range(spec.world_size):
        r, recorded_exit = _as_recorded(run_dir, rank)
        if r.start is not None and not recorded_exit:
            _judge_unrecorded(r, ending, from_torchrun.get(rank, ending.exitcodes.get(rank)))
        ranks.append(r)
    result = RunResult(
        script=spec.shown,
        args=list(spec.args),
        nproc=spec.nproc,
        nnodes=spec.nnodes,
        ranks=ranks,
        launcher_output=launcher_output,
        returncodes=ending.returncodes,
        wall_time=ending.wall_time,
        timeout=spec.timeout,
        timed_out=ending.timed_out,
        interrupted=ending.interrupted,
        leftovers=[f"pid {p.pid}" for p in ending.leftovers],
        agent_pids=ending.agent_pids,
    )
    if not result.ok:
        result.fault = name_fault(result, ending.seen)
    return result


def _as_recorded(run_dir, rank):
    """(RankOutput, whether it has an exit record) from what the rank wrote itself."""
    r = RankOutput(
        rank,
        stdout=runfolder.read_text(runfolder.output_file(run_dir, rank, "stdout")),
        stderr=runfolder.read_text(runfolder.output_file(run_dir, rank, "stderr")),
    )
    r.reports.extend(runfolder.read_reports(run_dir, rank))
    start, done = runfolder.read_start(run_dir, rank), runfolder.read_exit(run_dir, rank)
    if start:
        r.pid, r.start, r.status = start["pid"], start["time"], RunStatus.TERMINATED
    if done:
        r.exitcode, r.end = done["exitcode"], done["end"]
        r.status = RunStatus.OK if r.exitcode == 0 else RunStatus.FAILED
        if done.get("exc_type"):
            r.error = f"{done['exc_type']}: {done.get('message', '')}".rstrip(": ")
            r.traceback = done.get("traceback", "")
        if done.get("nofile"):
            r.nofile_limit = tuple(done["nofile"])
    return r, bool(done)


def _judge_unrecorded(r, ending, torchrun_exitcode):
    """A rank that started but left no exit record: its end, exit code and status from the launcher's view."""
    r.end = ending.gone_at.get(r.rank)
    if ending.timed_out or ending.interrupted:
        r.status = RunStatus.HUNG if ending.timed_out else RunStatus.INTERRUPTED
    elif all(rc == 0 for rc in ending.returncodes):
        r.exitcode, r.status = 0, RunStatus.OK  # torchrun saw it exit 0 (e.g. via os._exit)
    elif torchrun_exitcode is not None and torchrun_exitcode > 0:
        r.exitcode, r.status = torchrun_exitcode, RunStatus.FAILED  # os._exit(n): no Python record, a real failure
        r.error = f"exit code {r.exitcode}"
    elif torchrun_exitcode is not None and torchrun_exitcode < 0:
        sig = -torchrun_exitcode
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        r.exitcode, r.status, r.error = torchrun_exitcode, RunStatus.FAILED, f"killed by {name}"
        if sig == signal.SIGTERM:
            r.status = RunStatus.TERMINATED  # torchrun stopping the group after another failure
    else:
        r.exitcode = torchrun_exitcode  # 0 or unknown: still "terminated"


def _torchrun_failures(text):
    """{rank: exitcode} from torchrun's failure summary, for ranks that left no exit record."""
    found = {}
    for m in re.finditer(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", text):
        found.setdefault(int(m.group(1)), int(m.group(2)))
    return found
