"""Rank 1 raises after half a second; rank 0 waits for it in a barrier (tests/test_lessons.py)."""

import time

import torch.distributed as dist

import lessonlib

ctx = lessonlib.setup(device="cpu")
print(f"rank {ctx.rank} up", flush=True)
if ctx.rank == 1:
    time.sleep(0.5)
    raise ValueError("rank 1 gives up")
dist.barrier()  # rank 0 waits here for a partner that has failed
