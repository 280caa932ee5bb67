"""A failed run's stacks show the lesson: its own frames, the first and the innermost frame of what it called
into, and one line for every other frame (lessonlib.view.tracebacks.fold); the stored stderr stays whole.

Unit tests on text samples (a traceback, a chained one, a faulthandler dump of several threads, the terminal
view fed in pieces), then real runs, with ranks forked from the agent and fresh (LESSONLIB_FRESH_RANKS=1):
the views of a run whose ranks failed inside torch, were stopped in the script, and were stopped on their
way out; a rank that aborts; torchrun's failure report; and torch._dynamo's exit function in forked ranks.
"""

import os
import re
import textwrap
import threading

import pytest

import lessonlib
from conftest import HELPERS, line_of
from lessonlib import ROOT, RankOutput, RunResult
from lessonlib.launcher.fastpath import forkrank
from lessonlib.view import live, tracebacks

SITE = "/opt/reader/venv/lib/python3.11/site-packages"  # another machine's environment: any prefix goes
LIB = f"{ROOT}/lessonlib"
THREADING = threading.__file__  # the standard library's, as this interpreter has it
FOLD = re.compile(r"^\s*\.\.\. (\d+) frames in (.+) internals \(every frame: (\S+)\)$")

# A lesson's traceback through torch: three frames of its own, six of torch's (first and innermost shown).
TRACEBACK = f"""\
Traceback (most recent call last):
  File "lessons/demo.py", line 30, in <module>
    main()
  File "lessons/demo.py", line 25, in main
    step(model)
  File "lessons/demo.py", line 12, in step
    model(torch.zeros(3))  # wrong shape
    ^^^^^^^^^^^^^^^^^^^^^
  File "{SITE}/torch/nn/modules/module.py", line 1783, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{SITE}/torch/nn/modules/module.py", line 1794, in _call_impl
    return forward_call(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{SITE}/torch/nn/modules/container.py", line 259, in forward
    input = module(input)
            ^^^^^^^^^^^^^
  File "{SITE}/torch/nn/modules/module.py", line 1783, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
  File "{SITE}/torch/nn/modules/module.py", line 1794, in _call_impl
    return forward_call(*args, **kwargs)
  File "{SITE}/torch/nn/modules/linear.py", line 134, in forward
    return F.linear(input, self.weight, self.bias)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x3 and 2x2)
"""

# A forked rank's stack when torchrun stopped it: where the lesson was, inside torch, then everything below
# the lesson (runpy, the rank wrapper, the fork, torchrun's agent, the agent server); and a second thread.
DUMP = f"""\
Thread 0x00007f0000000001 (most recent call first):
  File "{THREADING}", line 324 in wait
  File "{THREADING}", line 622 in wait
  File "{SITE}/torch/utils/data/_utils/pin_memory.py", line 50 in _pin_memory_loop
  File "{THREADING}", line 975 in run

Current thread 0x00007f0000000002 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "lessons/demo.py", line 74 in all_reduce_rounds
  File "lessons/demo.py", line 99 in main
  File "lessons/demo.py", line 106 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 291 in run_path
  File "{LIB}/launcher/_rank_main.py", line 56 in _run_script
  File "{LIB}/launcher/fastpath/forkrank.py", line 246 in _run
  File "{SITE}/torch/distributed/run.py", line 1142 in <module>
  File "{LIB}/launcher/fastpath/agentserver.py", line 392 in <module>
  File "<frozen runpy>", line 198 in _run_module_as_main
"""


def shown_lines(items, where="run.ranks[1].stderr"):
    return [item.line(where) if isinstance(item, tracebacks.Fold) else item for item in items]


# --------------------------------------------------------------------------- folding, on text


@pytest.mark.unit
def test_a_traceback_keeps_the_lessons_frames_and_the_ends_of_what_it_called():
    items = tracebacks.fold(TRACEBACK.splitlines(), "traceback")
    shown = shown_lines(items)
    assert (
        shown
        == [
            *TRACEBACK.splitlines()[:11],  # the heading, the lesson's three frames, torch's first
            "  ... 4 frames in torch internals (every frame: run.ranks[1].stderr)",
            *TRACEBACK.splitlines()[-4:],  # torch's innermost frame, the error
        ]
    ), "\n".join(shown)
    [folded] = [item for item in items if isinstance(item, tracebacks.Fold)]
    assert folded.frames == 4 and folded.lines == tuple(TRACEBACK.splitlines()[11:-4])  # every line, kept
    assert "container.py" in "\n".join(folded.lines)


