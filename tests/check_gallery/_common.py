"""What every script of the gallery shares: a process group on gloo with a short timeout, a small regression
task and its model. Each script beside this one makes one mistake a reader's script commonly makes, and
tests/test_check.py checks that `python -m lessonlib check` finds it, pointing at the line marked FINDING."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset


def setup():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size()


def data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1)


def train(ddp, loader, epochs=1, on_step=None):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for _ in range(epochs):
        for x, y in loader:  # FINDING: loader
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            if on_step is not None:
                on_step(ddp)
            opt.step()  # FINDING: step


def rank():
    return int(os.environ.get("RANK", "0"))
