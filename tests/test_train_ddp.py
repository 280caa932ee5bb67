"""The script to copy, lessons/train_ddp.py, and the one-process script it starts from.

Run as a reader runs them: the command the Start page gives, real torchrun (--standalone, so concurrent
tests never share a port), for the plain and the 3-rank runs; the resume tests' six 2-rank runs go through
lessonlib.launch, the same torchrun agent with each rank forked from it (lessonlib.launcher._forkrank),
which shares torch's import and runs the same script. Real gloo, every run bounded and every process it
started killed after. Specified here:

- both scripts import torch, torchvision and the standard library only, never lessonlib;
- train_ddp.py trains at 1 (plain `python`), 2 and 3 ranks and reaches the accuracy it should;
- stopped after epoch 0 and started again with the same command, it resumes from its checkpoint and
  ends with exactly the weights and optimizer state of a run that never stopped (plain and --amp);
- the Start page's middle script (train_ddp.py with the mixed-precision changes taken out,
  lessonlib.notebook.scriptdiff) is a working script whose weights equal train_ddp.py's without --amp, bit for bit;
- --data mnist reads MNIST's files from --data-dir without downloading (files in MNIST's format are
  written here), and bad options are refused before any process group starts.
"""

import ast
import json
import os
import re
import struct
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import lessonlib
from lessonlib.launcher.processes import run_bounded
from lessonlib.notebook.scriptdiff import AMP_LINES, split_changes

ROOT = Path(__file__).resolve().parents[1]
SCRIPT, ONE = ROOT / "lessons" / "train_ddp.py", ROOT / "lessons" / "train_one.py"
PYTHON, TORCHRUN = sys.executable, str(Path(sys.executable).with_name("torchrun"))
TIMEOUT = 180
EPOCH_LINE = re.compile(r"epoch (\d+): train loss [\d.]+ acc [\d.]+ \| test loss [\d.]+ acc ([\d.]+)")


