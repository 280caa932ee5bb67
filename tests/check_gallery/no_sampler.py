"""A loader without a DistributedSampler: every rank trains on the whole dataset."""

from _common import data, model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

rank, world = setup()
ddp = DDP(model())
train(ddp, DataLoader(data(), batch_size=8, shuffle=True))
