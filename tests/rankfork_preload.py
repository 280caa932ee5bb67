"""Imported once by the lesson tests' fork server (tests/rankfork.py), before it forks any rank.

OpenMP reads OMP_NUM_THREADS when torch loads it, so the setting torchrun gives every rank must be
in place before the import; every rank forked from the server then has torch loaded already.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import torch.nn.parallel  # noqa: E402,F401
