"""Every rank writes the same checkpoint file."""

import sys

import torch
import torch.distributed as dist
from _common import data, model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
ddp = DDP(model())
train(ddp, DataLoader(data(), batch_size=8, sampler=DistributedSampler(data())))
torch.save(ddp.module.state_dict(), sys.argv[1])  # FINDING
dist.barrier()
