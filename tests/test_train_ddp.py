"""The script to copy, lessons/train_ddp.py, the one-process script it starts from, and its adaptation
to another task (lessons/train_regression.py).

Run as a reader runs them: real torchrun (--standalone, so concurrent tests never share a port) where
the reader's command matters (the 3-rank run, a SIGTERM to a bare torchrun, an argument error), plain
`python` for one process; the other multi-rank runs go through lessonlib.launch, the same torchrun agent
with each rank forked from it (lessonlib.launcher.fastpath.forkrank), which shares torch's import and runs the
same script. Real gloo, every run bounded and every process it started killed after. Specified here:

- the scripts import torch, torchvision and the standard library only, never lessonlib; the adapted
  script differs from train_ddp.py inside the task block only;
- train_ddp.py trains at 1 (plain `python`), 2, 3 and 4 ranks, and rank 0 says at start what runs;
- a SIGTERM to a bare torchrun mid-epoch stops it with one line and a mid-epoch checkpoint, and the same
  command resumes to exactly the weights, optimizer and scheduler state (and the same epoch line) of a
  run that never stopped, with dropout on; the same after a stop at an epoch's end, under --amp fp16
  with clipping (the GradScaler's state); a SIGINT to plain `python` does the same for the adapted script;
- --accum 2 with clipping and a cosine schedule at 4 ranks equals one process with the same global
  batch, within float32's rounding;
- a checkpoint save slower than --timeout succeeds; one slower than --save-timeout fails within a
  bound, saying so (the file system is made slow for real: a named pipe drained late);
- the Start page's middle script (train_ddp.py with the mixed-precision changes taken out,
  lessonlib.notebook.scriptdiff) is a working script whose weights equal train_ddp.py's, bit for bit;
- a finished run says it has nothing to do; bad options are refused before any process group starts,
  said once (by rank 0 under torchrun); --device's choice, including too few GPUs, is a clear error;
- --data mnist reads MNIST's files from --data-dir without downloading (files in MNIST's format are
  written here).
"""

import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import signal
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import lessonlib
from lessonlib import ROOT, run_bounded, started
from lessonlib.notebook.scriptdiff import AMP_LINES, read, split_changes
from lessonlib.processes.bounded import poll_until

SCRIPT, ONE = ROOT / "lessons" / "train_ddp.py", ROOT / "lessons" / "train_one.py"
REGRESSION = ROOT / "lessons" / "train_regression.py"
PYTHON, TORCHRUN = sys.executable, str(Path(sys.executable).with_name("torchrun"))
TIMEOUT = 180
EPOCH_LINE = re.compile(r"epoch (\d+): train loss [\d.]+ acc [\d.]+ \| test loss [\d.]+ acc ([\d.]+)")


