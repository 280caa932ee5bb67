"""`make gpu-check`: what the course's takeaways do on real GPUs, run in one call and saved for the book.

    python -m lessonlib.gpucheck [--save FILE] [--only NAME,...] [--cpu-rehearsal] [--timeout S]

On a machine with GPUs it runs, each under torchrun (`python -m torch.distributed.run --standalone`), each
bounded: both templates (`lessons/train_ddp.py`, `lessons/train_fsdp.py`) at one GPU and at every GPU with
NCCL, with `--amp bf16` and `--amp fp16`, and stopped by SIGTERM mid-run then resumed (its checkpoint compared
with an uninterrupted run's); chapter 15's classes on CUDA (`lessons/15_on_device.py` asserts each against one
process on the same device); chapter 8's AMP lessons, whose CUDA parts run only where a GPU is. It prints
one line per case (PASS, FAIL or SKIP with the reason) and writes every case's command, exit status, time
and output, with the GPU, torch, CUDA and NCCL versions, to FILE (default book/captured/gpu_check.json),
which the chapters quote (lessonlib.notebook.gpucapture).

Without a GPU every GPU case is SKIP, with the reason, and nothing is written. `--cpu-rehearsal` runs the same
cases with `--device cpu` on 2 gloo ranks, small, so the harness itself is tested on CPU (tests/test_gpucheck.py).

It needs torch and the standard library only: a lent GPU machine has its own torch (possibly older than the
course's pin) and none of requirements.txt. Lessons that import lessonlib find it through PYTHONPATH. A case
whose script needs an API this torch lacks fails with an ImportError or AttributeError in its output: it is
reported as SKIP with that line, not as a failure of the course.
"""

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SAVE = ROOT / "book" / "captured" / "gpu_check.json"
OUTPUT_KEEP = 12_000  # characters of each case's output kept in the file: the end, where results and errors are
MISSING_API = re.compile(r"^(ImportError|ModuleNotFoundError|AttributeError): .*$", re.M)
MARK = "LESSONLIB_GPUCHECK_RUN"  # in the environment of every process of one launch
STOPPED = re.compile(r"^stopped at epoch \d+, step \d+.*$", re.M)


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    script: str  # relative to the repository root
    args: tuple = ()
    nproc: str = "one"  # "one": a single rank; "all": one rank per GPU (2 ranks in the CPU rehearsal)
    kind: str = "run"  # "run": must exit 0; "resume": stopped by SIGTERM, resumed, compared
    what: str = ""


@dataclass(kw_only=True)
class Outcome:
    name: str
    what: str
    status: str  # PASS, FAIL or SKIP
    reason: str = ""
    seconds: float = 0.0
    commands: list = field(default_factory=list)
    returncodes: list = field(default_factory=list)
    output: str = ""
    facts: dict = field(default_factory=dict)


def template_cases(script, samples):
    stem, small = Path(script).stem, ("--epochs", "2", "--samples", samples)
    return [
        Case(name=f"{stem}-1", script=script, args=small, nproc="one", what="one rank"),
        Case(name=f"{stem}-all", script=script, args=small, nproc="all", what="one rank per GPU"),
        Case(name=f"{stem}-bf16", script=script, args=(*small, "--amp", "bf16"), nproc="all", what="--amp bf16"),
        Case(name=f"{stem}-fp16", script=script, args=(*small, "--amp", "fp16"), nproc="all", what="--amp fp16"),
        Case(
            name=f"{stem}-resume",
            script=script,
            args=("--epochs", "3", "--samples", samples),  # stopped in epoch 1 or 2, however fast an epoch is
            nproc="all",
            kind="resume",
            what="SIGTERM mid-run, resumed, compared with a run that never stopped",
        ),
    ]


def cases(rehearsal):
    samples = "512" if rehearsal else "16384"
    found = [*template_cases("lessons/train_ddp.py", samples), *template_cases("lessons/train_fsdp.py", samples)]
    # The other chapter-15 lessons and 08_ddp_amp choose CPU and gloo on purpose (exact float64 timelines,
    # bytes counted through /proc): 15_on_device runs the same classes on the GPU; the three chapter-8 lessons
    # below run a CUDA part of their own when a GPU is there.
    found.append(Case(name="15_on_device", script="lessons/15_on_device.py", nproc="all", what="chapter 15 on the GPU"))
    for stem in ("autocast", "grad_scaler", "speed_memory"):
        found.append(Case(name=f"08_{stem}", script=f"lessons/08_{stem}.py", nproc="all", what="chapter 8, CUDA part"))
    return found


