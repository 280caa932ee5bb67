"""Rank 1 sends itself SIGKILL, standing in for the kernel's out-of-memory killer (which a test cannot
summon safely); rank 0 exits 0.

Used by tests/test_env_faults.py: the launcher did not send that SIGKILL, so the run's fault names it,
likely the out-of-memory killer, and how to check. Needs no process group.
"""

import os
import signal

if int(os.environ["RANK"]) == 1:
    print("rank 1 kills itself with SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
