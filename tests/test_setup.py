"""lessonlib.setup (its timeout and backend, in a fresh process) and lessonlib.comma_list, the option
type lessons parse lists with."""

import datetime
import re
import subprocess
import sys
import textwrap

import pytest

import lessonlib
from lessonlib import ROOT


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


@pytest.mark.unit
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
