"""A DistributedSampler whose epoch never changes: every epoch visits the samples in the same order."""

from _common import data, model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
ddp = DDP(model())
sampler = DistributedSampler(data(), shuffle=True)
loader = DataLoader(data(), batch_size=8, sampler=sampler)
for _epoch in range(2):
    # sampler.set_epoch(_epoch) is missing here
    train(ddp, loader)
