"""lessonlib.launcher.result: a run folder read into a RunResult, in every way a run can end (unit tier: no process).

Each test writes a run folder the way the ranks write it (lessonlib.launcher.runfolder's own writers: start and
exit records, reports, output files, the agent's log), says how the launcher saw the run end (an
Ending), and reads it back with `read_result`, as the launcher does. Then: each rank's status, exit code
and error; the root cause among several failures; ranks that left early; and the exit codes that
torchrun's failure summary gives for ranks that left no record of their own. What a real launch writes
is tested with real processes in test_launcher.py and test_faults.py.
"""

import signal

import pytest

from lessonlib.launcher import runfolder
from lessonlib.launcher.request import check_launch
from lessonlib.launcher.result import Ending, read_result

pytestmark = pytest.mark.unit

COLLATERAL = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"


def summary(*failures):
    """torchrun's failure summary for (rank, exitcode) pairs, the first the root cause, written by torch's
    own ChildFailedError (what the agent prints when a rank fails) after a line of the log before it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    found = {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>") for rank, code in failures}
    for i, rank in enumerate(found):  # the earliest is the root cause torchrun names
        found[rank].timestamp = 1_800_000_000 + i
    return "I1126 10:00:00 1000 torch/distributed/elastic/agent/server/api.py:700] stopping workers\n" + (
        ChildFailedError("lesson.py", found).format_msg()
    )


class Folder:
    """A run folder for `nproc` ranks on `nnodes` nodes, written as the ranks and agents write it."""

    def __init__(self, tmp_path, nproc=2, nnodes=1, timeout=60):
        script = tmp_path / "lesson.py"
        script.write_text("")
        self.dir = tmp_path / "run"
        self.dir.mkdir()
        self.spec = check_launch(
            script,
            nproc,
            [],
            timeout,
            None,
            nnodes=nnodes,
            backend=None,
            launcher="torchrun",
            rendezvous="c10d",
            cwd=tmp_path,
        )

    def start(self, rank, at=1.0, stdout="", stderr=""):
        runfolder.write_start(str(self.dir), rank, {"rank": rank, "pid": 100 + rank, "time": at})
        for stream, text in (("stdout", stdout), ("stderr", stderr)):
            with open(runfolder.output_file(str(self.dir), rank, stream), "a") as f:
                f.write(text)
        return self

    def exit(self, rank, code=0, at=2.0, error=None, traceback=""):
        record = {"rank": rank, "pid": 100 + rank, "start": 1.0, "end": at, "exitcode": code}
        if error:
            record["exc_type"], record["message"] = error.split(": ", 1)
            record["traceback"] = traceback
        runfolder.write_exit(str(self.dir), rank, record)
        return self

    def agent_log(self, text, node=0):
        with open(runfolder.agent_log(str(self.dir), node), "w") as f:
            f.write(text)
        return self

    def read(self, returncodes=None, timed_out=False, interrupted=False, gone_at=None, exitcodes=None):
        ending = Ending(
            returncodes=returncodes if returncodes is not None else [0] * self.spec.nnodes,
            agent_pids=[10 + n for n in range(self.spec.nnodes)],
            wall_time=3.0,
            timed_out=timed_out,
            interrupted=interrupted,
            gone_at=gone_at or {},
            leftovers=[],
            exitcodes=exitcodes or {},
        )
        return read_result(self.spec, str(self.dir), ending)


def statuses(run):
    return [(r.status, r.exitcode) for r in run.ranks]


def test_every_rank_exited_0(tmp_path):
    folder = Folder(tmp_path).start(0, stdout="rank 0 says hi\n").start(1).exit(0).exit(1)
    runfolder.add_report(str(folder.dir), 1, "loss", 0.5)
    run = folder.read()
    assert run.ok and statuses(run) == [("ok", 0), ("ok", 0)] and run.root_cause is None
    assert run.ranks[0].stdout == "rank 0 says hi\n" and run.reports_by_rank("loss") == {0: [], 1: [0.5]}
    assert run.raise_for_status() is run and run.failed_ranks == [] and run.left_early == []


def test_an_exception_is_the_root_cause_before_the_peer_it_took_down(tmp_path):
    """Rank 0 ended first, but only because rank 1 went away: rank 1's own exception is the root cause."""
    folder = Folder(tmp_path).start(0).start(1)
    folder.exit(0, code=1, at=2.0, error=COLLATERAL)
    folder.exit(1, code=1, at=3.0, error="ValueError: rank 1 gives up", traceback='File "lesson.py", line 9')
    run = folder.read(returncodes=[1])
    assert not run.ok and statuses(run) == [("failed", 1), ("failed", 1)] and run.failed_ranks == [0, 1]
    assert run.root_cause.rank == 1 and run.root_cause.error == "ValueError: rank 1 gives up"
    assert run.root_cause.traceback == 'File "lesson.py", line 9' and run.left_early == []