def about():
    """The machine and library versions the captured run came from."""
    import torch

    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "captured": datetime.date.today().isoformat(),
        "gpus": [],
        "nccl": None,
    }
    if torch.cuda.is_available():
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # a build without NCCL
            facts["nccl"] = f"unavailable: {e}"
    return facts


def command(case, nproc, device, extra=()):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    argv += [str(ROOT / case.script), *case.args, *extra]
    if Path(case.script).stem.startswith("train_"):
        argv += ["--device", device]
    return argv


def environment(tmp):
    """PYTHONPATH for the lessons that import lessonlib; torchrun's log folders in `tmp`; a mark that every
    process of the run inherits (ranks run in sessions of their own, so only the mark finds them all)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": tmp, "PYTHONUNBUFFERED": "1", MARK: uuid.uuid4().hex}


def marked(mark):
    """The pids of the processes whose environment carries MARK=mark (Linux: /proc)."""
    found, needle = [], f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                pass
    return found


def kill_run(proc, mark, grace=5.0):
    """SIGTERM to torchrun (it stops its ranks), then SIGKILL to every process of the run still there."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    for _ in range(3):
        pids = marked(mark) + ([proc.pid] if proc.poll() is None else [])
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    proc.wait()


def run(argv, timeout, env, stop_when=None, stop_after=0.0):
    """Run argv, bounded; with `stop_when` (a regex), send SIGTERM to torchrun `stop_after` seconds after a
    line matches. Returns (returncode or None on timeout, output, signalled). No process of it outlives it."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, matched = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if stop_when and re.search(stop_when, line):
                matched.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    signalled, deadline, returncode = False, time.monotonic() + timeout, None
    try:
        if stop_when:
            while proc.poll() is None and not matched.wait(0.05) and time.monotonic() < deadline:
                pass
            if matched.is_set() and proc.poll() is None:
                time.sleep(stop_after)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank, as a scheduler's would
                    signalled = True
        try:
            returncode = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            lines.append(f"\n[gpucheck] no end after {timeout} s: killed\n")
    finally:
        kill_run(proc, env[MARK])  # a timeout, an interrupt, or a rank torchrun left behind
        reader.join(10)  # every writer is gone, so the pipe has closed
    return returncode, "".join(lines), signalled


def tensors(obj, prefix=""):
    """Every tensor in a nested checkpoint (dicts, lists), by a dotted path."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}.{i}" if prefix else str(i))


def load_checkpoint(path):
    """A train_ddp checkpoint file, or a train_fsdp torch.distributed.checkpoint folder made one file."""
    import torch

    path = Path(path)
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        one = path.with_name(path.name + ".one.pt")
        dcp_to_torch_save(path, one)
        path = one
    return torch.load(path, map_location="cpu", weights_only=False)


def compare(a, b):
    """(tensors compared, names that differ, largest absolute difference) between two checkpoints."""
    left, right = dict(tensors(load_checkpoint(a))), dict(tensors(load_checkpoint(b)))
    differ, gap = [], 0.0
    for name in sorted(set(left) | set(right)):
        x, y = left.get(name), right.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            differ.append(name)
            continue
        if not x.equal(y):
            differ.append(name)
            if x.is_floating_point():
                gap = max(gap, (x.double() - y.double()).abs().max().item())
    return len(left), differ, gap


def skipped_for_api(output):
    """The line saying this torch lacks an API a script needs, or None."""
    found = [m.group(0) for m in MISSING_API.finditer(output)]
    return found[-1] if found else None


def run_case(case, nproc, device, timeout):
    started = time.monotonic()
    outcome = Outcome(name=case.name, what=case.what, status="PASS")
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        env = environment(tmp)
        if case.kind == "run":
            argv = command(case, nproc, device)
            rc, out, _ = run(argv, timeout, env)
            outcome.commands, outcome.returncodes, outcome.output = [argv], [rc], out
            must_succeed = [rc]
        else:
            must_succeed = resume_case(case, nproc, device, timeout, env, tmp, outcome)
    outcome.seconds = round(time.monotonic() - started, 1)
    out = outcome.output
    outcome.commands = [" ".join(str(a).replace(str(ROOT) + "/", "") for a in argv) for argv in outcome.commands]
    outcome.output = out[-OUTPUT_KEEP:].replace(str(ROOT) + "/", "")
    bad = [rc for rc in must_succeed if rc != 0]
    if outcome.status == "PASS" and bad:
        api = skipped_for_api(out)
        if api:
            outcome.status, outcome.reason = "SKIP", f"this torch lacks an API: {api}"
        else:
            outcome.status = "FAIL"
            outcome.reason = "timed out" if None in bad else f"exit status {bad[0]}"
    return outcome


