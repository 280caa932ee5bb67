"""The ranks call the same collective with tensors of different shapes."""

import torch
import torch.distributed as dist
from _common import setup

rank, world = setup()
dist.all_reduce(torch.ones(3 + rank))  # FINDING
dist.barrier()
