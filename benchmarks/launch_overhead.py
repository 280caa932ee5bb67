"""python benchmarks/launch_overhead.py [--runs 7] [--no-check]

How much slower is `lessonlib.launch` than bare torchrun on the same trivial 2-rank job?

Both run benchmarks/trivial_allreduce.py (setup, one all_reduce, teardown) with 2 ranks:
  launch: lessonlib.launch(script, nproc=2, show="none")  (per-rank capture, stack dumps, leak scan)
  bare:   python -m torch.distributed.run --standalone --nproc-per-node=2 script, output to /dev/null
The two alternate (launch, bare, launch, bare, ...) so that drift in the machine's load hits both
alike, after one unmeasured warm-up of each (cold file caches would otherwise land on the first).
Prints every run, the medians and the ratio launch/bare; exits 1 if the ratio is above --max-ratio
(1.05) unless --no-check. Wall-clock timings depend on the machine: compare ratios, not seconds.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing lessonlib

import lessonlib  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "trivial_allreduce.py"
NPROC = 2
RUN_TIMEOUT = 120  # seconds; one run takes a few


def time_launch():
    t0 = time.perf_counter()
    run = lessonlib.launch(SCRIPT, nproc=NPROC, timeout=RUN_TIMEOUT, show="none")
    took = time.perf_counter() - t0
    run.raise_for_status()
    return took


def time_bare():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}", str(SCRIPT)]
    # The ranks import lessonlib as the launched ones do; PYTHONPATH is how launch provides it too.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=RUN_TIMEOUT,
    )
    took = time.perf_counter() - t0
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

    for _ in range(args.warmup):
        time_launch()
        time_bare()
    times = {"launch": [], "bare": []}
    print(f"{NPROC} ranks of {SCRIPT.relative_to(ROOT)}, {args.runs} runs each, interleaved")
    for i in range(args.runs):
        for name, timer in (("launch", time_launch), ("bare", time_bare)):
            times[name].append(timer())
            print(f"run {i + 1:2d}  {name:<6}  {times[name][-1]:.3f} s", flush=True)

    launch, bare = statistics.median(times["launch"]), statistics.median(times["bare"])
    ratio = launch / bare
    print(f"median  launch {launch:.3f} s  (min {min(times['launch']):.3f}, max {max(times['launch']):.3f})")
    print(f"median  bare   {bare:.3f} s  (min {min(times['bare']):.3f}, max {max(times['bare']):.3f})")
    print(f"ratio launch/bare = {ratio:.3f}  (overhead {launch - bare:+.3f} s; limit {args.max_ratio:g})")
    if ratio > args.max_ratio and not args.no_check:
        print(f"FAIL: lessonlib.launch is {ratio:.3f}x bare torchrun, above {args.max_ratio:g}x", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
