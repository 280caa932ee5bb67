"""lessonlib: the small library the course's lessons, notebooks and tests share.

- `launch` runs a lesson under torchrun in a subprocess and shows each rank's output apart (chapter 1).
- `setup` / `teardown` join and leave the process group a lesson runs in (chapter 1).
- `report` hands values from a rank to the notebook that launched it (chapter 1).
- `show_table` and `reserve_port` are small display and networking helpers (chapter 1).

`setup`, `teardown`, `DistContext` and `report` load torch, so they are imported on first use: the
launcher itself starts (and rejects bad input) without paying for `import torch`.
"""

from .display import show_table
from .launcher import MAX_NNODES, MAX_NPROC, LaunchError, RankOutput, RunResult, launch
from .ports import reserve_port

_LAZY = ("setup", "teardown", "DistContext", "report", "pick_backend")

__all__ = ["launch", "LaunchError", "RunResult", "RankOutput", "MAX_NPROC", "MAX_NNODES",
           "show_table", "reserve_port", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        from . import dist
        return getattr(dist, name)
    raise AttributeError(f"module 'lessonlib' has no attribute {name!r}")
