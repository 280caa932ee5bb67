"""The FSDP2 template to copy, lessons/train_fsdp.py, run as a reader runs it: real torchrun (--standalone,
so concurrent tests never share a port) or plain `python`, real gloo, every run bounded and every process it
started killed after. Specified here, in nine training runs shared between the tests:

- it imports torch and the standard library only, never lessonlib; bad options are refused by rank 0 alone,
  before any process group starts, and --device cuda without a GPU before any group too;
- SIGTERM to a bare torchrun mid-epoch (2 ranks, bfloat16 parameters, dropout on, a cosine learning rate):
  rank 0 prints one line, "stopped at epoch E, step S; checkpoint saved at ...", no rank a traceback; the
  same command again resumes and ends with exactly, bit for bit, the weights, AdamW state and schedule of
  a run that was never stopped, and prints the same epoch line; a third run says it has nothing left to do;
- a save may take longer than --timeout, not longer than --save-timeout: rank 1 is stopped (SIGSTOP) inside
  a save, as a rank stuck on a slow file system would be, while rank 0 waits for it. Stopped 5.5 s under
  --timeout 4, the run goes on; stopped past --save-timeout 8, rank 0 ends the run within 8 s and a bit,
  with one line that says so and no traceback, and the last checkpoint stays whole;
- built on meta and loaded from a one-file state dict with broadcast_from_rank0 at 4 ranks: the peak bytes
  ranks 1 to 3 allocated while loading (torch's MemTracker on a CPU) are below the whole model's;
- --export's one file, loaded into the bare nn.Module in this process, gives the test metrics the sharded
  model printed;
- resumed at another world size (saved by 1 rank after epoch 0, resumed at 3) and trained with --accum 2,
  activation checkpointing and torch.compile (aot_eager) at 2 ranks, all with clipping, end within TOL
  of the 4-rank run: every step sees the same samples whatever the world size; dropout is off, since its
  masks are drawn per rank and cannot match, and float32 sums in another order round differently.
"""

import argparse
import ast
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lessonlib import ROOT, run_bounded
from lessonlib.processes.bounded import kill_session, marked_environment, poll_until
from lessonlib.processes.marks import marked_processes

SCRIPT = ROOT / "lessons" / "train_fsdp.py"
PYTHON, TORCHRUN = sys.executable, str(Path(sys.executable).with_name("torchrun"))
TIMEOUT = 180
SMALL = ["--samples", "480", "--width", "32", "--depth", "3"]  # 10 steps of 48 per epoch
TOL = 1e-4  # float32 AdamW, 20 steps, another world size; measured: 2.0e-6 (1 then 3 ranks), 4.7e-6 (2 ranks)
EPOCH_LINE = re.compile(r"^epoch (\d+): train loss ([\d.]+) acc ([\d.]+) \| test loss ([\d.]+) acc ([\d.]+)", re.M)
SLOW_SAVE = re.compile(
    r"^rank 0: the checkpoint save to (.+) was not done within --save-timeout (\d+) s \(waited ([\d.]+) s\): "
    r"give a slow file system a larger --save-timeout\. \(.+\)$",
    re.M,
)


