"""python fails_in_torch.py READY_DIR, at 4 ranks (tests/test_display.py): rank 0 fails inside torch.load
once ranks 2 and 3 have exited 0 having printed nothing; rank 1 sleeps until torchrun stops it."""

import os
import sys
import time

rank = int(os.environ["RANK"])
ready = sys.argv[1]
if rank >= 2:  # says nothing, exits 0, and lets rank 0 know
    open(os.path.join(ready, f"rank{rank}.done"), "w").close()
elif rank == 1:
    print("rank 1: waiting", flush=True)
    time.sleep(120)  # STOPPED-HERE
else:
    from lessonlib.processes.bounded import poll_until

    done = [os.path.join(ready, f"rank{r}.done") for r in (2, 3)]
    poll_until(lambda: all(map(os.path.exists, done)), 60, interval=0.05, what="ranks 2 and 3 to finish")
    time.sleep(1)  # their exit records too
    import torch

    print("rank 0: loading", flush=True)
    torch.load(os.path.join(ready, "missing.pt"))  # RAISES-HERE
