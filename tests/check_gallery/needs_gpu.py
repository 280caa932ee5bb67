"""A script that only runs on GPUs: NCCL, and a GPU per rank."""

import os

import torch
import torch.distributed as dist

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
