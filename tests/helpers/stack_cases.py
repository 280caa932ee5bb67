"""python stack_cases.py READY_DIR, at 3 ranks (tests/test_stack_folding.py): the stacks of a failed run.

Rank 0 ends its script (exit 0) and lingers in an atexit function of its own; rank 1 waits in a
function of the script; once both are there, rank 2 fails inside torch (a Linear given a tensor of the
wrong shape, six frames deep), and torchrun stops ranks 0 and 1 (SIGTERM)."""

import atexit
import os
import sys
import time

import torch

rank = int(os.environ["RANK"])
ready = sys.argv[1]


def mark(name):
    open(os.path.join(ready, name), "w").close()


def linger():
    mark("rank0.exiting")
    time.sleep(60)  # LINGERS-HERE


def wait_here():
    mark("rank1.waiting")
    time.sleep(60)  # STOPPED-HERE


if rank == 0:
    atexit.register(linger)
elif rank == 1:
    wait_here()
else:
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(ready, name)) for name in ("rank0.exiting", "rank1.waiting")):
        assert time.monotonic() < deadline, "ranks 0 and 1 never got there"
        time.sleep(0.05)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model(torch.zeros(3))  # RAISES-HERE
