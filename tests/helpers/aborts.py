"""python aborts.py, at 2 ranks (tests/test_stack_folding.py): rank 1 aborts (SIGABRT) in a function of
the script; rank 0 sleeps until torchrun stops it."""

import os
import time


def give_up():
    os.abort()  # ABORTS-HERE


if os.environ["RANK"] == "1":
    give_up()
time.sleep(60)
