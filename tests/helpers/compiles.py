"""python compiles.py CACHE_DIR, at 2 ranks (tests/test_stack_folding.py): rank 0 compiles a small function
(backend "eager", inductor's cache in CACHE_DIR), rank 1 compiles nothing; then each turns torch._dynamo's
INFO log on and exits 0. torch._dynamo's exit function logs its table of compile times at INFO, on
stderr, where it runs."""

import logging
import os
import sys

import torch
import torch._dynamo  # as a training rank's first optimizer imports it

if os.environ["RANK"] == "0":
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[1]  # not the temporary folder's torchinductor_USER
    print(torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2)).tolist())
torch._logging.set_logs(dynamo=logging.INFO)
