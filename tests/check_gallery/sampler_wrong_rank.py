"""A DistributedSampler told the wrong rank: every rank gets rank 0's shard."""

from _common import data, model, setup, train
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

rank, world = setup()
ddp = DDP(model())
sampler = DistributedSampler(data(), num_replicas=world, rank=0)  # rank=rank was meant
train(ddp, DataLoader(data(), batch_size=8, sampler=sampler))
