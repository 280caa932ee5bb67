"""Weights loaded on rank 0 after DDP was built: DDP broadcast rank 0's weights at construction, not after."""

import torch
from _common import data, model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
ddp = DDP(model())
if rank == 0:
    with torch.no_grad():
        ddp.module.weight.add_(1.0)  # "resume": only rank 0 read the checkpoint, after wrapping
train(ddp, DataLoader(data(), batch_size=8, sampler=DistributedSampler(data())))
