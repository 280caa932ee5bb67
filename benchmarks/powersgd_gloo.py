"""python benchmarks/powersgd_gloo.py --buckets 1,2,4,2u --threads 1,2,4,8 --repeats 3

Chapter 14's PowerSGD on gloo, repeated: how often lessons/14_powersgd_gloo.py trains, hangs, trains apart or aborts.

Launches the lesson at 2 ranks (lessonlib.launch, each run bounded) --repeats times for every pair of
--buckets (2u: its --buckets 2 --uneven, 3 layers and 1) and --threads (its --gloo-threads), the pairs
interleaved, and counts what happened:
  trained   every rank exited 0 (the lesson asserts the replicas' weights equal);
  aborted   a rank's stderr has gloo's "Received data size doesn't match expected size";
  hung      a rank's stderr has the lesson's watchdog ("Timeout (0:00:05)!": training stopped moving for 5 s);
  apart     the ranks trained to the end and their replicas differ (the lesson reports it, then fails);
  other     any other failure, its first line printed (the lesson's own bucket-size assert, say).
Prints one row per pair and the torch version. No threshold: this reports.
"""

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lessonlib, installed or not

import torch  # noqa: E402

import lessonlib  # noqa: E402
from lessonlib.argtypes import comma_list  # noqa: E402

RUN_TIMEOUT = 120  # seconds per launch; a run ends in under 15 s on 2 cores, its watchdog included


def outcome(run):
    """'trained', 'aborted', 'hung', 'apart' or 'other: ...' for one launch of the lesson."""
    if run.ok:
        return "trained"
    if any("Received data size doesn't match expected size" in r.stderr for r in run.ranks):
        return "aborted"  # first: the other rank, left waiting, may then meet its watchdog
    if any("Timeout (0:00:05)!" in r.stderr for r in run.ranks):
        return "hung"
    if any(value["largest gap"] > 0 for values in run.reports_by_rank("replicas").values() for value in values):
        return "apart"
    return "other: " + run.describe_failure().splitlines()[0][:120]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--buckets", type=comma_list(choices=("1", "2", "4", "2u")), default="1,2,4,2u")
    parser.add_argument("--threads", type=comma_list(int, low=1, high=32), default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pairs = [(b, t) for b in args.buckets for t in args.threads]
    counts = {pair: collections.Counter() for pair in pairs}
    for _ in range(args.repeats):
        for buckets, threads in pairs:
            uneven = ["--uneven"] if buckets == "2u" else []
            lesson_args = ["--buckets", buckets[0], *uneven, "--gloo-threads", str(threads)]
            run = lessonlib.launch(
                "lessons/14_powersgd_gloo.py", nproc=2, args=lesson_args, timeout=RUN_TIMEOUT, show="none"
            )
            counts[buckets, threads]["timed out" if run.timed_out else outcome(run)] += 1
    print(f"torch {torch.__version__}, 2 ranks, gloo, {args.repeats} runs per row")
    print(f"{'buckets':>7} {'threads':>7}  what happened")
    for (buckets, threads), seen in counts.items():
        print(f"{buckets:>7} {threads:>7}  " + ", ".join(f"{what} {n}" for what, n in sorted(seen.items())))


if __name__ == "__main__":
    main()
