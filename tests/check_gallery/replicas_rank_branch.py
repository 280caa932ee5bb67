"""A rank-dependent step: rank 0 alone clips its gradients, after DDP averaged them, so the replicas drift."""

import torch
from _common import data, model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
ddp = DDP(model())


def clip_on_rank_0(m):
    if rank == 0:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)


sampler = DistributedSampler(data())
train(ddp, DataLoader(data(), batch_size=8, sampler=sampler), on_step=clip_on_rank_0)