def test_among_failures_of_their_own_the_earliest_is_the_root_cause(tmp_path):
    folder = Folder(tmp_path, nproc=3).start(0).start(1).start(2)
    folder.exit(0, code=1, at=5.0, error="KeyError: 'x'").exit(1, code=1, at=4.0, error="ValueError: y").exit(2)
    assert folder.read(returncodes=[1]).root_cause.rank == 1


def test_a_rank_that_left_early_is_named_when_every_failure_only_says_a_peer_went_away(tmp_path):
    folder = Folder(tmp_path, nproc=3).start(0).start(1).start(2)
    folder.exit(1, code=0, at=1.5).exit(2, code=0, at=9.0).exit(0, code=1, at=2.0, error=COLLATERAL)
    run = folder.read(returncodes=[1])
    assert run.left_early == [1] and run.root_cause.rank == 0  # rank 2 ended after the failure: not early


def test_a_rank_without_an_exit_record_takes_its_exit_code_from_torchruns_summary(tmp_path):
    """os._exit(3) leaves no record of its own: torchrun's summary says 3, a failure of its own."""
    folder = Folder(tmp_path, nproc=3).start(0).start(1).start(2).exit(0, code=1, at=2.5, error=COLLATERAL)
    folder.agent_log(summary((1, 3), (2, -signal.SIGKILL), (0, 1)))
    run = folder.read(returncodes=[1], gone_at={1: 2.0, 2: 2.2})
    assert statuses(run) == [("failed", 1), ("failed", 3), ("failed", -signal.SIGKILL)]
    assert run.ranks[1].error == "exit code 3" and run.ranks[1].end == 2.0
    assert run.ranks[2].error == "killed by SIGKILL"
    assert run.root_cause.rank == 1


def test_a_rank_torchrun_stopped_with_sigterm_reads_as_terminated_not_failed(tmp_path):
    folder = Folder(tmp_path).start(0).start(1).exit(0, code=1, at=2.0, error="ValueError: no")
    folder.agent_log(summary((0, 1), (1, -signal.SIGTERM)))
    run = folder.read(returncodes=[1])
    assert statuses(run) == [("failed", 1), ("terminated", -signal.SIGTERM)] and run.failed_ranks == [0, 1]
    assert run.root_cause.rank == 0  # a terminated rank is never the root cause


def test_a_rank_without_a_record_in_a_run_every_agent_ended_well_exited_0(tmp_path):
    run = Folder(tmp_path).start(0).start(1).exit(0).read(returncodes=[0])  # rank 1: os._exit(0)
    assert run.ok and statuses(run) == [("ok", 0), ("ok", 0)]


@pytest.mark.parametrize("how", ["timed_out", "interrupted"])
def test_ranks_still_running_at_a_timeout_or_an_interrupt(tmp_path, how):
    folder = Folder(tmp_path).start(0).start(1).exit(1, code=0, at=2.0)
    run = folder.read(returncodes=[-signal.SIGKILL], **{how: True})
    status = "hung" if how == "timed_out" else "interrupted"
    assert not run.ok and statuses(run) == [(status, None), ("ok", 0)] and run.root_cause is None


def test_a_rank_that_never_started_its_script_says_so(tmp_path):
    run = Folder(tmp_path).start(0).exit(0).read(returncodes=[1])
    assert statuses(run) == [("ok", 0), ("not started", None)] and not run.ok


def test_a_restarted_rank_is_judged_by_its_last_attempt(tmp_path):
    """torchrun --max-restarts: the exit record of attempt 0 goes when attempt 1 starts."""
    folder = Folder(tmp_path).start(0).start(1).exit(0).exit(1, code=1, error="RuntimeError: attempt 0")
    folder.start(0, at=3.0).start(1, at=3.0).exit(0, at=4.0).exit(1, at=4.0)
    run = folder.read()
    assert run.ok and statuses(run) == [("ok", 0), ("ok", 0)] and run.ranks[1].start == 3.0


def test_the_callers_view_of_exit_codes_stands_in_for_torchrun(tmp_path):
    """Where the caller forked the ranks itself (the lesson tests), its exit codes play the summary's part."""
    run = Folder(tmp_path).start(0).start(1).exit(0).read(returncodes=[1], exitcodes={0: 0, 1: 7})
    assert statuses(run) == [("ok", 0), ("failed", 7)] and run.root_cause.rank == 1


def test_two_nodes_keep_each_agents_output_apart(tmp_path):
    folder = Folder(tmp_path, nproc=1, nnodes=2).start(0).start(1).exit(0).exit(1)
    folder.agent_log("node zero\n", node=0).agent_log("node one\n", node=1)
    run = folder.read()
    assert run.world_size == 2 and run.ok
    assert run.launcher_output == (
        "--- torchrun agent for node 0 ---\nnode zero\n\n--- torchrun agent for node 1 ---\nnode one\n"
    )


def test_output_that_is_not_utf8_is_read_with_replacement_characters(tmp_path):
    folder = Folder(tmp_path).start(0).start(1).exit(0).exit(1)
    with open(runfolder.output_file(str(folder.dir), 0, "stdout"), "wb") as f:
        f.write(b"caf\xe9\n")
    assert folder.read().ranks[0].stdout == "caf\ufffd\n"
