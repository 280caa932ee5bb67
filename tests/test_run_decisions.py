"""The launcher's decisions about a run, on run folders written by hand (unit tier: no process), and one real
launch that keeps the hand-written folders the same as the real ones.

Each test writes, file by file, what the ranks of a run would have left in its run folder (the format of
lessonlib/launcher/runfolder.py, as lessonlib/launcher/_rank_main.py writes it: rank{r}.stdout and .stderr,
the start and exit records, the reports; agent0.log, torchrun's own output), says how the launcher saw the
run end (an Ending), and reads it with the launcher's own `read_result`. Then it checks what the launcher
decides: each rank's RunStatus and exit code, the root cause among several failures, the ranks that left
early, and every word about it (lessonlib.view.story: the status line, one line per rank, the failure
story, the terminal's last line, `str(run)`) and what `raise_for_status` raises. test_result.py reads
folders made with runfolder's own writers; here the files are spelled out, and
`test_the_hand_written_folder_is_what_a_real_rank_writes` compares them with a real launch's.
"""

import json
import signal

import pytest

import lessonlib
from conftest import HELPERS
from lessonlib.launcher.request import check_launch
from lessonlib.launcher.result import Ending, LaunchError, read_result
from lessonlib.launcher.status import RunStatus
from lessonlib.view.story import describe_failure, exit_text, failure_line, rank_lines, render_text, status_line

# The keys of the records _rank_main writes (the format test below holds them to a real run's).
START_KEYS = {"rank", "pid", "time"}
EXIT_KEYS = {"rank", "pid", "start", "end", "exitcode", "nofile"}  # nofile: its open-file limits
FAILED_EXIT_KEYS = EXIT_KEYS | {"exc_type", "message", "traceback"}
# What gloo says on a rank whose peer went away (the path is where torch's build machine had gloo's source).
GLOO_AT = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
COLLATERAL = f"RuntimeError: {GLOO_AT}Connection closed by peer [127.0.0.1]:41234"

# The script the runs "ran": real lines, so that a stack dump's frames (which name no source) are read.
SCRIPT = """import time


def step(batch):
    raise ValueError(f"bad batch {batch}")


def wait():
    time.sleep(600)


step(3)
"""
RAISE_LINE, SLEEP_LINE = 5, 9


