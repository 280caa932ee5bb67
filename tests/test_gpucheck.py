"""`make gpu-check` (lessonlib/gpucheck.py) and how chapters quote what it saw (lessonlib.notebook.gpucapture).

The GPU run itself needs a GPU machine; what can be checked here is the harness: without a GPU every case
is skipped with the reason and nothing is written; every case names a script that exists; a bad --only is
refused with the list of cases; a hang is ended by the bound with no process left; a failing script is
FAIL with its output; two checkpoints are compared tensor by tensor; and the CPU rehearsal (the same cases
with --device cpu on 2 gloo ranks) passes for a template stopped by a real SIGTERM and resumed, and for a
chapter-15 lesson. The capture reader labels what it shows with the GPU and versions, and says so when
there is no capture.
"""

import ast
import json
import subprocess
import sys

import pytest
import torch

from lessonlib import ROOT, gpucheck
from lessonlib.notebook import gpucapture

HELPERS = ROOT / "tests" / "helpers"


@pytest.mark.unit
def test_every_case_names_a_script_that_exists_and_a_known_width():
    for rehearsal in (False, True):
        for case in gpucheck.cases(rehearsal):
            assert (ROOT / case.script).is_file(), f"{case.name}: {case.script} does not exist"
            assert case.nproc in ("one", "all") and case.kind in ("run", "resume"), case


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the skip path is for machines without")
def test_without_a_gpu_every_case_is_skipped_with_the_reason_and_nothing_is_written(tmp_path, capsys):
    save = tmp_path / "capture.json"
    assert gpucheck.main(["--save", str(save)]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("SKIP ")]
    assert len(skipped) == len(gpucheck.cases(False)), out
    assert all("no GPU here (torch.cuda.is_available() is False)" in line for line in skipped), out
    assert not save.exists()


@pytest.mark.unit
def test_a_bad_only_is_refused_with_the_cases(capsys):
    with pytest.raises(SystemExit) as stop:
        gpucheck.main(["--only", "no_such_case"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--only 'no_such_case' matches no case" in err and "train_ddp-resume" in err, err


@pytest.mark.unit
def test_compare_finds_every_differing_tensor_and_the_largest_gap(tmp_path):
    a = {"model": {"w": torch.zeros(3), "b": torch.ones(2)}, "optimizer": {"state": {0: {"m": torch.ones(3)}}}}
    b = {
        "model": {"w": torch.tensor([0.0, 0.5, 0.0]), "b": torch.ones(2)},
        "optimizer": {"state": {0: {"m": torch.ones(3)}}},
    }
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    assert gpucheck.compare(tmp_path / "a.pt", tmp_path / "a.pt") == (3, [], 0.0)
    assert gpucheck.compare(tmp_path / "a.pt", tmp_path / "b.pt") == (3, ["model.w"], 0.5)


@pytest.mark.unit
def test_a_missing_api_is_named_not_blamed_on_the_course():
    out = "Traceback ...\nImportError: cannot import name 'fully_shard' from 'torch.distributed.fsdp'\n"
    assert (
        gpucheck.skipped_for_api(out) == "ImportError: cannot import name 'fully_shard' from 'torch.distributed.fsdp'"
    )
    assert gpucheck.skipped_for_api("ValueError: wrong\n") is None


def test_a_failing_and_a_hanging_script_are_reported_and_leave_nothing(tmp_path):
    fails = gpucheck.Case(name="fails", script="tests/helpers/rank1_fails.py", nproc="all")
    outcome = gpucheck.run_case(fails, 2, "cpu", timeout=60)
    assert outcome.status == "FAIL" and outcome.reason.startswith("exit status"), outcome
    assert "rank 1 gives up" in outcome.output
    hangs = gpucheck.Case(name="hangs", script="tests/helpers/rank1_hangs.py", nproc="all")
    outcome = gpucheck.run_case(hangs, 2, "cpu", timeout=8)
    assert outcome.status == "FAIL" and outcome.reason == "timed out", outcome
    assert 8 <= outcome.seconds < 30, outcome.seconds  # the conftest fixture checks that no process is left


def test_the_cpu_rehearsal_stops_resumes_and_compares_a_template_and_runs_a_chapter_15_lesson():
    """The reader's command line (`make gpu-check` with --cpu-rehearsal), so the Makefile target is covered."""
    done = subprocess.run(
        [
            "make",
            "-s",
            "gpu-check",
            "GPU_CHECK_ARGS=--cpu-rehearsal --only train_ddp-resume,15_on_device --timeout 120",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "PASS train_ddp-resume" in out and "PASS 15_on_device" in out, out
    assert "2 passed, 0 failed, 0 skipped" in out, out


@pytest.mark.unit
def test_the_capture_is_shown_labelled_and_its_absence_is_said(tmp_path, capsys):
    assert gpucapture.show("train_ddp", path=tmp_path / "none.json") is None
    assert "No GPU run of 'train_ddp' has been captured for this page yet" in capsys.readouterr().out
    about = {"torch": "2.11.0", "cuda": "13.0", "nccl": "2.28.9", "gpus": ["NVIDIA H200"], "captured": "2026-11-28"}
    stop = "stopped at epoch 1, step 9; checkpoint saved at x"
    output = f"running: backend nccl\nepoch 0: loss 1\nepoch 1: loss 0.5\n{stop}\n"
    case = {"name": "train_ddp-1", "what": "one rank", "status": "PASS", "reason": "", "seconds": 3.0, "output": output}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"about": about, "cases": [case, {**case, "name": "15_on_device"}]}))
    assert gpucapture.label(about) == "1 x NVIDIA H200, torch 2.11.0, CUDA 13.0, NCCL 2.28.9, captured 2026-11-28"
    (row,) = gpucapture.rows("train_ddp", gpucapture.load(path))
    assert row["lines"] == f"running: backend nccl / epoch 0: loss 1 / epoch 1: loss 0.5 / {stop}"
    assert row["result"] == "PASS" and row["case"] == "train_ddp-1"
    assert gpucapture.shown_lines("one\ntwo\n\nthree\nfour\n") == ["two", "three", "four"]  # a lesson's last lines
    assert gpucapture.show("train_ddp", path=path) is not None
    assert "make gpu-check on 1 x NVIDIA H200" in capsys.readouterr().out


@pytest.mark.unit
def test_the_harness_imports_torch_and_the_standard_library_only():
    """A lent GPU machine has its own torch and none of requirements.txt."""
    tree = ast.parse((ROOT / "lessonlib" / "gpucheck.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported - set(sys.stdlib_module_names) == {"torch"}, imported