def run(args, nproc=None, script=SCRIPT, timeout=TIMEOUT, forked=False):
    """The script at `nproc` ranks under torchrun (None: plain python; forked: through lessonlib.launch); its
    output, which must say success."""
    if forked:
        result = lessonlib.launch(script, nproc=nproc, args=args, timeout=timeout, show="none")
        assert result.ok, f"{script.name} {args} at {nproc} ranks failed:\n{result.describe_failure()}"
        return "".join(r.stdout + r.stderr for r in result.ranks)
    argv = [PYTHON, script] if nproc is None else [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", script]
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's torchelastic_* log folder lands here, not in /tmp
        done = run_bounded([*argv, *args], timeout, cwd=ROOT, env={**os.environ, "TMPDIR": tmp})
    assert not done.timed_out, f"{script.name} {args} at {nproc} ranks did not end in {timeout} s:\n{done.output}"
    assert done.returncode == 0, f"{script.name} {args} at {nproc} ranks exited {done.returncode}:\n{done.output}"
    return done.output


def accuracies(output):
    """{epoch: test accuracy} from the lines rank 0 printed."""
    return {int(e): float(a) for e, a in EPOCH_LINE.findall(output)}


def state_of(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(a, b):
    assert a["epoch"] == b["epoch"] and a["step"] == b["step"], (a["epoch"], a["step"], b["epoch"], b["step"])
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"weight {name} differs"
    for i, per_param in a["optimizer"]["state"].items():
        assert torch.equal(per_param["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"]), i


@pytest.mark.unit
@pytest.mark.parametrize("script", [SCRIPT, ONE], ids=lambda p: p.name)
def test_imports_torch_and_the_standard_library_only(script):
    allowed = set(sys.stdlib_module_names) | {"torch", "torchvision"}
    imported = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported - allowed == set(), f"{script.name} imports {sorted(imported - allowed)}"
    assert "lessonlib" not in script.read_text()


@pytest.mark.parametrize("nproc", [None, 3], ids=lambda n: f"{n or 1}-rank")
def test_trains_at_one_rank_and_at_an_uneven_world_size_and_only_rank_0_prints(nproc):
    """Plain `python` (a group of one) and 3 ranks (the global batch of 48 split 16 each; 2048 samples
    do not divide by 3, so the sampler pads). Two ranks are run by the resume tests below."""
    out = run(["--epochs", "2"], nproc)
    epochs = [int(e) for e, _ in EPOCH_LINE.findall(out)]
    assert epochs == [0, 1], f"rank 0 alone should print one line per epoch; the epoch lines were {epochs}"
    acc = accuracies(out)
    assert acc[1] >= 0.85, f"two epochs should reach a test accuracy of 0.85, reached {acc[1]}"


def stop_resume_and_compare(tmp_path, extra):
    """Run 1 epoch with a checkpoint, run again asking for 2 (it resumes and trains epoch 1 only), and
    run 2 epochs in one go: the two checkpoints must be equal to the bit. Returns the one-go checkpoint."""
    stopped, whole = tmp_path / "stopped.pt", tmp_path / "whole.pt"
    first = run(["--epochs", "1", "--checkpoint", stopped, *extra], 2, forked=True)
    assert [int(e) for e, _ in EPOCH_LINE.findall(first)] == [0], "rank 0 alone prints, once per epoch"
    second = run(["--epochs", "2", "--checkpoint", stopped, *extra], 2, forked=True)
    assert f"resumed from {stopped} after epoch 0 (step" in second, second
    assert sorted(accuracies(second)) == [1], "the resumed run must train epoch 1 only"
    assert accuracies(second)[1] >= 0.85, f"two epochs at 2 ranks should reach 0.85: {accuracies(second)}"
    run(["--epochs", "2", "--checkpoint", whole, *extra], 2, forked=True)
    assert_same_state(state_of(stopped), state_of(whole))
    assert not list(tmp_path.glob("*.tmp")), "the atomic save left its temporary file"
    return whole


def test_resume_with_amp_equals_a_run_that_never_stopped(tmp_path):
    assert "scaler" in state_of(stop_resume_and_compare(tmp_path, ["--amp"]))


def test_resume_equals_a_run_that_never_stopped_and_the_start_pages_middle_script_equals_train_ddp(tmp_path):
    """Without --amp. Then the Start page's middle script (train_ddp.py with the mixed-precision changes
    taken out by lessonlib.notebook.scriptdiff) is run the same way: its weights equal train_ddp.py's, bit for bit."""
    whole = stop_resume_and_compare(tmp_path, [])
    _, middle, _ = split_changes(ONE.relative_to(ROOT), SCRIPT.relative_to(ROOT))
    left = [line for line in middle.text.splitlines() if AMP_LINES.search(line)]
    assert not left, f"AMP lines left in the middle script: {left}"
    script = tmp_path / "train_ddp_no_amp.py"
    script.write_text(middle.text)
    run(["--epochs", "2", "--checkpoint", tmp_path / "middle.pt"], 2, script=script, forked=True)
    a, b = state_of(tmp_path / "middle.pt"), state_of(whole)
    assert "scaler" in b and "scaler" not in a
    assert_same_state(a, b)


def write_mnist(root, n_train, n_test):
    """Files in MNIST's own format (IDX), as torchvision.datasets.MNIST reads them from root/MNIST/raw."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        images = (labels.view(n, 1, 1) * 25 + torch.randint(0, 6, (n, 28, 28), generator=g)).to(torch.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, 28, 28) + images.numpy().tobytes()
        )
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.numpy().tobytes())


@pytest.mark.parametrize("script", [SCRIPT, ONE], ids=lambda p: p.name)
def test_mnist_from_files_on_disk_without_download(tmp_path, script):
    write_mnist(tmp_path, 96, 40)
    out = run(["--data", "mnist", "--data-dir", tmp_path, "--epochs", "1", "--samples", "48"], script=script)
    assert sorted(accuracies(out)) == [0], out


def test_mnist_missing_files_fail_with_torchvisions_message(tmp_path):
    done = run_bounded([PYTHON, SCRIPT, "--data", "mnist", "--data-dir", tmp_path, "--epochs", "1"], 60, cwd=ROOT)
    assert done.returncode != 0 and "Dataset not found" in done.output, done.output


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--epochs", "0"], "1", "need --epochs >= 1"),
        (["--timeout", "0"], "1", "--timeout > 0"),
        (["--batch-size", "50"], "4", "--batch-size 50 is the global batch: it must be a multiple of the 4 ranks"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(args, world, message):
    env = {"PATH": "/usr/bin:/bin", "WORLD_SIZE": world}
    done = run_bounded([PYTHON, SCRIPT, *args], 60, cwd=ROOT, env=env)
    assert done.returncode == 2 and message in done.output, done.output
    assert "init_process_group" not in done.output and "Traceback" not in done.output


# Code that a table names although the script has no such line, each for a stated reason.
NOT_IN_THE_SCRIPT = {
    "OMP_NUM_THREADS=1": "checklist item 17: torchrun sets it, the script does nothing",
}


def table_code(notebook, heading, column):
    """The code spans in `column` of the first Markdown table after `heading` in `notebook`."""
    cells = [c for c in json.loads((ROOT / "book" / notebook).read_text())["cells"] if c["cell_type"] == "markdown"]
    text = "\n".join("".join(c["source"]) for c in cells)
    assert heading in text, f"{notebook} has no {heading!r}"
    rows, started = [], False
    for line in text.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            started = True
            rows.append(line)
        elif started:
            break
    spans = []
    for row in rows[2:]:  # after the header and its |---| line
        spans += re.findall(r"`([^`]+)`", row.strip("|").split(" | ")[column])
    return spans


@pytest.mark.parametrize(
    "notebook, heading, column",
    [
        ("start.ipynb", "What each part is for", 0),
        ("11_end_to_end.ipynb", "### The checklist in the script to copy", 1),
    ],
    ids=["start-page", "chapter-11-checklist"],
)
@pytest.mark.unit
def test_the_tables_that_map_the_script_name_its_own_code(notebook, heading, column):
    source = SCRIPT.read_text()
    spans = table_code(notebook, heading, column)
    assert len(spans) >= 15, f"{notebook}: only {len(spans)} code spans found under {heading!r}: {spans}"
    missing = [s for s in spans if s not in source and s not in NOT_IN_THE_SCRIPT]
    assert not missing, f"{notebook} names code that lessons/train_ddp.py does not have: {missing}"
