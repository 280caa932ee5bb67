"""lessonlib helpers introduced in chapter 2: plot_ranks, check_function / load_function, ctx.timeout.

check_function is tested end to end: real torchrun, real gloo, the chapter's own checker lesson.
"""

import datetime
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib
import pytest

import lessonlib
from lessonlib.exercises import load_function

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "lessons" / "02_exercise_all_gather.py"


def gather_by_broadcast(tensor_list, tensor):
    for k in range(dist.get_world_size()):  # noqa: F821 - `dist` is imported by the solution file
        if dist.get_rank() == k:  # noqa: F821
            tensor_list[k].copy_(tensor)
        dist.broadcast(tensor_list[k], src=k)  # noqa: F821


def gather_in_place(tensor_list, tensor):
    for k in range(dist.get_world_size()):  # noqa: F821
        dist.broadcast(tensor, src=k)  # noqa: F821
        tensor_list[k].copy_(tensor)


def gather_with_all_gather(tensor_list, tensor):
    dist.all_gather(tensor_list, tensor)  # noqa: F821


def gather_with_all_reduce(tensor_list, tensor):
    for k in range(dist.get_world_size()):  # noqa: F821
        slot = tensor.clone() if dist.get_rank() == k else torch.zeros_like(tensor)  # noqa: F821
        dist.all_reduce(slot)  # noqa: F821 - correct result, but not built from broadcast
        tensor_list[k].copy_(slot)


def test_check_function_accepts_a_correct_solution():
    run = lessonlib.check_function(gather_by_broadcast, CHECKER, nproc=3)
    assert run.ok and all("gathers like dist.all_gather" in r.stdout for r in run.ranks)


def test_check_function_rejects_a_wrong_solution_and_says_why():
    with pytest.raises(AssertionError, match=r"tensor_list\[1\] is \[1, 1, 1\], rank 1 sent 11"):
        lessonlib.check_function(gather_in_place, CHECKER, nproc=3)


@pytest.mark.parametrize("fn", [gather_with_all_gather, gather_with_all_reduce], ids=lambda f: f.__name__)
def test_check_function_enforces_the_rules_of_the_exercise(fn):
    with pytest.raises(AssertionError, match="other collectives are off"):
        lessonlib.check_function(fn, CHECKER, nproc=2)


def test_check_function_defaults_are_what_the_chapters_want():
    """The chapters call check_function(fn, checker, nproc=n): quiet (the verdict is the result), bounded."""
    defaults = {k: p.default for k, p in inspect.signature(lessonlib.check_function).parameters.items()}
    assert (defaults["timeout"], defaults["show"]) == (120, "none"), defaults


def test_check_function_refuses_what_has_no_source_before_launching():
    with pytest.raises(TypeError, match="define it with def"):
        lessonlib.check_function(len, CHECKER)
    with pytest.raises(TypeError, match="function defined with def"):
        lessonlib.check_function(42, CHECKER)


def test_load_function_names_what_is_missing(tmp_path):
    path = tmp_path / "solution.py"
    path.write_text("def present():\n    return 7\n")
    assert load_function(str(path), "present")() == 7
    with pytest.raises(SystemExit, match="defines no function 'absent'"):
        load_function(str(path), "absent")
    with pytest.raises(SystemExit, match="no such file"):
        load_function(str(tmp_path / "nope.py"), "present")


def test_plot_ranks_draws_one_box_per_element_and_marks_empty_ranks():
    fig = lessonlib.plot_ranks(
        {"before": [[1, 2, 3], [11, 12, 13]], "after": [[1, 2, 3, 11, 12, 13], None]}, title="gather"
    )
    ax = fig.axes[0]
    assert len(ax.patches) == 3 + 3 + 6  # the None rank draws no boxes
    texts = [t.get_text() for t in ax.texts]
    assert "(nothing)" in texts and "rank 1" in texts and "13" in texts and fig._suptitle.get_text() == "gather"
    matplotlib.pyplot.close(fig)


def test_plot_ranks_wraps_panels_onto_rows_with_one_colour_scale():
    panels = {name: [[k], [k + 10]] for k, name in enumerate("abcde")}
    fig = lessonlib.plot_ranks(panels, per_row=2)
    assert len(fig.axes) == 3  # 2 + 2 + 1 panels
    assert [len(a.patches) for a in fig.axes] == [4, 4, 2]
    first, last = fig.axes[0].patches[0].get_facecolor(), fig.axes[2].patches[0].get_facecolor()
    assert first != last  # 0 and 4 differ on the shared scale (a per-row scale would give both its lowest colour)
    matplotlib.pyplot.close(fig)


def test_plot_ranks_shares_one_colour_scale_across_panels():
    fig = lessonlib.plot_ranks({"a": [[5]], "b": [[5], [9]]})
    colours = [tuple(p.get_facecolor()) for p in fig.axes[0].patches]
    assert colours[0] == colours[1] != colours[2]  # equal values, equal colours, in different panels
    matplotlib.pyplot.close(fig)


def test_setup_reports_the_timeout_it_gave_init_process_group():
    code = textwrap.dedent("""
        import datetime, lessonlib
        ctx = lessonlib.setup(timeout=7)
        assert ctx.timeout == datetime.timedelta(seconds=7), ctx.timeout
        lessonlib.teardown()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert lessonlib.DistContext.__dataclass_fields__["timeout"].default == datetime.timedelta(seconds=30)


def test_setup_for_cpu_tensors_uses_gloo_and_refuses_what_cannot_serve_them():
    code = textwrap.dedent("""
        import lessonlib
        for bad in [dict(device="cuda"), dict(device="cpu", backend="nccl")]:
            try:
                lessonlib.setup(**bad)
            except ValueError as e:
                print("refused:", e)
            else:
                raise SystemExit(f"setup({bad}) was accepted")
        ctx = lessonlib.setup(device="cpu")
        assert (ctx.backend, str(ctx.device)) == ("gloo", "cpu"), ctx
        lessonlib.teardown()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-2000:]
    assert "device must be None (pick from this machine) or 'cpu'; got 'cuda'" in out.stdout
    assert "nccl was asked for" in out.stdout


def test_comma_list_parses_and_names_what_is_wrong():
    import argparse

    ops = lessonlib.comma_list(choices=["broadcast", "reduce"])
    assert ops("broadcast, reduce,") == ["broadcast", "reduce"]
    lengths = lessonlib.comma_list(int, low=1, high=16)
    assert lengths("1,16") == [1, 16]
    for parse, text, message in [
        (ops, "broadcast,nope", "unknown ['nope']; choose from broadcast, reduce"),
        (ops, " , ", "at least one value"),
        (lengths, "3,x", "comma-separated int values"),
        (lengths, "0,17", "[0, 17] outside the allowed range 1..16"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            parse(text)


def test_a_lesson_refuses_a_bad_list_before_joining_a_group():
    out = subprocess.run(
        [sys.executable, "lessons/02_collectives.py", "--ops", "broadcast,nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "argument --ops: unknown ['nope']" in out.stderr, out.stderr
