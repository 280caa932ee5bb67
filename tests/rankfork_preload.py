"""Imported once by the lesson tests' fork server (tests/rankfork.py), before it forks any rank.

OpenMP reads OMP_NUM_THREADS when torch loads it, so the setting torchrun gives every rank must be
in place before the import; every rank forked from the server then has torch loaded already.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import torch.nn.parallel  # noqa: E402,F401
# Imported by the first optimizer or DDP step of every training lesson (1 to 4 CPU-s each), and by
# torchmetrics (chapter 9), which also pulls in torchvision and scipy: pay once, not once per rank.
import torch._dynamo  # noqa: E402,F401
import torchmetrics  # noqa: E402,F401
# What the lessons themselves import beyond torch: lessonlib and the digits data's pipeline
# (torchvision's transforms; lessonlib.digits reads scikit-learn's data file without importing it),
# tqdm (chapter 11).
import torchvision.transforms.v2  # noqa: E402,F401
import tqdm  # noqa: E402,F401

import lessonlib  # noqa: E402,F401
import lessonlib.digits  # noqa: E402,F401
import lessonlib.exercises  # noqa: E402,F401
import lessonlib.training  # noqa: E402,F401
