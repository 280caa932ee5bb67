"""A checkpoint saved on GPU 0, loaded without map_location: every rank's copy goes to cuda:0 (on a machine
without a GPU, the load fails). The checkpoint is written as a GPU machine writes it: each tensor's storage
tagged 'cuda:0' in the file, here by the function that names the location, so no GPU is needed to make it."""

import sys

import torch
import torch.distributed as dist
import torch.serialization
from _common import model, setup

rank, world = setup()
if rank == 0:
    tag = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(model().state_dict(), sys.argv[1])
    finally:
        torch.serialization.location_tag = tag
dist.barrier()
state = torch.load(sys.argv[1], weights_only=True)  # FINDING
