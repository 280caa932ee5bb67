"""torchrun --nproc_per_node=2 benchmarks/trivial_allreduce.py

The smallest real distributed job: join the group, one all_reduce, leave. What a launch costs beyond
this is the launcher's overhead, which benchmarks/launch_overhead.py measures.
"""

import torch
import torch.distributed as dist

import lessonlib


def main():
    ctx = lessonlib.setup()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size, f"rank {ctx.rank}: all_reduce gave {t.item()}, expected {ctx.world_size}"
    lessonlib.teardown()


if __name__ == "__main__":
    main()
