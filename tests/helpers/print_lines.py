"""Each rank prints --lines numbered lines to stdout and to stderr, then reports how many it printed.

Used by tests/test_launcher.py to check that the launcher keeps every rank's streams apart and in order.
Needs no process group: what is under test is the capture, not the collectives.
"""

import argparse
import os
import sys

import lessonlib


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=20)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    out, err = sys.stdout, sys.stderr
    for i in range(args.lines):
        out.write(f"rank {rank} out {i}\n")
        err.write(f"rank {rank} err {i}\n")
    # Characters that HTML must escape, so the tests can check the rendered view.
    print(f'rank {rank} says <b>&"bold"</b>')
    lessonlib.report("printed", {"rank": rank, "lines": args.lines})


if __name__ == "__main__":
    main()
