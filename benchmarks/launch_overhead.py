"""python benchmarks/launch_overhead.py [--runs 7] [--no-check]

How much slower is `lessonlib.launch` than bare torchrun on the same trivial 2-rank job, and how many
CPU-seconds do its forked ranks (lessonlib.launcher.fastpath.forkrank) save?

All run benchmarks/trivial_allreduce.py (setup, one all_reduce, teardown) with 2 ranks:
  launch: lessonlib.launch(script, nproc=2, show="none")  (per-rank capture, stack dumps, leak scan;
          ranks forked from the agent where lessonlib.launcher.fastpath.forkrank applies)
  fresh:  the same with LESSONLIB_FRESH_RANKS=1: every rank a fresh `python`, as torchrun starts them
  bare:   python -m torch.distributed.run --standalone --nproc-per-node=2 script, output to /dev/null
They alternate (launch, fresh, bare, launch, ...) so that drift in the machine's load hits all alike,
after one unmeasured warm-up of each (cold file caches would otherwise land on the first). Each run's
wall time and CPU-seconds (the whole machine's, from /proc/stat: run it on a quiet machine) are
printed, then the medians, the wall ratio launch/bare and the CPU ratio launch/fresh, for the job as
it is and with --step (one optimizer step, which every training lesson makes); exits 1 if
launch/bare is above --max-ratio (1.05) unless
--no-check. Timings depend on the machine: compare ratios, not seconds.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lessonlib, installed or not

import lessonlib  # noqa: E402
from lessonlib import ROOT  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "trivial_allreduce.py"
NPROC = 2
RUN_TIMEOUT = 120  # seconds; one run takes a few


def cpu_seconds():
    """CPU-seconds used so far by the whole machine (/proc/stat: every CPU's user, nice, system, irq and
    softirq time), or by this process's waited-for children where /proc/stat is missing. Machine-wide,
    because a launch's agent is forked from the launcher's agent server (lessonlib.launcher.fastpath.agentserver), whose
    children this process never waits for: run the benchmark on a quiet machine."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime


def time_launch(args=(), fresh=False):
    if fresh:
        os.environ["LESSONLIB_FRESH_RANKS"] = "1"
    try:
        t0, c0 = time.perf_counter(), cpu_seconds()
        run = lessonlib.launch(SCRIPT, nproc=NPROC, args=list(args), timeout=RUN_TIMEOUT, show="none")
        took = time.perf_counter() - t0, cpu_seconds() - c0
    finally:
        os.environ.pop("LESSONLIB_FRESH_RANKS", None)
    run.raise_for_status()
    return took


def time_fresh(args=()):
    return time_launch(args, fresh=True)


def time_bare(args=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}", str(SCRIPT)]
    cmd += list(args)
    # The ranks import lessonlib as the launched ones do; PYTHONPATH is how launch provides it too.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # torchrun without --log-dir leaves a torchelastic_* folder in the temporary folder: this run's own.
    with tempfile.TemporaryDirectory(prefix="launch-overhead-") as tmp:
        t0, c0 = time.perf_counter(), cpu_seconds()
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env={**env, "TMPDIR": tmp},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=RUN_TIMEOUT,
        )
        took = time.perf_counter() - t0, cpu_seconds() - c0
    if done.returncode != 0:
        sys.exit(f"bare torchrun failed with exit code {done.returncode}: {' '.join(cmd)}")
    return took


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--runs", type=int, default=7, help="measured runs of each (at least 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each first")
    parser.add_argument("--max-ratio", type=float, default=1.05, help="fail above this median ratio")
    parser.add_argument("--no-check", action="store_true", help="report only; always exit 0")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be at least 5: a median of fewer runs is mostly noise")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")

    timers = (("launch", time_launch), ("fresh", time_fresh), ("bare", time_bare))
    failed = False
    for job in ((), ("--step",)):
        for _ in range(args.warmup):
            for _, timer in timers:
                timer(job)
        wall, cpu = {name: [] for name, _ in timers}, {name: [] for name, _ in timers}
        print(f"{NPROC} ranks of {SCRIPT.relative_to(ROOT)} {' '.join(job)}, {args.runs} runs each, interleaved")
        for i in range(args.runs):
            for name, timer in timers:
                took, used = timer(job)
                wall[name].append(took)
                cpu[name].append(used)
                print(f"run {i + 1:2d}  {name:<6}  {took:.3f} s  {used:.2f} CPU-s", flush=True)
        med = {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name, _ in timers}
        for name, (w, c) in med.items():
            spread = f"wall min {min(wall[name]):.3f}, max {max(wall[name]):.3f}"
            print(f"median  {name:<6}  {w:.3f} s  {c:.2f} CPU-s  ({spread})")
        ratio = med["launch"][0] / med["bare"][0]
        print(f"ratio launch/bare wall = {ratio:.3f}  (limit {args.max_ratio:g})")
        print(f"ratio launch/fresh CPU = {med['launch'][1] / med['fresh'][1]:.3f}  (forked ranks over fresh ones)\n")
        if ratio > args.max_ratio and not args.no_check:
            print(f"FAIL: lessonlib.launch is {ratio:.3f}x bare torchrun, above {args.max_ratio:g}x", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
