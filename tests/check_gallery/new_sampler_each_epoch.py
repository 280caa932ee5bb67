"""A new DistributedSampler for every epoch, never told the epoch: each starts at epoch 0, so every epoch
visits the samples in the same order, as a sampler never given set_epoch does."""

from _common import data, model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
ddp = DDP(model())
for _epoch in range(2):
    loader = DataLoader(data(), batch_size=8, sampler=DistributedSampler(data(), shuffle=True))
    train(ddp, loader)
