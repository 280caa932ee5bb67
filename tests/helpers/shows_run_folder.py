"""python shows_run_folder.py OUT, at 2 ranks (tests/test_run_decisions.py): what a real rank leaves in the run
folder, for the test that keeps its hand-written run folders the same as the real ones.

Each rank prints a line on stdout and on stderr (none ending in a newline on rank 1), reports a value, and
rank 1 then raises. As its interpreter ends (after lessonlib.launcher._rank_main has written its exit
record), each rank writes OUT/rank{r}.json: the names of the run folder's entries, its own files and its
start and exit records as they are. Rank 1 raises only once rank 0's is written, so that torchrun, stopping
the others after rank 1's failure, cannot stop rank 0 first.
"""

import atexit
import json
import os
import sys

import lessonlib
from lessonlib.launcher.runfolder import RUN_DIR_VAR
from lessonlib.processes.bounded import poll_until

rank, out = int(os.environ["RANK"]), sys.argv[1]
run_dir = os.environ[RUN_DIR_VAR]


def record(kind):
    path = os.path.join(run_dir, f"rank{rank}.{kind}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def snapshot():
    entries = sorted(os.listdir(run_dir))
    mine = [name for name in entries if name.startswith(f"rank{rank}.")]
    seen = {"entries": entries, "files": mine, "start": record("start"), "exit": record("exit")}
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(seen, f)
    os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))


atexit.register(snapshot)
end = "\n" if rank == 0 else ""
print(f"rank {rank} says hello", end=end)
print(f"rank {rank} warns", end=end, file=sys.stderr)
lessonlib.report("rank", rank)
if rank == 1:
    poll_until(lambda: os.path.exists(os.path.join(out, "rank0.json")), 60, what="rank 0's snapshot")
    raise ValueError("rank 1 fails on purpose")
