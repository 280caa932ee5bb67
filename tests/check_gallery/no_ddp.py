"""No DDP at all: each rank trains its own model, with its own starting weights."""

import torch
from _common import data, setup
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
torch.manual_seed(rank)  # a different seed per rank, and nothing that makes the weights the same
net = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
for x, y in DataLoader(data(), batch_size=8, sampler=DistributedSampler(data())):
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()  # FINDING