def summary(*failures):
    """torchrun's failure summary for (rank, exitcode) pairs, the first the root cause, made by torch's own
    ChildFailedError, as the agent prints it into agent0.log (no process: the message alone)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    found = {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>") for rank, code in failures}
    for i, rank in enumerate(found):
        found[rank].timestamp = 1_800_000_000 + i
    return ChildFailedError("lesson.py", found).format_msg()


class Run:
    """A run folder of `nproc` ranks per node on `nnodes` nodes, written by hand as the ranks write it."""

    def __init__(self, tmp_path, nproc=2, nnodes=1, timeout=30):
        self.script = tmp_path / "lesson.py"
        self.script.write_text(SCRIPT)
        self.dir = tmp_path / "run"
        self.dir.mkdir()
        self.spec = check_launch(
            self.script, nproc, [], timeout, None, nnodes=nnodes, backend=None, launcher="torchrun",
            rendezvous="c10d", cwd=tmp_path,
        )  # fmt: skip

    def write(self, name, text):
        (self.dir / name).write_text(text)
        return self

    def rank(self, r, *, out="", err="", start=1.0, end=None, exitcode=None, error=None, traceback="", reports=()):
        """Rank `r` started at `start` (None: never started its script), printed `out` and `err`, and, given an
        `exitcode`, ended at `end` and recorded it, with its `error` ("ValueError: ...") if it failed."""
        self.write(f"rank{r}.stdout", out).write(f"rank{r}.stderr", err)  # made as the rank starts, if empty
        if start is None:
            return self
        pid = 4000 + r
        self.write(f"rank{r}.start.json", json.dumps({"rank": r, "pid": pid, "time": start}))
        if reports:
            self.write(f"rank{r}.reports.jsonl", "".join(json.dumps({"tag": t, "value": v}) + "\n" for t, v in reports))
        if exitcode is not None:
            record = {"rank": r, "pid": pid, "start": start, "end": end, "exitcode": exitcode, "nofile": [1024, 4096]}
            if error is not None:
                exc_type, _, message = error.partition(": ")
                record.update(exc_type=exc_type, message=message, traceback=traceback)
            self.write(f"rank{r}.exit.json", json.dumps(record))
        return self

    def ok(self, *ranks, end=2.0, **kwargs):
        for r in ranks:
            self.rank(r, end=end, exitcode=0, **kwargs)
        return self

    def raised(self, r, end=2.0, batch=3, **kwargs):
        """Rank `r` raised in step(): its traceback on stderr and in its exit record, as _rank_main does."""
        tb = traceback_text(self.script, batch)
        return self.rank(r, err=tb, end=end, exitcode=1, error=f"ValueError: bad batch {batch}", traceback=tb, **kwargs)

    def agent(self, text, node=0):
        return self.write(f"agent{node}.log", text)

    def read(self, returncodes=None, timed_out=False, interrupted=False, gone_at=None, wall=3.0):
        ending = Ending(
            returncodes=[0] * self.spec.nnodes if returncodes is None else returncodes,
            agent_pids=[10 + n for n in range(self.spec.nnodes)],
            wall_time=wall,
            timed_out=timed_out,
            interrupted=interrupted,
            gone_at=gone_at or {},
            leftovers=[],
        )
        return read_result(self.spec, str(self.dir), ending)


def traceback_text(script, batch=3):
    return (
        "Traceback (most recent call last):\n"
        f'  File "{script}", line 12, in <module>\n'
        "    step(3)\n"
        f'  File "{script}", line {RAISE_LINE}, in step\n'
        '    raise ValueError(f"bad batch {batch}")\n'
        f"ValueError: bad batch {batch}\n"
    )


def stack_text(script, thread="Current thread"):
    """What faulthandler prints on SIGUSR1 or SIGTERM: rank r waiting in wait()."""
    return (
        f"{thread} 0x00007f0b2c9b7740 (most recent call first):\n"
        f'  File "{script}", line {SLEEP_LINE} in wait\n'
        f'  File "{script}", line 12 in <module>\n'
    )


def statuses(run):
    return [(r.status, r.exitcode) for r in run.ranks]


def lines(run):
    return [str(line) for line in rank_lines(run)]


# --------------------------------------------------------------------------- every rank ok


@pytest.mark.unit
@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_every_rank_ok(tmp_path, nproc):
    run = Run(tmp_path, nproc=nproc).ok(*range(nproc)).read()
    assert run.ok and statuses(run) == [(RunStatus.OK, 0)] * nproc
    assert run.root_cause is None and run.failed_ranks == [] and run.left_early == []
    assert run.raise_for_status() is run
    ranks = "1 rank" if nproc == 1 else f"{nproc} ranks"
    assert status_line(run) == f"ok: torchrun --nproc_per_node={nproc} lesson.py ({ranks}, 3.00 s)"
    assert lines(run) == [f"rank {r}: exit 0" for r in range(nproc)]


@pytest.mark.unit
def test_an_ok_run_says_so_in_its_failure_story_too(tmp_path):
    assert Run(tmp_path, nproc=1).ok(0).read().describe_failure() == "lesson.py: its one rank exited 0"


@pytest.mark.unit
def test_an_ok_run_of_four_ranks_says_all_four(tmp_path):
    assert Run(tmp_path, nproc=4).ok(0, 1, 2, 3).read().describe_failure() == "lesson.py: all 4 ranks exited 0"


@pytest.mark.unit
@pytest.mark.parametrize("end", ["\n", ""], ids=["trailing newline", "no trailing newline"])
def test_output_is_read_as_written_with_or_without_a_trailing_newline(tmp_path, end):
    run = Run(tmp_path).ok(0, out=f"loss 0.5\nloss 0.25{end}", err=f"a warning{end}").ok(1).read()
    assert run.ranks[0].stdout == f"loss 0.5\nloss 0.25{end}" and run.ranks[0].stderr == f"a warning{end}"
    text = render_text(run).splitlines()
    assert text[1:5] == [
        "--- rank 0 (exit 0) ---",
        "[rank 0] loss 0.5",
        "[rank 0] loss 0.25",
        "[rank 0:stderr] a warning",
    ], text
    assert text[5:] == ["rank 1 printed nothing (exit 0)"], text


@pytest.mark.unit
def test_reports_are_read_back_by_rank(tmp_path):
    run = Run(tmp_path, nproc=3).ok(0, reports=[("loss", 0.5), ("loss", 0.25)]).ok(1).ok(2, reports=[("loss", 1)])
    assert run.read().reports_by_rank("loss") == {0: [0.5, 0.25], 1: [], 2: [1]}


@pytest.mark.unit
def test_ranks_that_printed_nothing_are_told_in_one_line_by_how_they_ended(tmp_path):
    run = Run(tmp_path, nproc=4).ok(0, 1, 3).raised(2).read(returncodes=[1])
    assert render_text(run).splitlines()[-1] == "ranks 0, 1, 3 printed nothing (exit 0)"


# --------------------------------------------------------------------------- one rank raised


def raised_run(tmp_path, nproc=2, rank=1):
    folder = Run(tmp_path, nproc=nproc).ok(*(r for r in range(nproc) if r != rank))
    return folder.raised(rank).agent(summary((rank, 1))).read(returncodes=[1])


@pytest.mark.unit
def test_a_rank_that_raised_is_failed_with_its_error_and_traceback(tmp_path):
    run = raised_run(tmp_path)
    assert not run.ok and statuses(run) == [(RunStatus.OK, 0), (RunStatus.FAILED, 1)]
    assert run.ranks[1].error == "ValueError: bad batch 3" and run.ranks[1].status == "failed"
    assert run.ranks[1].traceback == traceback_text(tmp_path / "lesson.py")
    assert run.root_cause is run.ranks[1] and run.failed_ranks == [1] and run.left_early == []


@pytest.mark.unit
def test_a_rank_that_raised_has_a_line_saying_what_and_where(tmp_path):
    run = raised_run(tmp_path)
    assert lines(run) == [
        "rank 0: exit 0",
        f"rank 1 (root cause): ValueError: bad batch 3; at {tmp_path / 'lesson.py'}:{RAISE_LINE} in step: "
        'raise ValueError(f"bad batch {batch}")',
    ]


@pytest.mark.unit
def test_a_rank_that_raised_in_the_status_and_terminal_lines(tmp_path):
    run = raised_run(tmp_path)
    assert status_line(run) == (
        "failed on rank(s) 1: torchrun --nproc_per_node=2 lesson.py (3.00 s); "
        "first failure: rank 1 (ValueError: bad batch 3)"
    )
    assert failure_line(run) == "lesson.py failed on rank(s) 1 of 2: rank 1 failed first with ValueError: bad batch 3"


@pytest.mark.unit
def test_a_rank_that_raised_in_the_failure_story(tmp_path):
    run = raised_run(tmp_path)
    story = run.describe_failure().splitlines()
    assert story[:3] == ["lesson.py failed on rank(s) 1 of 2:", "  rank 0: exit 0", f"  {lines(run)[1]}"]
    assert story[3] == "First failure (root cause): rank 1 exited 1 at +1.00 s with ValueError: bad batch 3"
    assert story[4:] == ["--- rank 1 traceback ---", *run.ranks[1].traceback.rstrip("\n").splitlines()]


@pytest.mark.unit
def test_raise_for_status_raises_the_failure_story(tmp_path):
    run = raised_run(tmp_path)
    with pytest.raises(LaunchError) as caught:
        run.raise_for_status()
    assert str(caught.value) == run.describe_failure() == describe_failure(run) and caught.value.result is run


@pytest.mark.unit
@pytest.mark.parametrize("nproc, rank", [(1, 0), (4, 2)])
def test_the_rank_that_raised_at_one_and_four_ranks(tmp_path, nproc, rank):
    run = raised_run(tmp_path, nproc=nproc, rank=rank)
    assert run.failed_ranks == [rank] and run.root_cause.rank == rank
    assert run.describe_failure().startswith(f"lesson.py failed on rank(s) {rank} of {nproc}:\n")
    assert [line.split(":")[0] for line in lines(run)] == [
        f"rank {r} (root cause)" if r == rank else f"rank {r}" for r in range(nproc)
    ]


@pytest.mark.unit
def test_sys_exit_with_a_message_is_a_failure_with_no_traceback(tmp_path):
    run = Run(tmp_path).ok(0).rank(1, err="no data found\n", end=2.0, exitcode=1, error="SystemExit: no data found")
    run = run.read(returncodes=[1])
    assert statuses(run)[1] == (RunStatus.FAILED, 1) and run.ranks[1].error == "SystemExit: no data found"
    assert lines(run)[1] == "rank 1 (root cause): SystemExit: no data found"
    story = run.describe_failure().splitlines()
    assert story[-2:] == ["--- rank 1 traceback ---", "no data found"], story  # its stderr, where Python printed it


@pytest.mark.unit
def test_sys_exit_with_a_number_is_that_exit_code(tmp_path):
    run = Run(tmp_path).ok(0).rank(1, end=2.0, exitcode=3, error="SystemExit: 3").read(returncodes=[1])
    assert statuses(run)[1] == (RunStatus.FAILED, 3) and run.root_cause.rank == 1
    assert "First failure (root cause): rank 1 exited 3 at +1.00 s with SystemExit: 3" in run.describe_failure()
    assert run.describe_failure().splitlines()[-1] == "(no traceback: see its stderr)"


# --------------------------------------------------------------------------- killed by a signal, no record


def killed_run(tmp_path, code=-signal.SIGKILL):
    folder = Run(tmp_path).raised(0, end=2.5).rank(1)  # rank 1 started, then left no exit record
    return folder.agent(summary((1, code), (0, 1))).read(returncodes=[1], gone_at={1: 1.5})


@pytest.mark.unit
def test_a_rank_killed_by_a_signal_is_failed_with_the_signal_and_the_time_it_went(tmp_path):
    run = killed_run(tmp_path)
    assert statuses(run) == [(RunStatus.FAILED, 1), (RunStatus.FAILED, -9)]
    assert run.ranks[1].error == "killed by SIGKILL" and run.ranks[1].end == 1.5
    assert run.root_cause.rank == 1  # it went first: 1.5 against 2.5


@pytest.mark.unit
def test_a_rank_killed_by_a_signal_in_every_line(tmp_path):
    run = killed_run(tmp_path)
    assert lines(run)[1] == "rank 1 (root cause): killed by SIGKILL (exit -9)"
    assert (
        failure_line(run) == "lesson.py failed on rank(s) 0, 1 of 2: rank 1 failed first, killed by SIGKILL (exit -9)"
    )
    assert status_line(run).endswith("; first failure: rank 1 (killed by SIGKILL)")
    # A SIGKILL the launcher did not send is a fault of the machine (launcher/faults.py): the story opens with it.
    story = run.describe_failure().splitlines()
    assert story[0].startswith("Cause: rank 1 was killed by SIGKILL, which the launcher did not send: likely"), story
    assert story[4] == "First failure (root cause): rank 1 was killed by SIGKILL (exit -9) at +0.50 s", story
    assert story[5:] == ["--- rank 1 traceback ---", "(no traceback: see its stderr)"], story


@pytest.mark.unit
def test_a_rank_that_left_by_os_exit_has_the_exit_code_torchrun_saw(tmp_path):
    run = killed_run(tmp_path, code=3)
    assert statuses(run)[1] == (RunStatus.FAILED, 3) and run.ranks[1].error == "exit code 3"
    assert lines(run)[1] == "rank 1 (root cause): exit code 3"
    assert run.describe_failure().splitlines()[3] == "First failure (root cause): rank 1 exited 3 at +0.50 s"
    assert failure_line(run).endswith(": rank 1 failed first, exit code 3")


@pytest.mark.unit
def test_a_rank_torchrun_stopped_after_another_failed_says_where_it_was(tmp_path):
    folder = Run(tmp_path).rank(0, err=stack_text(tmp_path / "lesson.py")).raised(1)
    run = folder.agent(summary((1, 1), (0, -signal.SIGTERM))).read(returncodes=[1])
    assert statuses(run) == [(RunStatus.TERMINATED, -15), (RunStatus.FAILED, 1)] and run.failed_ranks == [0, 1]
    assert run.root_cause.rank == 1  # a stopped rank is never the root cause
    assert lines(run)[0] == (
        "rank 0: stopped by torchrun (SIGTERM) after another rank failed; "
        f"at {tmp_path / 'lesson.py'}:{SLEEP_LINE} in wait: time.sleep(600)"
    )
    story = run.describe_failure()
    assert (
        "--- rank 0 stack (where it was when it was stopped) ---\n" + stack_text(tmp_path / "lesson.py").rstrip()
        in story
    )
    assert exit_text(run.ranks[0]) == "terminated, exit -15"


@pytest.mark.unit
def test_ranks_stopped_by_sigterm_with_no_rank_failing_do_not_blame_another(tmp_path):
    """torchrun itself stopped (a scheduler's SIGTERM): no rank failed, so none is said to have."""
    run = Run(tmp_path).rank(0).rank(1).agent(summary((0, -15), (1, -15))).read(returncodes=[1])
    assert statuses(run) == [(RunStatus.TERMINATED, -15)] * 2 and run.root_cause is None
    assert lines(run) == ["rank 0: stopped by torchrun (SIGTERM)", "rank 1: stopped by torchrun (SIGTERM)"]
    assert run.describe_failure().splitlines()[3] == "No rank recorded an error; torchrun said:"


# --------------------------------------------------------------------------- a timeout, with stack dumps


def hung_run(tmp_path, nproc=2, **kwargs):
    folder = Run(tmp_path, nproc=nproc)
    for r in range(nproc):
        folder.rank(r, out=f"rank {r} waiting\n", err=stack_text(tmp_path / "lesson.py"))
    return folder.read(returncodes=[-signal.SIGKILL], timed_out=True, wall=31.0, **kwargs)


@pytest.mark.unit
def test_a_timeout_leaves_every_running_rank_hung(tmp_path):
    run = hung_run(tmp_path)
    assert not run.ok and run.timed_out and statuses(run) == [(RunStatus.HUNG, None)] * 2
    assert run.root_cause is None and run.failed_ranks == [0, 1]


@pytest.mark.unit
def test_a_hung_rank_says_where_it_waited_from_its_stack_dump(tmp_path):
    run = hung_run(tmp_path)
    where = f"at {tmp_path / 'lesson.py'}:{SLEEP_LINE} in wait: time.sleep(600)"
    assert lines(run) == [f"rank {r}: hung: still running at the 30 s timeout, then killed; {where}" for r in (0, 1)]


@pytest.mark.unit
def test_a_timeout_in_the_status_and_terminal_lines(tmp_path):
    run = hung_run(tmp_path)
    assert status_line(run) == "timed out after 30 s: torchrun --nproc_per_node=2 lesson.py (31.00 s)"
    assert (
        failure_line(run)
        == "lesson.py timed out after 30 s (--timeout); rank(s) 0, 1 were still running and were killed"
    )


@pytest.mark.unit
def test_a_timeout_story_shows_each_ranks_stack(tmp_path):
    run = hung_run(tmp_path)
    story = run.describe_failure()
    assert story.splitlines()[0] == "lesson.py timed out after 30 s; rank(s) 0, 1 were still running and were killed:"
    dump = stack_text(tmp_path / "lesson.py").rstrip()
    assert f"Their Python stacks at that moment:\n--- rank 0 stack ---\n{dump}\n--- rank 1 stack ---\n{dump}" in story
    with pytest.raises(LaunchError, match="^lesson.py timed out after 30 s"):
        run.raise_for_status()


@pytest.mark.unit
def test_a_rank_that_failed_before_the_timeout_is_told_after_the_stacks(tmp_path):
    folder = Run(tmp_path, nproc=3).raised(0, end=1.5)
    for r in (1, 2):
        folder.rank(r, err=stack_text(tmp_path / "lesson.py"))
    run = folder.read(returncodes=[-signal.SIGKILL], timed_out=True)
    assert statuses(run) == [(RunStatus.FAILED, 1), (RunStatus.HUNG, None), (RunStatus.HUNG, None)]
    assert run.root_cause.rank == 0 and lines(run)[0].startswith("rank 0 (root cause): ValueError: bad batch 3")
    assert f"Before that, rank 0 failed:\n{traceback_text(tmp_path / 'lesson.py').rstrip()}" in run.describe_failure()
    assert failure_line(run).endswith(
        "rank(s) 1, 2 were still running and were killed; before that, rank 0 failed first with ValueError: bad batch 3"
    )


@pytest.mark.unit
def test_a_timeout_before_any_rank_started_says_torchrun_was_still_starting(tmp_path):
    folder = Run(tmp_path).rank(0, start=None).rank(1, start=None).agent("I1126 starting the agent\n")
    run = folder.read(returncodes=[-signal.SIGKILL], timed_out=True)
    assert statuses(run) == [(RunStatus.NOT_STARTED, None)] * 2
    assert run.describe_failure() == (
        "lesson.py timed out after 30 s before any rank had started its script (torchrun was still starting; "
        "everything was killed). torchrun said:\nI1126 starting the agent"
    )


# --------------------------------------------------------------------------- an interrupt


@pytest.mark.unit
def test_an_interrupt_leaves_running_ranks_interrupted_and_finished_ones_as_they_ended(tmp_path):
    folder = Run(tmp_path, nproc=3).ok(0).rank(1, err=stack_text(tmp_path / "lesson.py")).rank(2)
    run = folder.read(returncodes=[-signal.SIGKILL], interrupted=True)
    assert statuses(run) == [(RunStatus.OK, 0), (RunStatus.INTERRUPTED, None), (RunStatus.INTERRUPTED, None)]
    assert not run.ok and run.failed_ranks == [1, 2] and run.root_cause is None
    assert lines(run)[1].startswith("rank 1: interrupted: still running when the run was stopped, then killed; at ")
    assert status_line(run).startswith("interrupted: torchrun --nproc_per_node=3 lesson.py")
    assert failure_line(run) == "lesson.py was interrupted"
    story = run.describe_failure()
    assert story.startswith("lesson.py was interrupted; rank(s) 1, 2 were still running and were killed:\n"), story
    assert "--- rank 2 stack ---\n(none printed)" in story  # rank 2 printed no stack before the kill


# --------------------------------------------------------------------------- a rank with no exit record


@pytest.mark.unit
def test_a_rank_with_no_record_in_a_run_torchrun_ended_well_exited_0(tmp_path):
    run = Run(tmp_path).ok(0).rank(1).read()  # rank 1: os._exit(0), which skips the record
    assert run.ok and statuses(run) == [(RunStatus.OK, 0), (RunStatus.OK, 0)]


@pytest.mark.unit
def test_a_rank_with_no_record_and_no_exit_code_from_torchrun_says_so_not_none(tmp_path):
    """The launcher knows only that it started: no record of its own, and torchrun's summary names it not."""
    run = Run(tmp_path).raised(0).rank(1).agent(summary((0, 1))).read(returncodes=[1])
    assert statuses(run) == [(RunStatus.FAILED, 1), (RunStatus.TERMINATED, None)]
    assert lines(run)[1] == "rank 1: stopped before it recorded an exit (no exit code known)"
    assert exit_text(run.ranks[1]) == "terminated, no exit code"
    assert "None" not in run.describe_failure() + str(run) + failure_line(run) + status_line(run)


@pytest.mark.unit
def test_a_rank_that_never_started_its_script(tmp_path):
    run = Run(tmp_path).ok(0).rank(1, start=None).read(returncodes=[1])
    assert statuses(run) == [(RunStatus.OK, 0), (RunStatus.NOT_STARTED, None)] and run.failed_ranks == [1]
    assert (
        lines(run)[1] == "rank 1: never started its script" and exit_text(run.ranks[1]) == "not started, no exit code"
    )


# --------------------------------------------------------------------------- a rank that left early


def early_run(tmp_path, left_at=1.5, error=COLLATERAL):
    """Rank 1 exited 0 at `left_at`; rank 0 then failed at 2.0 with `error`."""
    folder = Run(tmp_path).ok(1, end=left_at).rank(0, end=2.0, exitcode=1, error=error, traceback=error + "\n")
    return folder.read(returncodes=[1])


@pytest.mark.unit
def test_a_rank_that_exited_0_before_its_peers_failed_left_early(tmp_path):
    run = early_run(tmp_path)
    assert run.left_early == [1] and run.ranks[1].ok and run.failed_ranks == [0] and run.root_cause.rank == 0
    assert lines(run) == [
        "rank 0 (first to fail): RuntimeError: Connection closed by peer [127.0.0.1]:41234",
        "rank 1 (left early: look here first): exit 0, before the others failed",
    ]
    assert "\nRank(s) 1 exited 0 before the first failure, while the others still called collectives" in (
        run.describe_failure()
    )


@pytest.mark.unit
def test_a_rank_that_exited_0_after_the_failure_did_not_leave_early(tmp_path):
    run = early_run(tmp_path, left_at=2.5)
    assert run.left_early == [] and lines(run)[0].startswith("rank 0 (root cause): ")
    assert "Rank(s)" not in run.describe_failure()


@pytest.mark.unit
def test_a_failure_of_its_own_is_the_cause_even_when_a_rank_left_before_it(tmp_path):
    run = early_run(tmp_path, error="ValueError: bad batch 3")
    assert run.left_early == [] and lines(run)[1] == "rank 1: exit 0"


@pytest.mark.unit
@pytest.mark.parametrize("said", ["Connection reset by peer", "Broken pipe", "Socket closed", "recvValue failed"])
def test_each_way_gloo_says_a_peer_went_away_is_collateral(tmp_path, said):
    run = early_run(tmp_path, error=f"RuntimeError: {said}")
    assert run.left_early == [1], said


# --------------------------------------------------------------------------- torchrun's agent failed alone


def agent_failed(tmp_path, nproc=2, nnodes=1, returncodes=(1,)):
    folder = Run(tmp_path, nproc=nproc, nnodes=nnodes).ok(*range(nproc * nnodes))
    return folder.agent("E1126 the agent's store went away\n").read(returncodes=list(returncodes))


@pytest.mark.unit
def test_torchrun_failing_while_every_rank_exited_0_is_a_failure_with_no_rank_to_blame(tmp_path):
    run = agent_failed(tmp_path)
    assert not run.ok and run.failed_ranks == [] and run.root_cause is None and run.left_early == []
    assert statuses(run) == [(RunStatus.OK, 0)] * 2


@pytest.mark.unit
def test_torchrun_failing_alone_is_said_without_an_empty_list_of_ranks(tmp_path):
    run = agent_failed(tmp_path)
    assert run.describe_failure().splitlines() == [
        "lesson.py failed: every rank exited 0, but torchrun exited 1:",
        "  rank 0: exit 0",
        "  rank 1: exit 0",
        "No rank recorded an error; torchrun said:",
        "E1126 the agent's store went away",
    ]
    assert failure_line(run) == "lesson.py failed: every rank exited 0, but torchrun exited 1"
    assert (
        status_line(run)
        == "failed (every rank exited 0, but torchrun exited 1): torchrun --nproc_per_node=2 lesson.py (3.00 s)"
    )
    with pytest.raises(LaunchError, match=r"^lesson.py failed: every rank exited 0, but torchrun exited 1:"):
        run.raise_for_status()


@pytest.mark.unit
def test_with_two_nodes_the_agent_that_failed_is_named(tmp_path):
    run = agent_failed(tmp_path, nproc=1, nnodes=2, returncodes=(0, 1))
    assert failure_line(run) == "lesson.py failed: every rank exited 0, but torchrun of node 1 exited 1"


# --------------------------------------------------------------------------- several ranks failed


@pytest.mark.unit
def test_of_failures_of_their_own_the_earliest_is_the_root_cause(tmp_path):
    run = Run(tmp_path, nproc=3).raised(0, end=5.0, batch=0).raised(1, end=4.0, batch=1).ok(2).read(returncodes=[1])
    assert run.failed_ranks == [0, 1] and run.root_cause.rank == 1
    assert [line.split(":")[0] for line in lines(run)] == ["rank 0", "rank 1 (root cause)", "rank 2"]
    assert (
        "First failure (root cause): rank 1 exited 1 at +3.00 s with ValueError: bad batch 1" in run.describe_failure()
    )


@pytest.mark.unit
def test_a_failure_of_its_own_comes_before_an_earlier_one_that_only_says_a_peer_went_away(tmp_path):
    folder = Run(tmp_path).rank(0, end=2.0, exitcode=1, error=COLLATERAL).raised(1, end=3.0)
    run = folder.read(returncodes=[1])
    assert run.root_cause.rank == 1 and run.left_early == []  # rank 0 only noticed that rank 1 had gone


@pytest.mark.unit
def test_when_every_failure_says_a_peer_went_away_the_earliest_is_named(tmp_path):
    folder = Run(tmp_path, nproc=3).rank(0, end=3.0, exitcode=1, error=COLLATERAL)
    run = folder.rank(1, end=2.0, exitcode=1, error=COLLATERAL).rank(2, end=2.5, exitcode=1, error=COLLATERAL).read([1])
    assert run.root_cause.rank == 1 and lines(run)[1].startswith("rank 1 (root cause): ")


@pytest.mark.unit
def test_a_failure_with_a_known_end_comes_before_one_without(tmp_path):
    folder = Run(tmp_path, nproc=3).raised(2, end=9.0).rank(1).agent(summary((1, -signal.SIGSEGV), (2, 1)))
    run = folder.ok(0).read(returncodes=[1])  # rank 1's end is not known: the launcher never saw it go
    assert statuses(run)[1] == (RunStatus.FAILED, -signal.SIGSEGV) and run.ranks[1].end is None
    assert run.root_cause.rank == 2


@pytest.mark.unit
def test_four_ranks_one_raised_and_torchrun_stopped_the_rest(tmp_path):
    folder = Run(tmp_path, nproc=4).raised(2)
    for r in (0, 1, 3):
        folder.rank(r, err=stack_text(tmp_path / "lesson.py"))
    run = folder.agent(summary((2, 1), (0, -15), (1, -15), (3, -15))).read(returncodes=[1])
    assert [s for s, _ in statuses(run)] == ["terminated", "terminated", "failed", "terminated"]
    assert run.failed_ranks == [0, 1, 2, 3] and run.root_cause.rank == 2
    assert (
        failure_line(run)
        == "lesson.py failed on rank(s) 0, 1, 2, 3 of 4: rank 2 failed first with ValueError: bad batch 3"
    )
    assert run.describe_failure().count("(where it was when it was stopped)") == 3


@pytest.mark.unit
def test_a_status_reads_as_its_word(tmp_path):
    run = raised_run(tmp_path)
    assert run.ranks[1].status == "failed" and str(run.ranks[1].status) == "failed"
    assert f"{run.ranks[0].status:>4}|" == "  ok|" and RunStatus("hung") is RunStatus.HUNG


# --------------------------------------------------------------------------- the hand-written folder is real


def test_the_hand_written_folder_is_what_a_real_rank_writes(tmp_path):
    """A real 2-rank launch (lessonlib.launch of tests/helpers/shows_run_folder.py: rank 0 exits 0, rank 1
    raises, both print and report) snapshots its run folder as each rank's interpreter ends; the folder this
    file writes by hand for the same run has the same files and the same record keys, and reads the same."""
    seen = tmp_path / "seen"
    seen.mkdir()
    real = lessonlib.launch(HELPERS / "shows_run_folder.py", nproc=2, args=[str(seen)], timeout=120, show="none")
    snaps = {r: json.loads((seen / f"rank{r}.json").read_text()) for r in (0, 1)}
    (tmp_path / "hand").mkdir()
    folder = Run(tmp_path / "hand", nproc=2)
    folder.ok(0, out="rank 0 says hello\n", err="rank 0 warns\n", reports=[("rank", 0)])
    folder.raised(1, reports=[("rank", 1)]).agent(summary((1, 1)))
    hand = folder.read(returncodes=[1])
    for r in (0, 1):
        assert snaps[r]["files"] == sorted(p.name for p in folder.dir.glob(f"rank{r}.*")), (r, snaps[r])
        assert set(snaps[r]["start"]) == START_KEYS, snaps[r]["start"]
    assert set(snaps[0]["exit"]) == EXIT_KEYS and set(snaps[1]["exit"]) == FAILED_EXIT_KEYS, snaps
    assert "agent0.log" in snaps[0]["entries"], snaps[0]["entries"]
    # The launcher reads both alike.
    assert statuses(real) == statuses(hand) == [(RunStatus.OK, 0), (RunStatus.FAILED, 1)], real.describe_failure()
    assert real.ranks[1].error == "ValueError: rank 1 fails on purpose" and real.root_cause.rank == hand.root_cause.rank
    assert real.reports_by_rank("rank") == hand.reports_by_rank("rank") == {0: [0], 1: [1]}
    assert real.ranks[1].stdout == "rank 1 says hello" and real.ranks[1].stderr.startswith("rank 1 warns"), real
