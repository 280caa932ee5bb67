"""Rank 1 lowers its own soft limit of open files (RLIMIT_NOFILE) to --limit, then opens files until the
kernel refuses one: OSError "[Errno 24] Too many open files" (EMFILE). The files stay open after the script
ends, held by a module that outlives it (as a cache in an imported library would hold them), so the rank's
wrapper must still find a descriptor for its exit record. Rank 0 exits 0.

Used by tests/test_env_faults.py: the launcher names the fault with rank 1's own limits. Needs no process
group.
"""

import argparse
import os
import resource
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--limit", type=int, default=32)
args = parser.parse_args()
rank = int(os.environ["RANK"])
if rank == 1:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.limit, hard))
    held = sys.held_files = []  # outlives the script's own namespace
    while True:
        held.append(open(os.devnull))  # HELD-FILES
