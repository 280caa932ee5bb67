"""python benchmarks/collectives.py [--world-sizes 2,4] [--numel 4000000]

Chapter 2's measurements as ratios, which travel between machines better than seconds:
  busbw / memcpy   for all_reduce, all_gather and broadcast at the largest message (16 MiB), from
                   lessons/02_bandwidth.py: how close gloo gets to this machine's memory-copy ceiling;
  ring / gloo      time of the hand-built ring all-reduce (lessons/02_ring_allreduce.py) over
                   dist.all_reduce's on --numel float32 elements, best of 3.
Each is run at every --world-sizes. No threshold: this reports, it does not pass or fail.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lessonlib, installed or not

import lessonlib  # noqa: E402
from lessonlib import ROOT  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--world-sizes",
        type=lessonlib.comma_list(int, low=2, high=lessonlib.MAX_NPROC),
        default="2,4",
        help=f"comma-separated, each within 2..{lessonlib.MAX_NPROC}",
    )
    parser.add_argument("--numel", type=int, default=4_000_000)
    args = parser.parse_args()
    if args.numel < 1:
        parser.error("--numel must be at least 1")

    print(f"{'ranks':>5}  {'measure':<28}{'value':>8}")
    for n in args.world_sizes:
        run = lessonlib.launch(ROOT / "lessons/02_bandwidth.py", nproc=n, timeout=300, show="none").raise_for_status()
        memcpy = min(v["GB/s"] for _, v in run.reports("memcpy"))
        rows = [v for r, v in run.reports("bandwidth") if r == 0]
        for op in ["all_reduce", "all_gather", "broadcast"]:
            big = max((v for v in rows if v["op"] == op), key=lambda v: v["bytes"])
            print(f"{n:>5}  {op + ' busbw / memcpy':<28}{big['busbw (GB/s)'] / memcpy:>8.3f}")
        run = lessonlib.launch(
            ROOT / "lessons/02_ring_allreduce.py",
            nproc=n,
            timeout=300,
            show="none",
            args=["--numel", str(args.numel), "--lengths", "10"],
        ).raise_for_status()
        t = dict(run.reports("timing"))[0]
        ratio = t["ring_all_reduce (ms)"] / t["dist.all_reduce (ms)"]
        print(f"{n:>5}  {'ring / gloo all_reduce time':<28}{ratio:>8.3f}")


if __name__ == "__main__":
    main()
