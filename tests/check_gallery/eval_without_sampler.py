"""Training is sharded; evaluation is not: every rank evaluates the whole set, and the sum counts it twice."""

import torch
import torch.distributed as dist
from _common import data, model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
ddp = DDP(model())
train(ddp, DataLoader(data(), batch_size=8, sampler=DistributedSampler(data())))
sums = torch.zeros(2)
with torch.no_grad():
    for x, y in DataLoader(data(32), batch_size=8):  # FINDING
        sums += torch.tensor([torch.nn.functional.mse_loss(ddp(x), y, reduction="sum").item(), len(x)])
dist.all_reduce(sums)
print(f"validation loss {sums[0] / sums[1]:.4f} over {int(sums[1])} samples")