@pytest.mark.unit
def test_a_stack_dump_folds_each_threads_internals():
    """Innermost first: the lesson's frames and torch's two (the collective where it blocks, the wrapper the
    lesson called) stay; the 7 frames below the lesson fold into one line; a thread with no frame of the
    reader's keeps its innermost one."""
    shown = shown_lines(tracebacks.fold(DUMP.splitlines(), "stack"))
    assert shown == [
        "Thread 0x00007f0000000001 (most recent call first):",
        f'  File "{THREADING}", line 324 in wait',
        "  ... 3 frames in torch and Python internals (every frame: run.ranks[1].stderr)",
        "",
        "Current thread 0x00007f0000000002 (most recent call first):",
        *DUMP.splitlines()[7:12],
        "  ... 7 frames in lessonlib, torch and Python internals (every frame: run.ranks[1].stderr)",
    ], "\n".join(shown)


@pytest.mark.unit
def test_what_needs_no_folding_is_left_as_written():
    own = 'Traceback (most recent call last):\n  File "lessons/a.py", line 3, in <module>\n    f()\nKeyError: 1'
    assert tracebacks.folded_text(own, "x") == own.splitlines()
    # One library frame between the lesson and the innermost: shown, not folded into a line of its own.
    three = TRACEBACK.splitlines()[:14] + TRACEBACK.splitlines()[-4:]
    assert shown_lines(tracebacks.fold(three, "traceback")) == three
    text = "a warning\nrank 0: step 1\n"
    assert tracebacks.folded_text(text, "x") == text.splitlines()


@pytest.mark.unit
def test_chained_tracebacks_and_text_around_them_are_each_folded():
    chained = TRACEBACK.replace("RuntimeError: mat1", "ValueError: mat1")
    chained += "\nDuring handling of the above exception, another exception occurred:\n\n" + TRACEBACK
    text = "before\n" + chained + "after\n" + DUMP
    shown = tracebacks.folded_text(text, "run.ranks[3].stderr")
    folds = [FOLD.match(line) for line in shown if FOLD.match(line)]
    assert [(int(m[1]), m[2], m[3]) for m in folds] == [
        (4, "torch", "run.ranks[3].stderr"),
        (4, "torch", "run.ranks[3].stderr"),
        (3, "torch and Python", "run.ranks[3].stderr"),
        (7, "lessonlib, torch and Python", "run.ranks[3].stderr"),
    ], "\n".join(shown)
    assert shown[0] == "before" and "after" in shown and shown.count('  File "lessons/demo.py", line 12, in step') == 2


@pytest.mark.unit
def test_the_views_fold_while_the_result_keeps_every_frame():
    stderr = "a warning first\n" + DUMP
    run = RunResult(
        script="lessons/demo.py",
        args=[],
        nproc=2,
        nnodes=1,
        ranks=[
            RankOutput(0, stderr=TRACEBACK, exitcode=1, status="failed", error=TRACEBACK.splitlines()[-1]),
            RankOutput(1, stderr=stderr, exitcode=-15, status="terminated", error="killed by SIGTERM"),
        ],
        launcher_output="",
        returncodes=[1],
        wall_time=3.0,
        timeout=60.0,
    )
    for name, text in {"str": str(run), "story": run.describe_failure()}.items():
        assert "forkrank.py" not in text and "agentserver.py" not in text and "container.py" not in text, name
        assert "... 7 frames in lessonlib, torch and Python internals (every frame: run.ranks[1].stderr)" in text
        assert "... 4 frames in torch internals (every frame: run.ranks[0].stderr)" in text, name
        assert 'File "lessons/demo.py", line 74 in all_reduce_rounds' in text, name
    page = run._repr_html_()
    folds = re.findall(r"<details class=\"lessonlib-fold\"[^>]*>(.*?)</details>", page, re.S)
    assert len(folds) == 3, page
    assert not re.search(r'<details class="lessonlib-fold"[^>]* open', page)
    summary, frames = re.match(r"<summary[^>]*>(.*?)</summary>(.*)", folds[2], re.S).groups()
    assert summary.strip().startswith("... 7 frames in lessonlib, torch and Python internals")
    assert "lessonlib/launcher/fastpath/forkrank.py" in frames and "torch/distributed/run.py" in frames
    assert "site-packages" not in page  # short paths inside the folds too
    assert run.ranks[1].stderr == stderr and run.ranks[0].stderr == TRACEBACK  # the result is whole