def resume_case(case, nproc, device, timeout, env, tmp, outcome):
    """Run A to the end; run B, SIGTERM it mid-run, run B's command again to the end; compare A and B.
    Returns the exit statuses that must be 0 (the stopped run's own status is the script's to choose)."""
    whole, stopped = Path(tmp) / "whole.ckpt", Path(tmp) / "stopped.ckpt"
    outputs, must_succeed = [], []
    for ckpt, stop in ((whole, False), (stopped, True), (stopped, False)):
        argv = command(case, nproc, device, ("--checkpoint", str(ckpt)))
        # After epoch 0's line: epochs 1 and 2 are left, so the signal lands mid-run however fast an epoch is.
        rc, out, signalled = run(argv, timeout, env, stop_when=r"^epoch 0:" if stop else None, stop_after=0.05)
        outcome.commands.append(argv)
        outcome.returncodes.append(rc)
        outputs.append(f"$ {' '.join(map(str, argv))}\n{out}")
        outcome.output = "\n".join(outputs)
        if stop:
            outcome.facts["stopped run's exit status"] = rc
            if not (signalled and STOPPED.search(out)):
                outcome.status = "FAIL"
                outcome.reason = "not stopped mid-run by SIGTERM (no 'stopped at epoch' line after the signal)"
                return must_succeed
        else:
            must_succeed.append(rc)
            if rc != 0:
                return must_succeed
    count, differ, gap = compare(whole, stopped)
    outcome.facts.update({"tensors": count, "differ": len(differ), "first differing": differ[:5], "largest gap": gap})
    if differ:  # on GPUs some kernels are not deterministic: the gap says how far, the status stays honest
        outcome.status, outcome.reason = "FAIL", f"{len(differ)} of {count} tensors differ (largest gap {gap:.3g})"
    return must_succeed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", type=Path, default=DEFAULT_SAVE, help="where the captured run is written (GPU only)")
    p.add_argument("--only", default="", help="comma-separated case names or prefixes (default: every case)")
    p.add_argument("--cpu-rehearsal", action="store_true", help="run the cases on CPU with gloo, small")
    p.add_argument("--timeout", type=float, default=240, help="seconds each launch may take")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    args = p.parse_args(argv)
    all_cases = cases(args.cpu_rehearsal)
    chosen = [c for c in all_cases if not args.only or any(c.name.startswith(w) for w in args.only.split(","))]
    if not chosen:
        p.error(f"--only {args.only!r} matches no case; the cases are: {', '.join(c.name for c in all_cases)}")
    if args.timeout <= 0:
        p.error("--timeout must be > 0 seconds")
    if args.list:
        print("\n".join(f"{c.name}: {c.script} {' '.join(c.args)} ({c.what})" for c in chosen))
        return 0

    import torch

    facts = about()
    gpus = len(facts["gpus"])
    print(
        f"gpucheck: torch {facts['torch']}, CUDA {facts['cuda']}, NCCL {facts['nccl']}, GPUs: {facts['gpus'] or 'none'}"
    )
    if not gpus and not args.cpu_rehearsal:
        why = "no GPU here (torch.cuda.is_available() is False)" if not torch.cuda.is_available() else "no GPU"
        for c in chosen:
            print(f"SKIP {c.name}: {why}; run `make gpu-check` on a GPU machine")
        print(f"nothing written: {len(chosen)} case{'s' * (len(chosen) != 1)} skipped")
        return 0
    device, total = ("cpu", 2) if args.cpu_rehearsal else ("cuda", gpus)
    outcomes = []
    for c in chosen:
        nproc = 1 if c.nproc == "one" else total
        if c.nproc == "all" and nproc == 1 and any(o.name == c.name.replace("-all", "-1") for o in outcomes):
            outcomes.append(Outcome(name=c.name, what=c.what, status="SKIP", reason="one GPU: the same run as -1"))
        else:
            outcomes.append(run_case(c, nproc, device, args.timeout))
        o = outcomes[-1]
        print(f"{o.status} {o.name} ({o.seconds} s){': ' + o.reason if o.reason else ''}", flush=True)
        if o.status == "FAIL":
            print("\n".join("    " + line for line in o.output.splitlines()[-25:]), flush=True)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    if gpus and not args.cpu_rehearsal:
        facts["how"] = "make gpu-check (python -m lessonlib.gpucheck), this checkout's lessons, on this machine"
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps({"about": facts, "cases": [asdict(o) for o in outcomes]}, indent=1) + "\n")
        print(f"written: {args.save}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
