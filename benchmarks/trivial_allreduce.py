"""torchrun --nproc_per_node=2 benchmarks/trivial_allreduce.py

Options: --step also makes one optimizer step.

The smallest real distributed job: join the group, one all_reduce, leave. What a launch costs beyond
this is the launcher's overhead, which benchmarks/launch_overhead.py measures.
"""

import sys

import torch
import torch.distributed as dist

import lessonlib


def main():
    ctx = lessonlib.setup()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size, f"rank {ctx.rank}: all_reduce gave {t.item()}, expected {ctx.world_size}"
    if "--step" in sys.argv[1:]:  # one optimizer step, as every training lesson makes (it imports torch._dynamo)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    lessonlib.teardown()


if __name__ == "__main__":
    main()