@pytest.mark.unit
def test_the_terminal_view_holds_a_traceback_until_it_ends_then_folds_it(capsys):
    view = live.TextLiveView("lessons/demo.py", [], 2, 1)
    lines = TRACEBACK.splitlines()
    view.lines(0, "stderr", ["a warning", *lines[:10]])  # a traceback, cut in the middle of a frame
    assert capsys.readouterr().err == "[rank 0] a warning\n"
    view.lines(0, "stderr", lines[10:])
    assert capsys.readouterr().err == "", "printed before it had ended"
    view.lines(0, "stderr", ["rank 0: the next line"])
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "[rank 0] rank 0: the next line"
    assert "[rank 0]   ... 4 frames in torch internals (every frame: run.ranks[0].stderr)" in err
    assert len(err) == len(lines) - 10 + 1 + 1, err  # 4 frames, 10 lines, folded into 1
    # A stack with nothing after it: printed once nothing has come for HOLD_QUIET seconds, or at the end.
    view.tick(1.0)
    view.lines(1, "stderr", DUMP.splitlines())
    view.tick(1.0 + live.HOLD_QUIET / 2)
    assert capsys.readouterr().err == ""
    view.tick(1.0 + live.HOLD_QUIET)
    assert "[rank 1]   ... 7 frames in lessonlib, torch and Python internals" in capsys.readouterr().err
    view.lines(1, "stderr", lines)
    every = live.TextLiveView("lessons/demo.py", [], 2, 1, every_frame=None)
    every.lines(1, "stderr", lines)
    assert len(capsys.readouterr().err.splitlines()) == len(lines)  # --all-frames: as it came, at once
    view.finish(
        RunResult(
            script="lessons/demo.py",
            args=[],
            nproc=2,
            nnodes=1,
            ranks=[],
            launcher_output="",
            returncodes=[1],
            wall_time=1.0,
            timeout=60.0,
        )
    )
    out = capsys.readouterr()
    assert "[rank 1]   ... 4 frames in torch internals (every frame: run.ranks[1].stderr)" in out.err
    assert out.out.startswith("[lessonlib] ")


# --------------------------------------------------------------------------- real runs, forked and fresh

BOTH = pytest.mark.parametrize(
    "fresh",
    [pytest.param(False, id="forked"), pytest.param(True, id="fresh")],
)


def launch(monkeypatch, fresh, script, nproc, args=()):
    if fresh:
        monkeypatch.setenv(forkrank.FRESH_VAR, "1")
    else:
        monkeypatch.delenv(forkrank.FRESH_VAR, raising=False)
    return lessonlib.launch(script, nproc=nproc, args=list(args), timeout=120, show="none")


def forks():
    return forkrank.wanted({})