def run(args, nproc=None, script=SCRIPT, timeout=TIMEOUT, forked=False, ok=True):
    """The script at `nproc` ranks under torchrun (None: plain python; forked: through lessonlib.launch); its
    output, which must say success (with ok=False: (output, exit status), whatever it was)."""
    if forked:
        result = lessonlib.launch(script, nproc=nproc, args=args, timeout=timeout, show="none")
        assert result.ok or not ok, f"{script.name} {args} at {nproc} ranks failed:\n{result.describe_failure()}"
        out = "".join(r.stdout + r.stderr for r in result.ranks)
        return out if ok else (out, result)
    argv = [PYTHON, script] if nproc is None else [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", script]
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's torchelastic_* log folder lands here, not in /tmp
        done = run_bounded([*argv, *args], timeout, cwd=ROOT, env={**os.environ, "TMPDIR": tmp})
    assert not done.timed_out, f"{script.name} {args} at {nproc} ranks did not end in {timeout} s:\n{done.output}"
    if not ok:
        return done.output, done.returncode
    assert done.returncode == 0, f"{script.name} {args} at {nproc} ranks exited {done.returncode}:\n{done.output}"
    return done.output


def accuracies(output):
    """{epoch: test accuracy} from the lines rank 0 printed."""
    return {int(e): float(a) for e, a in EPOCH_LINE.findall(output)}


def epoch_lines(output):
    """{epoch: its line without the seconds}: a resumed epoch must print what an uninterrupted one did."""
    return {int(m[1]): m[2] for m in re.finditer(r"^epoch (\d+): (.*) \| [\d.]+ s$", output, re.M)}


def state_of(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(a, b, tol=0.0):
    """Weights, optimizer and scheduler state equal (to the bit unless `tol`), and the same position."""
    assert (a["epoch"], a["batch"], a["step"]) == (b["epoch"], b["batch"], b["step"])
    close = (lambda x, y: torch.equal(x, y)) if tol == 0 else (lambda x, y: torch.allclose(x, y, rtol=0, atol=tol))
    for name, tensor in a["model"].items():
        assert close(tensor, b["model"][name]), f"weight {name} differs by {(tensor - b['model'][name]).abs().max()}"
    for i, per_param in a["optimizer"]["state"].items():
        assert close(per_param["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"]), i
    assert a["scheduler"] == b["scheduler"], (a["scheduler"], b["scheduler"])


def script_imports(script):
    imported = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    return imported


@pytest.mark.unit
@pytest.mark.parametrize("script", [SCRIPT, ONE, REGRESSION], ids=lambda p: p.name)
def test_imports_torch_and_the_standard_library_only(script):
    allowed = set(sys.stdlib_module_names) | {"torch", "torchvision"}
    assert script_imports(script) - allowed == set(), (
        f"{script.name} imports {sorted(script_imports(script) - allowed)}"
    )
    assert "lessonlib" not in script.read_text()


def outside_the_task(script):
    """The script without its docstring and without the task block, which must be there exactly once."""
    text = read(script.relative_to(ROOT)).text
    assert text.count("# [start: task]") == 1 and text.count("# [end: task]") == 1, script.name
    before, rest = text.split("# [start: task]")
    return before + rest.split("# [end: task]")[1]


@pytest.mark.unit
def test_the_adapted_script_changes_the_task_block_only():
    assert outside_the_task(REGRESSION) == outside_the_task(SCRIPT), "train_regression.py changed more than its task"
    assert outside_the_task(ONE) != outside_the_task(SCRIPT)  # the check can tell two scripts apart


@pytest.mark.unit
def test_the_device_choice_never_falls_back_in_silence():
    spec = importlib.util.spec_from_file_location("train_ddp_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: main() runs under __main__
    pick = module.pick_device
    assert pick("auto", 0, 1, 2) == (torch.device("cpu"), "gloo")
    assert pick("cpu", 8, 1, 2) == (torch.device("cpu"), "gloo")
    assert pick("auto", 2, 1, 2) == (torch.device("cuda", 1), "nccl")
    with pytest.raises(ValueError, match=r"4 ranks on this machine but 2 GPUs: .*--device cpu"):
        pick("auto", 2, 3, 4)
    with pytest.raises(ValueError, match="--device cuda, but torch sees no GPU"):
        pick("cuda", 0, 0, 1)


@pytest.mark.parametrize("nproc", [None, 3], ids=lambda n: f"{n or 1}-rank")
def test_trains_at_one_rank_and_at_an_uneven_world_size_and_only_rank_0_prints(nproc):
    """Plain `python` (a group of one) and 3 ranks under bfloat16 autocast, evaluation included (the global
    batch of 48 split 16 each; 2048 samples do not divide by 3, so the sampler pads). Two ranks are run
    by the resume tests below, four by the accumulation test."""
    out = run(["--epochs", "2", *(["--amp", "bf16"] if nproc else [])], nproc)
    epochs = [int(e) for e, _ in EPOCH_LINE.findall(out)]
    assert epochs == [0, 1], f"rank 0 alone should print one line per epoch; the epoch lines were {epochs}"
    acc = accuracies(out)
    assert acc[1] >= 0.85, f"two epochs should reach a test accuracy of 0.85, reached {acc[1]}"
    n = nproc or 1
    said = f"running: backend gloo, device cpu, world size {n}, global batch 48 = {n} x {48 // n} per rank"
    assert out.count("running:") == 1 and said in out, out
    assert f"amp {'bf16' if nproc else 'off'}" in out, out


WHOLE_ARGS = ["--epochs", "3", "--lr-schedule", "cosine"]  # 42 steps an epoch


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """Three epochs at 2 ranks that nobody stops: (its output, its checkpoint)."""
    path = tmp_path_factory.mktemp("whole") / "whole.pt"
    return run([*WHOLE_ARGS, "--checkpoint", path], 2, forked=True), path


def test_sigterm_to_torchrun_mid_epoch_stops_in_one_line_and_resumes_bit_exact(tmp_path, whole):
    """A SIGTERM to a bare torchrun (as a scheduler preempts) once epoch 0 is done: torchrun forwards it to
    both ranks, which stop after the same step of epoch 1, save, and say so once. The same command then
    resumes and ends where the run that never stopped ended, to the bit, printing the same epoch lines."""
    whole_out, whole_ckpt = whole
    ckpt = tmp_path / "ckpt.pt"
    argv = [TORCHRUN, "--standalone", "--nproc_per_node=2", SCRIPT, *WHOLE_ARGS, "--checkpoint", ckpt]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # torchrun's log folder lands here
    with started(argv, TIMEOUT, cwd=ROOT, env=env) as job:
        job.poll_until(lambda: "epoch 0:" in job.output(), timeout=TIMEOUT)
        os.kill(job.proc.pid, signal.SIGTERM)
        job.proc.wait(timeout=60)
        out = job.output()
    # torchrun itself exits 1 after a signal, with its own SignalException traceback (torch 2.14.1).
    assert job.proc.returncode == 1 and "SignalException" in out, out
    stops = re.findall(r"^stopped at epoch (\d+), step (\d+) \(SIGTERM\); checkpoint saved at (.*)$", out, re.M)
    # Epoch 1 as a rule; epoch 2 if this machine held torchrun back for a whole epoch (about 0.5 s).
    assert len(stops) == 1 and stops[0][0] in ("1", "2") and stops[0][2] == str(ckpt), out
    assert "Traceback" not in out.split("Received 15 death signal")[0], "a rank printed a traceback"
    assert not list(tmp_path.glob("*.tmp")), "the atomic save left its temporary file"
    stopped = state_of(ckpt)
    epoch = stopped["epoch"]
    assert str(epoch) == stops[0][0] and 0 < stopped["batch"] < 42, "the stop should fall inside an epoch"
    again = run([*WHOLE_ARGS, "--checkpoint", ckpt], 2, forked=True)
    assert f"resumed from {ckpt} at epoch {epoch}, batch {stopped['batch']} (step {stops[0][1]})" in again, again
    assert_same_state(state_of(ckpt), state_of(whole_ckpt))
    assert epoch_lines(again) == {e: epoch_lines(whole_out)[e] for e in range(epoch, 3)}, (again, whole_out)
    assert accuracies(again)[2] >= 0.85, again
    done, status = run([*WHOLE_ARGS, "--checkpoint", ckpt], ok=False)  # plain python: the job is finished
    assert status == 0 and f"{ckpt} has finished all 3 epochs: nothing to do (to train more, raise --epochs)" in done


def test_the_start_pages_middle_script_equals_train_ddp_without_amp(tmp_path, whole):
    """The Start page's middle script (train_ddp.py with the mixed-precision changes taken out by
    lessonlib.notebook.scriptdiff) runs as train_ddp.py does, to the same weights, bit for bit."""
    _, middle, _ = split_changes(ONE.relative_to(ROOT), SCRIPT.relative_to(ROOT))
    left = [line for line in middle.text.splitlines() if AMP_LINES.search(line)]
    assert not left, f"AMP lines left in the middle script: {left}"
    script = tmp_path / "train_ddp_no_amp.py"
    script.write_text(middle.text)
    run([*WHOLE_ARGS, "--checkpoint", tmp_path / "middle.pt"], 2, script=script, forked=True)
    a, b = state_of(tmp_path / "middle.pt"), state_of(whole[1])
    assert "scaler" in b and "scaler" not in a
    assert_same_state(a, b)


def test_resume_after_an_epoch_under_fp16_with_clipping_equals_a_run_that_never_stopped(tmp_path):
    """float16 autocast on the CPU: the GradScaler scales, is unscaled before clipping, and its state is in
    the checkpoint; stopped by --epochs 1 and run again with --epochs 2, it ends where one run of 2 ends."""
    extra = ["--amp", "fp16", "--clip-grad-norm", "1", "--samples", "480"]
    stopped, whole_ckpt = tmp_path / "stopped.pt", tmp_path / "whole.pt"
    run(["--epochs", "1", "--checkpoint", stopped, *extra], 2, forked=True)
    second = run(["--epochs", "2", "--checkpoint", stopped, *extra], 2, forked=True)
    assert f"resumed from {stopped} at epoch 1, batch 0" in second and sorted(accuracies(second)) == [1], second
    # Clipping the still-scaled float16 gradient (without scaler.unscale_) shrinks every step by the scale,
    # 65536: the model stays at chance, a test accuracy of 0.10 here (seen with that line taken out).
    assert accuracies(second)[1] >= 0.4, f"fp16 with clipping did not learn: {second}"
    run(["--epochs", "2", "--checkpoint", whole_ckpt, *extra], 2, forked=True)
    a, b = state_of(stopped), state_of(whole_ckpt)
    assert_same_state(a, b)
    # The scaler counts its steps without an overflow: a resumed run that lost its state would count 10.
    assert a["scaler"] == b["scaler"] and a["scaler"]["_growth_tracker"] == a["step"] == 20, a["scaler"]


def test_accumulation_clipping_and_a_schedule_at_4_ranks_equal_one_process(tmp_path):
    """4 ranks x 2 micro-batches of 6 (no_sync on the first) against one process with the whole batch of 48,
    with clipping and a cosine schedule: the same weights within float32's rounding. Dropout and the
    augmentation are off, since a rank draws its own random numbers; the checkpoints compare the rest."""
    common = ["--epochs", "2", "--samples", "192", "--clip-grad-norm", "0.5", "--lr-schedule", "cosine"]
    common += ["--dropout", "0", "--shift", "0"]
    four = run([*common, "--accum", "2", "--checkpoint", tmp_path / "four.pt"], 4, forked=True)
    assert "world size 4, global batch 48 = 4 x 12 per rank, in 2 micro-batch(es) of 6" in four, four
    one = run([*common, "--checkpoint", tmp_path / "one.pt"])
    assert_same_state(state_of(tmp_path / "four.pt"), state_of(tmp_path / "one.pt"), tol=1e-5)
    a, b = epoch_lines(four), epoch_lines(one)
    assert a.keys() == b.keys() == {0, 1}, (four, one)


def drain_later(fifo, delay, deadline=120):
    """Open the named pipe `fifo` for reading after `delay` seconds and read it to the end, in a thread:
    until then a writer blocks, as on a file system that stalls. Returns the thread, the bytes it read,
    and an Event that ends it early (no writer is coming)."""
    got, enough = bytearray(), threading.Event()

    def drain():
        time.sleep(delay)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # never blocks, even if no writer ever comes

        def drained():  # reads all there is now; true once the writer closed it, or none will come
            while True:
                try:
                    chunk = os.read(fd, 1 << 20)
                except BlockingIOError:
                    return False  # the writer has more to come
                if chunk == b"":
                    return bool(got) or enough.is_set()
                got.extend(chunk)

        try:
            with contextlib.suppress(TimeoutError):  # the test then finds the bytes missing
                poll_until(drained, deadline, 0.02)
        finally:
            os.close(fd)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return thread, got, enough


@pytest.mark.parametrize("save_timeout, ok", [(30, True), (2, False)], ids=["within", "beyond"])
def test_a_slow_save_has_its_own_bound(tmp_path, save_timeout, ok):
    """Rank 0's save takes 7 s (its temporary file is a named pipe that nobody reads for 7 s), longer than
    --timeout 4: with --save-timeout 30 the run ends well; with --save-timeout 2 it fails within a few
    seconds of that bound, saying what to raise."""
    ckpt = tmp_path / "ckpt.pt"
    os.mkfifo(tmp_path / "ckpt.pt.tmp")
    thread, got, enough = drain_later(tmp_path / "ckpt.pt.tmp", 7)
    args = ["--epochs", "1", "--samples", "96", "--timeout", "4", "--save-timeout", save_timeout, "--checkpoint", ckpt]
    t0 = time.monotonic()
    out, result = run(args, 2, forked=True, ok=False)
    took = time.monotonic() - t0
    enough.set()
    thread.join(timeout=30)
    if ok:
        assert result.ok, result.describe_failure()
        assert torch.load(io.BytesIO(bytes(got)), weights_only=True)["epoch"] == 1, "the save did not go through"
    else:
        assert not result.ok and took < 30, f"the failure took {took:.1f} s:\n{out}"
        assert "the save of" in out and "was not done within --save-timeout 2 s" in out, out
        assert "larger --save-timeout" in out, out


def test_the_adapted_script_trains_and_resumes_bit_exact_after_ctrl_c(tmp_path):
    """train_regression.py as plain `python`, SIGINT (a terminal's Ctrl-C) once it has started: one line,
    exit status 130, and the same command ends where a run that never stopped ends, dropout included."""
    args = ["--epochs", "2", "--samples", "12000", "--checkpoint"]  # 250 steps an epoch, about 0.2 s quiet
    with started([PYTHON, REGRESSION, *args, tmp_path / "a.pt"], TIMEOUT, cwd=ROOT) as job:
        job.poll_until(lambda: "running:" in job.output(), timeout=TIMEOUT)  # polled every 0.1 s
        os.kill(job.proc.pid, signal.SIGINT)
        job.proc.wait(timeout=60)
        out = job.output()
    assert job.proc.returncode == 130, out
    assert re.search(r"^stopped at epoch [01], step \d+ \(SIGINT\); checkpoint saved at", out, re.M), out
    assert len(out.strip().splitlines()) <= 4 and "Traceback" not in out, out
    resumed = run([*args, tmp_path / "a.pt"], script=REGRESSION)
    whole_out = run([*args, tmp_path / "b.pt"], script=REGRESSION)
    assert_same_state(state_of(tmp_path / "a.pt"), state_of(tmp_path / "b.pt"))
    mse = [float(m) for m in re.findall(r"test mse ([\d.]+)", whole_out)]
    assert len(mse) == 2 and mse[1] < 0.7 * mse[0], f"the test MSE should fall by 30% in 2 epochs: {mse}"
    assert epoch_lines(resumed).items() <= epoch_lines(whole_out).items(), (resumed, whole_out)


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


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cuda is not an error")


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--epochs", "0"], "1", "need --epochs >= 1"),
        (["--save-timeout", "0"], "1", "--save-timeout > 0"),
        (
            ["--batch-size", "50"],
            "4",
            "--batch-size 50 is the global batch: it must be a multiple of 4 ranks x --accum",
        ),
        pytest.param(["--device", "cuda"], "1", "--device cuda, but torch sees no GPU", marks=NO_GPU),
    ],
)
def test_bad_options_are_refused_before_anything_starts(args, world, message):
    env = {"PATH": "/usr/bin:/bin", "WORLD_SIZE": world}
    done = run_bounded([PYTHON, SCRIPT, *args], 60, cwd=ROOT, env=env)
    assert done.returncode == 2 and message in done.output, done.output
    assert "init_process_group" not in done.output and "Traceback" not in done.output


def test_an_argument_error_under_torchrun_is_said_once(tmp_path):
    """Every rank refuses, rank 0 alone says why; what follows is torchrun's own report of the exit status 2."""
    out, status = run(["--batch-size", "47"], 2, ok=False)
    assert status != 0 and out.count("error: --batch-size 47 is the global batch") == 1, out
    assert out.count("usage: train_ddp.py") == 1 and "exitcode  : 2" in out, out
    assert "init_process_group" not in out, out


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
