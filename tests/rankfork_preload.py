"""Imported once by the lesson tests' fork server (tests/rankfork.py), before it forks any rank.

OpenMP reads OMP_NUM_THREADS when torch loads it, so the setting torchrun gives every rank must be
in place before the import; every rank forked from the server then has torch loaded already.
"""

import gc
import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402,F401

# Imported by the first optimizer or DDP step of every training lesson (1 to 4 CPU-s each), and by
# torchmetrics (chapter 9), which also pulls in torchvision and scipy: pay once, not once per rank.
import torch._dynamo  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import torch.nn.parallel  # noqa: E402,F401
import torchmetrics  # noqa: E402,F401

# What the lessons import beyond torch: torchvision's transforms (the digits pipeline) and tqdm
# (chapter 11). Third-party packages only: lessonlib is the course's own, and each rank imports what
# the lesson imports of it, as a fresh `python` would, so a lesson that forgets `import
# lessonlib.training` fails here as it fails for a reader (tests/test_lessons.py checks that).
import torchvision.transforms.v2  # noqa: E402,F401
import tqdm  # noqa: E402,F401

# Last: every object so far moves out of the garbage collector's reach, as lessonlib.launcher.fastpath.forkrank does in
# the agent. A rank's collections then never visit the server's objects, so they never write to (and
# make the rank copy) the pages those objects live on: measured, a four-rank run of a script that only
# joins and leaves the group took 2.6 CPU-seconds without this and 0.65 with it.
gc.freeze()
