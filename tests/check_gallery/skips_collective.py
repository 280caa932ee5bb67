"""Rank 1 skips an all_reduce that rank 0 waits in, and goes on with other work."""

import time

import torch
import torch.distributed as dist
from _common import setup

rank, world = setup()
dist.all_reduce(torch.ones(2))
if rank == 0:
    dist.all_reduce(torch.ones(3))  # FINDING
else:
    time.sleep(120)  # other work: it never calls the all_reduce rank 0 waits in