def template():
    spec = importlib.util.spec_from_file_location("train_fsdp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def argv(nproc):
    return [PYTHON, SCRIPT] if nproc is None else [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", SCRIPT]


def run(args, nproc):
    """The script at `nproc` ranks under torchrun (None: plain python); its output, which must say success."""
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's torchelastic_* folder lands here, not in /tmp
        done = run_bounded([*argv(nproc), *args], TIMEOUT, cwd=ROOT, env={**os.environ, "TMPDIR": tmp})
    assert not done.timed_out, f"{args} at {nproc} ranks did not end in {TIMEOUT} s:\n{done.output}"
    assert done.returncode == 0, f"{args} at {nproc} ranks exited {done.returncode}:\n{done.output}"
    return done.output


def state(folder, tmp_path):
    """A DCP folder as one dict in this process (no process group), through torch's own converter."""
    out = tmp_path / f"{Path(folder).name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def flat(tree):
    """{dotted key: tensor} of every tensor in a nested dict."""
    if isinstance(tree, torch.Tensor):
        return {"": tree}
    if isinstance(tree, dict):
        return {f"{k}.{sub}".rstrip("."): t for k, v in tree.items() for sub, t in flat(v).items()}
    return {}


@pytest.mark.unit
def test_imports_torch_and_the_standard_library_only():
    allowed = set(sys.stdlib_module_names) | {"torch"}
    imported = set()
    for node in ast.walk(ast.parse(SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported - allowed == set() and "lessonlib" not in SCRIPT.read_text(), sorted(imported - allowed)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-size", "50"], "--batch-size 50 is the global batch: it must be a multiple of the 4 ranks"),
        (["--accum", "0"], "need --epochs, --accum, --width and --depth >= 1"),
        (["--init", "/nonexistent.pt"], "--init /nonexistent.pt: no such file"),
        (["--amp", "fp8"], None),  # rank 1: argparse's own error, not printed
    ],
)
def test_bad_options_are_refused_by_rank_0_alone_before_anything_starts(args, message):
    env = {"PATH": "/usr/bin:/bin", "WORLD_SIZE": "4", "RANK": "0" if message else "1"}
    done = run_bounded([PYTHON, SCRIPT, *args], 60, cwd=ROOT, env=env)
    assert done.returncode == 2 and "Traceback" not in done.output, done.output
    assert (message in done.output) if message else done.output == "", done.output


def test_sigterm_mid_epoch_to_torchrun_then_the_same_command_resumes_bit_exact(tmp_path):
    common = [*SMALL, "--samples", "1920", "--epochs", "2", "--amp", "bf16", "--lr-schedule", "cosine"]  # 40 steps
    whole = run([*common, "--checkpoint", tmp_path / "whole"], 2)
    stopped = [*common, "--checkpoint", tmp_path / "stopped"]
    env, mark = marked_environment({**os.environ, "TMPDIR": str(tmp_path)})
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(a) for a in [*argv(2), *stopped]], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            poll_until(
                lambda: "epoch 0:" in log.read_text() or proc.poll() is not None,
                TIMEOUT,
                0.05,
                lambda: f"epoch 0's line:\n{log.read_text()}",
            )
            assert proc.poll() is None, f"ended before epoch 0's line:\n{log.read_text()}"
            proc.send_signal(signal.SIGTERM)  # as Slurm or Kubernetes would, to the launcher: it forwards it
            proc.wait(timeout=60)
        finally:
            kill_session(proc, mark)
    text = log.read_text()
    ranks = [line for line in text.splitlines() if not line.startswith(("W", "E", "I", "Traceback", " "))]
    stops = re.findall(r"^stopped at epoch 1, step (\d+); checkpoint saved at (.+)$", text, re.M)
    assert len(stops) == 1 and 0 < int(stops[0][0]) < 40, text
    assert not any("[rank" in line for line in ranks), f"a rank printed a traceback:\n{text}"
    assert sorted(EPOCH_LINE.findall(text)) == sorted(EPOCH_LINE.findall(whole)[:1]), (text, whole)
    resumed = run(stopped, 2)
    assert f"resumed from {tmp_path / 'stopped'} at epoch 1, step {stops[0][0]}" in resumed, resumed
    assert EPOCH_LINE.findall(resumed) == EPOCH_LINE.findall(whole)[1:], (resumed, whole)  # the same train sums
    saved = {name: state(tmp_path / name, tmp_path) for name in ("whole", "stopped")}
    a, b = flat(saved["whole"]), flat(saved["stopped"])
    assert a.keys() == b.keys() and len(a) > 20, sorted(a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs from the uninterrupted one in {different}"
    schedules = [saved[name]["progress"]["lr"] for name in ("whole", "stopped")]
    assert schedules[0] == schedules[1] and schedules[0]["last_epoch"] == 80, schedules  # 2 epochs of 40 steps
    assert schedules[0]["_last_lr"] == [0.0], schedules  # cosine: down to 0 at the end
    again = run(stopped, 2)
    assert "has finished all 2 epochs: nothing to do; --epochs N > 2 trains on" in again, again
    assert not EPOCH_LINE.findall(again) and "resumed" not in again, again
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.old")), list(tmp_path.iterdir())


def left(deadline):
    """Seconds from now to `deadline` (a time.monotonic()), none if it has passed: a bound shared by waits."""
    return max(0.0, deadline - time.monotonic())


def rank_process(mark, rank, deadline):
    """torchrun's worker process for `rank`, among the processes that carry run_bounded's `mark`."""

    def found():
        for p in marked_processes(mark):
            try:
                if p.environ().get("RANK") == str(rank) and str(SCRIPT) in p.cmdline():
                    return p
            except psutil.Error:
                pass
        return None

    return poll_until(found, left(deadline), 0.1, f"rank {rank}'s process to appear")


def stop_inside_a_save(worker, folder, proc, log, deadline):
    """SIGSTOP `worker` (rank 1) while it is inside a save: FOLDER.tmp exists, so both ranks have entered
    the save, and it has no .metadata yet, so rank 0 has not ended dcp.save, whose last step (a broadcast
    from rank 0) rank 1 must receive. Rank 0 then can only wait for rank 1 on the save's group. Returns the
    time of the stop; a stop that came too late (the folder gone or complete) is undone and tried again."""
    tmp = folder.with_name(folder.name + ".tmp")

    def inside_a_save():
        return tmp.is_dir() and not (tmp / ".metadata").exists()

    def stopped_inside_a_save():
        if proc.poll() is not None:
            pytest.fail(f"rank 1 was never stopped inside a save (exit status {proc.poll()}):\n{log.read_text()}")
        if not inside_a_save():
            return None
        worker.suspend()
        poll_until(lambda: worker.status() == psutil.STATUS_STOPPED, left(deadline), 0.001, "rank 1 to stop")
        if inside_a_save():
            return time.monotonic()
        worker.resume()
        return None

    return poll_until(
        stopped_inside_a_save, left(deadline), 0.001, lambda: f"rank 1 to be stopped inside a save:\n{log.read_text()}"
    )


def test_a_save_may_outlast_timeout_but_not_save_timeout(tmp_path):
    timeout, stall, save_timeout = 4, 5.5, 8  # stall > --timeout, and --save-timeout > stall
    folder = tmp_path / "ckpt"
    args = [*SMALL, "--samples", "96", "--epochs", "20", "--checkpoint", folder]  # 2 steps and a save an epoch
    args += ["--timeout", timeout, "--save-timeout", save_timeout]
    env, mark = marked_environment({**os.environ, "TMPDIR": str(tmp_path)})
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(a) for a in [*argv(2), *args]], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        worker = None
        try:
            deadline = time.monotonic() + TIMEOUT
            worker = rank_process(mark, 1, deadline)
            stopped = stop_inside_a_save(worker, folder, proc, log, deadline)
            epochs = len(EPOCH_LINE.findall(log.read_text()))  # the line comes before the epoch's save
            time.sleep(stall - (time.monotonic() - stopped))
            worker.resume()  # rank 0 waited `stall` s on the save's group, longer than --timeout
            poll_until(  # that save is done when the next epoch's line comes
                lambda: len(EPOCH_LINE.findall(log.read_text())) != epochs or proc.poll() is not None,
                left(deadline),
                0.01,
                lambda: f"an epoch after the first stall:\n{log.read_text()}",
            )
            stopped = stop_inside_a_save(worker, folder, proc, log, deadline)  # now for good
            poll_until(
                lambda: SLOW_SAVE.search(log.read_text()),
                left(stopped + save_timeout + 30),
                0.05,
                lambda: f"rank 0's line about the slow save:\n{log.read_text()}",
            )
            took = time.monotonic() - stopped
            worker.resume()  # its own save then fails too, on rank 0's closed connection
            proc.wait(timeout=60)
        finally:
            if worker is not None:
                with contextlib.suppress(psutil.Error):
                    worker.resume()
            kill_session(proc, mark)
    text = log.read_text()
    found = SLOW_SAVE.search(text)
    assert found and found.group(1, 2) == (f"{folder}.tmp", str(save_timeout)), f"no line about the slow save:\n{text}"
    print(f"stalled {stall} s with --timeout {timeout}: went on; past --save-timeout {save_timeout}: "
          f"rank 0 gave up after {found[3]} s, its line came {took:.1f} s after the stall began")  # fmt: skip
    assert save_timeout <= float(found[3]) < save_timeout + 3 and took < save_timeout + 5, (found[3], took)
    assert proc.returncode == 1 and "[rank0]" not in text, text  # rank 0: its line, no traceback
    assert len(EPOCH_LINE.findall(text)) > epochs > 0, text  # it trained on after the first stall
    assert (folder / ".metadata").exists(), "the last complete checkpoint was lost"


def test_meta_build_broadcast_load_export_and_other_world_sizes_agree(tmp_path):
    train_fsdp = template()
    args = argparse.Namespace(width=32, depth=3, dropout=0.0)
    torch.manual_seed(1)
    bare = train_fsdp.make_model(args)
    init = tmp_path / "init.pt"
    torch.save(bare.state_dict(), init)
    common = [*SMALL, "--dropout", "0", "--epochs", "2", "--init", init, "--clip-grad-norm", "0.05"]

    at4 = run([*common, "--checkpoint", tmp_path / "at4", "--export", tmp_path / "at4.pt"], 4)
    peaks = re.search(r"peak bytes per rank while loading \[(.+)\] \(the whole model: (\d+)\)", at4)
    peak, whole = [int(p) for p in peaks[1].split(", ")], int(peaks[2])
    print(f"peak bytes while loading, per rank: {peak}; the whole model: {whole}")
    assert all(0 < p < whole for p in peak[1:]), f"ranks 1-3 held the whole model while loading: {peak} vs {whole}"

    # The exported file in the bare module, in this process: the test metrics the sharded model printed.
    exported = torch.load(tmp_path / "at4.pt", weights_only=True)
    bare.load_state_dict(exported)
    assert not torch.equal(exported["head.weight"], torch.load(init)["head.weight"]), "it did not train"
    _, test_set = train_fsdp.make_data(argparse.Namespace(seed=0, samples=480))
    with torch.no_grad():
        out = bare.eval()(test_set.tensors[0])
    loss = torch.nn.functional.cross_entropy(out, test_set.tensors[1]).item()
    acc = (out.argmax(1) == test_set.tensors[1]).float().mean().item()
    printed = EPOCH_LINE.findall(at4)[-1]
    assert (f"{loss:.4f}", f"{acc:.4f}") == printed[3:], (loss, acc, printed)

    # Saved by one process after epoch 0, resumed at 3 ranks; and 2 ranks with accumulation, checkpointed
    # activations and per-block torch.compile: all within TOL of the 4-rank run.
    run([*common, "--epochs", "1", "--checkpoint", tmp_path / "at1"], None)
    at3 = run([*common, "--checkpoint", tmp_path / "at1"], 3)
    assert "resumed from" in at3 and "at epoch 1, step 0" in at3 and [e[0] for e in EPOCH_LINE.findall(at3)] == ["1"]
    extras = ["--accum", "2", "--checkpoint-activations", "--compile", "aot_eager"]
    run([*common, *extras, "--checkpoint", tmp_path / "at2"], 2)
    ref = flat(state(tmp_path / "at4", tmp_path))
    for name in ("at1", "at2"):
        got = flat(state(tmp_path / name, tmp_path))
        assert got.keys() == ref.keys(), (name, sorted(set(got) ^ set(ref)))
        gap = max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)
        print(f"{name}: largest gap to the 4-rank run {gap:.1e}")  # shown with pytest -s
        assert gap < TOL, f"{name}: {gap} from the 4-rank run"
        assert got["progress.totals"].tolist() == [0, 0, 0] and torch.equal(
            got["optim.state.head.weight.step"], ref["optim.state.head.weight.step"]
        )


def test_device_cuda_without_a_gpu_is_refused_before_any_process_group():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    done = run_bounded([PYTHON, SCRIPT, "--device", "cuda"], 60, cwd=ROOT)
    assert done.returncode == 1 and "--device cuda: no GPU is available here; use --device cpu" in done.output
    assert "Traceback" not in done.output and "running:" not in done.output, done.output