@pytest.mark.timeout(240)
@BOTH
def test_a_failed_runs_stacks_show_the_lesson_and_fold_the_rest(tmp_path, monkeypatch, fresh):
    """Rank 2 fails inside torch, rank 1 is stopped in the script, rank 0 after its script ended. Every view
    shows the script's frames and torch's first and innermost, one line for the rest; torchrun's report
    names the script; rank 0 prints no stack; no rank shows torch._dynamo's exit function."""
    if not fresh and not forks():
        pytest.skip("ranks are not forked on this machine (NVIDIA devices present, or no os.fork)")
    script = HELPERS / "stack_cases.py"
    run = launch(monkeypatch, fresh, script, 3, [str(tmp_path)])
    story, text, page = run.describe_failure(), str(run), run._repr_html_()
    assert sorted(os.listdir(tmp_path)) == ["rank0.exiting", "rank1.waiting"], story
    assert run.root_cause is not None and run.root_cause.rank == 2, story
    for r in run.ranks:
        assert "tabulate" not in r.stderr and "dump_compile_times" not in r.stderr, f"rank {r.rank}:\n{r.stderr}"
    # Rank 0 was stopped on its way out (its own atexit function): not where its script was, no stack.
    assert "most recent call first" not in run.ranks[0].stderr, run.ranks[0].stderr

    # Rank 1's stack: stored whole, shown as the script's two frames and one line for the rest.
    stored = run.ranks[1].stderr
    assert "lessonlib/launcher/_rank_main.py" in stored and ("forkrank.py" in stored) == (not fresh), stored
    below = len(tracebacks.frames(stored)) - 2
    stopped = line_of(script, "STOPPED-HERE")
    for name, view in {"str(run)": text, "describe_failure": story}.items():
        assert f'stack_cases.py", line {stopped} in wait_here' in view, f"{name}:\n{view}"
        folds = [FOLD.match(line.split("] ", 1)[-1]) for line in view.splitlines()]
        said = {(m[3], int(m[1])) for m in folds if m}
        assert ("run.ranks[1].stderr", below) in said, f"{name} does not fold rank 1's {below} frames:\n{view}"
        assert "_rank_main.py" not in view and "forkrank.py" not in view, f"{name}:\n{view}"

    # Rank 2's traceback: the script's frames, torch's first (Module._wrapped_call_impl) and innermost
    # (Linear.forward), the four between them folded.
    raises = line_of(script, "RAISES-HERE")
    trace = text[text.index("--- rank 2") :]
    assert f'stack_cases.py", line {raises}, in <module>' in trace, trace
    assert re.search(r'torch/nn/modules/module\.py", line \d+, in _wrapped_call_impl', trace), trace
    assert re.search(r'torch/nn/modules/linear\.py", line \d+, in forward', trace), trace
    assert "... 4 frames in torch internals (every frame: run.ranks[2].stderr)" in trace, trace
    assert "container.py" not in trace and "container.py" in run.ranks[2].stderr

    # The HTML view: each fold a closed <details> holding its frames.
    folds = re.findall(
        r'<details class="lessonlib-fold"[^>]*>\s*<summary[^>]*>(.*?)</summary>(.*?)</details>', page, re.S
    )
    assert any("run.ranks[1].stderr" in summary and "_rank_main.py" in frames for summary, frames in folds), page
    assert any("run.ranks[2].stderr" in summary and "container.py" in frames for summary, frames in folds), page
    assert not re.search(r'<details class="lessonlib-fold"[^>]* open', page)

    # torchrun's own report names the script the reader ran, not the rank wrapper.
    assert f"{run.script} FAILED" in run.launcher_output, run.launcher_output[-2000:]
    assert "lessonlib.launcher._rank_main FAILED" not in run.launcher_output


@pytest.mark.timeout(240)
@BOTH
def test_a_rank_that_aborts_prints_its_stack(monkeypatch, fresh):
    """SIGABRT in the script: faulthandler prints the stack, forked rank or fresh (torchrun's @record turns
    faulthandler on in the agent; a forked rank must not take that for its own)."""
    if not fresh and not forks():
        pytest.skip("ranks are not forked on this machine (NVIDIA devices present, or no os.fork)")
    script = HELPERS / "aborts.py"
    run = launch(monkeypatch, fresh, script, 2)
    rank = run.ranks[1]
    assert rank.error == "killed by SIGABRT" and run.root_cause is rank, run.describe_failure()
    assert "Fatal Python error: Aborted" in rank.stderr, f"no stack printed:\n{rank.stderr}"
    aborts = line_of(script, "ABORTS-HERE")
    assert f'aborts.py", line {aborts} in give_up' in rank.stderr, rank.stderr
    shown = str(run)
    assert f'aborts.py", line {aborts} in give_up' in shown and "run.ranks[1].stderr)" in shown, shown
    assert re.search(
        rf"rank 1 \(root cause\): killed by SIGABRT \(exit -6\); at \S*aborts\.py:{aborts} in give_up", shown
    )


@pytest.mark.timeout(180)
def test_dynamos_exit_function_runs_in_a_forked_rank_only_where_something_compiled(tmp_path, monkeypatch):
    """Forked ranks inherit torch._dynamo's exit function from the agent: it logs its table of compile
    times (at INFO, turned on here) in the rank that compiled, and not in the one that did not."""
    if not forks():
        pytest.skip("ranks are not forked on this machine (NVIDIA devices present, or no os.fork)")
    run = launch(monkeypatch, False, HELPERS / "compiles.py", 2, [str(tmp_path)]).raise_for_status()
    said = ["TorchDynamo compilation metrics" in r.stderr for r in run.ranks]
    assert said == [True, False], textwrap.indent("\n".join(r.stderr for r in run.ranks), "  ")
