"""Shards of different lengths, split by hand: rank 1 gets one batch more than rank 0, so its last DDP
backward waits for a gradient all-reduce that rank 0, done with its loop, never joins."""

import time

import torch
import torch.distributed as dist
from _common import data, model, setup
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

rank, world = setup()
ddp = DDP(model())
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
mine = Subset(data(), range(16 * rank, 16 + 24 * rank))  # rank 0: 16 rows, rank 1: 24: uneven shards
for x, y in DataLoader(mine, batch_size=8):
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()  # FINDING
    opt.step()
time.sleep(60)  # rank 0 goes on with other work (a long evaluation, say)
dist.barrier()
