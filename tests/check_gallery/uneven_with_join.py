"""Not a mistake: the uneven shards of uneven_batches.py, trained inside DDP's Join, which answers the
longer rank's gradient all-reduces for the rank that ran out. The check must find nothing here."""

import torch
import torch.distributed as dist
from _common import data, model, setup
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

rank, world = setup()
ddp = DDP(model())
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
mine = Subset(data(), range(16 * rank, 16 + 24 * rank))  # rank 0: 16 rows, rank 1: 24: uneven shards
with Join([ddp]):
    for x, y in DataLoader(mine, batch_size=8):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
dist.barrier()
