"""Rank 1 sleeps for ten minutes; rank 0 waits for it in a barrier (tests/test_lessons.py).

The group's own timeout is longer than that, so only the run's bound can end the wait.
"""

import time

import torch.distributed as dist

import lessonlib

ctx = lessonlib.setup(device="cpu", timeout=600)
print(f"rank {ctx.rank} up", flush=True)
if ctx.rank == 1:
    time.sleep(600)  # rank 1 never arrives
dist.barrier()
