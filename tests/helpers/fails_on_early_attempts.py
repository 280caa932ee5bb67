"""torchrun --max-restarts=N ... fails_on_early_attempts.py ATTEMPTS: rank 1 raises on each attempt
before attempt ATTEMPTS (counting from 0); every rank prints its attempt (tests/test_launcher.py)."""

import os
import sys

import lessonlib

fail_attempts = int(sys.argv[1])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ctx = lessonlib.setup(device="cpu", timeout=10)
print(f"rank {ctx.rank} attempt {attempt}")
if ctx.rank == 1 and attempt < fail_attempts:
    raise RuntimeError(f"rank 1 fails on attempt {attempt}")
lessonlib.teardown()
