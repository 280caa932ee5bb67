"""Rank 1 exits 0 right after joining, while rank 0 still calls a collective (tests/test_launcher.py)."""

import sys

import torch
import torch.distributed as dist

import lessonlib

ctx = lessonlib.setup(device="cpu", timeout=20)
if ctx.rank == 1:
    sys.exit(0)  # leaves cleanly while rank 0 still calls a collective
dist.all_reduce(torch.ones(1))
