"""lessonlib.launcher.fastpath.forkrank: a launch's ranks are forked from the torchrun agent, torch already
imported, and each is what a fresh `python` rank would be in what it computes and prints. One helper script reports
its own process from inside both kinds of rank (LESSONLIB_FRESH_RANKS=1 asks for fresh ones), and the
reports must match, with the fork's known differences (its command line, its parent's imports) named."""

import signal

import pytest

import lessonlib
from conftest import HELPERS
from lessonlib.launcher.fastpath import forkrank

HELPER = HELPERS / "fresh_state.py"
FORKS = forkrank.wanted({})

pytestmark = pytest.mark.skipif(
    not FORKS, reason="ranks are not forked on this machine (NVIDIA devices present, or no os.fork)"
)


def launch_state(tmp_path, monkeypatch, fresh, code=0):
    folder = tmp_path / ("fresh" if fresh else "forked")
    folder.mkdir()
    monkeypatch.setenv("FRESH_STATE_DIR", str(folder))
    if fresh:
        monkeypatch.setenv(forkrank.FRESH_VAR, "1")
    else:
        monkeypatch.delenv(forkrank.FRESH_VAR, raising=False)
    run = lessonlib.launch(HELPER, nproc=2, args=[str(code)], timeout=120, show="none")
    return run, folder


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """Both kinds of run, launched from a process that ignores SIGINT, SIGHUP and SIGUSR2 (as a pytest-xdist
    worker ignores SIGINT): an ignored signal stays ignored across exec, unless torchrun's agent handles
    it (INT, HUP), and a fresh rank then starts with the default; a forked one must end up the same."""
    mp = pytest.MonkeyPatch()
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)}
    try:
        return {fresh: launch_state(tmp_path_factory.mktemp("state"), mp, fresh) for fresh in (False, True)}
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        mp.undo()


def test_a_forked_rank_starts_as_a_fresh_one_would(both):
    forked, fresh = (both[k][0] for k in (False, True))
    assert forked.ok and fresh.ok, forked.describe_failure() + fresh.describe_failure()
    for rank in range(2):
        a, b = (dict(run.reports_by_rank("state")[rank][0]) for run in (forked, fresh))
        assert a.pop("parent is the agent") and b.pop("parent is the agent")
        # The one difference chapter 1 names: `ps` shows a forked agent and its ranks with the command line
        # of the agent server they were forked from.
        assert (
            a.pop("command line") == "lessonlib.launcher.fastpath.agentserver"
            and b.pop("command line") == "lessonlib.launcher._rank_main"
        )
        assert a == b, f"rank {rank}: forked {a}\n  fresh {b}"
        assert (
            a["lessonlib modules"]
            == [
                "lessonlib.launcher",
                "lessonlib.launcher.runfolder",
                "lessonlib.processes",
                "lessonlib.processes.lifeline",
            ]
            and a["session leader"]
            and a["stdout write_through"]
        )
        assert a["torchrun variables"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
        }
        assert a["intra-op threads"] == 1 and a["inductor cache variable"] is None
        assert a["signals"]["SIGINT"] == repr(signal.default_int_handler) and a["signals"]["SIGUSR2"].endswith(
            "SIG_IGN: 1>"
        )
    assert all(forked.reports_by_rank("state")[0][0]["seeds differ across ranks"].values())


def test_a_forked_rank_ends_as_the_interpreter_would(both):
    for fresh, (run, folder) in both.items():
        for r in run.ranks:
            assert r.stdout.strip().endswith("atexit ran"), (fresh, r.stdout)
            text = (folder / f"unclosed{r.rank}.txt").read_text()
            assert text.startswith("written, never closed"), (fresh, text)


def test_the_torch_import_is_the_agents(tmp_path, monkeypatch):
    """The point of it all: a forked rank finds torch imported at its first line; a fresh one does not."""
    script = tmp_path / "first_line.py"
    script.write_text("import os, sys\nprint('torch' in sys.modules)\n")
    for fresh in (False, True):
        if fresh:
            monkeypatch.setenv(forkrank.FRESH_VAR, "1")
        run = lessonlib.launch(script, nproc=2, timeout=120, show="none").raise_for_status()
        assert [r.stdout.strip() for r in run.ranks] == [str(not fresh)] * 2


@pytest.mark.parametrize("how, expected", [("3", 3), ("text", 1), ("signal", -signal.SIGTERM)])
def test_a_forked_ranks_exit_status_reaches_torchrun_as_a_fresh_ones(tmp_path, monkeypatch, how, expected):
    script = tmp_path / "leave.py"
    script.write_text(
        "import os, signal, sys\nimport lessonlib\nctx = lessonlib.setup(device='cpu')\nlessonlib.teardown()\n"
        "how = sys.argv[1]\nif ctx.rank == 1 and how == 'signal':\n    os.kill(os.getpid(), signal.SIGTERM)\n"
        "elif ctx.rank == 1:\n    sys.exit(int(how) if how.isdigit() else how)\n"
    )
    codes = {}
    for fresh in (False, True):
        if fresh:
            monkeypatch.setenv(forkrank.FRESH_VAR, "1")
        run = lessonlib.launch(script, nproc=2, args=[how], timeout=120, show="none")
        codes[fresh] = (run.ranks[1].exitcode, run.ranks[0].exitcode, run.ranks[1].stderr.strip()[-40:])
    assert codes[False] == codes[True], codes
    assert codes[False][0] == expected and codes[False][1] == 0


def test_a_forked_ranks_first_cuda_call_fails_as_a_fresh_ones(tmp_path, monkeypatch):
    """On this machine (no NVIDIA device: ranks are forked), a rank asking for a GPU is told what a fresh
    process is told (the CUDA build's "Found no NVIDIA driver", a CPU build's "not compiled with CUDA"),
    not "Cannot re-initialize CUDA in forked subprocess": torchrun's agent asked CUDA nothing before the
    fork (torchpatches.keep_forks_cuda_free)."""
    script = tmp_path / "wants_a_gpu.py"
    script.write_text("import torch\ntorch.cuda.set_device(0)\n")
    errors = {}
    for fresh in (False, True):
        if fresh:
            monkeypatch.setenv(forkrank.FRESH_VAR, "1")
        run = lessonlib.launch(script, nproc=2, timeout=120, show="none")
        assert not run.ok
        errors[fresh] = {r.error for r in run.ranks}
    assert errors[False] == errors[True], errors
    assert not any("re-initialize" in e for e in errors[False]), errors
