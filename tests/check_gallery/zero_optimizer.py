"""Not a mistake: DDP with ZeroRedundancyOptimizer, whose inner optimizer on each rank holds another part
of the model. The replicas are compared on the parameters both hold; the check must find nothing."""

import torch
from _common import data, setup
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
torch.manual_seed(0)
ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
for x, y in DataLoader(data(), batch_size=8, sampler=DistributedSampler(data())):
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
