"""The torchrun agent as `lessonlib.launch` starts it: torch.distributed.run (or the deprecated
torch.distributed.launch, with --legacy), but one that exits when the launcher does (chapter 1)."""

import os
import runpy
import signal
import sys

from lessonlib._lifeline import die_with_parent
from lessonlib._runfolder import LAUNCHER_PID_VAR

if __name__ == "__main__":
    die_with_parent(signal.SIGTERM, int(os.environ[LAUNCHER_PID_VAR]))
    module = "torch.distributed.run"
    if sys.argv[1:2] == ["--legacy"]:
        module = "torch.distributed.launch"
        del sys.argv[1]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
