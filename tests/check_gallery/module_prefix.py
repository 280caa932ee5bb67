"""Rank 0 saves the DDP wrapper's state dict: every key starts with `module.`."""

import sys

import torch
import torch.distributed as dist
from _common import data, model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
ddp = DDP(model())
train(ddp, DataLoader(data(), batch_size=8, sampler=DistributedSampler(data())))
if rank == 0:
    torch.save({"model": ddp.state_dict(), "epoch": 1}, sys.argv[1])  # FINDING
dist.barrier()
