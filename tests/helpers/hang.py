"""Ranks that never finish: rank 1 sleeps, the others wait for it in a barrier; rank 0 first starts a
grandchild process in a session of its own, which must die with the run.

Each rank writes TEST_READY_DIR/rank<N>.ready just before it hangs (rank 0 also writes the grandchild's
pid to TEST_READY_DIR/grandchild.pid), so a test knows when the run is really stuck.
The two lines where ranks hang carry marker comments, which the tests look for in the ranks' stack dumps.
"""

import os
import subprocess
import sys
import time

import torch.distributed as dist

import lessonlib


def mark_ready(ready_dir, name, text=""):
    tmp = os.path.join(ready_dir, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(ready_dir, name))


def main():
    ready_dir = os.environ["TEST_READY_DIR"]
    ctx = lessonlib.setup(timeout=600)  # the launcher's timeout must end this run, not gloo's
    if ctx.rank == 0:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        mark_ready(ready_dir, "grandchild.pid", str(child.pid))
    mark_ready(ready_dir, f"rank{ctx.rank}.ready", str(os.getpid()))
    print(f"rank {ctx.rank}: hanging", flush=True)
    if ctx.rank == 1:
        time.sleep(600)  # HANG-SLEEP
    dist.barrier()  # HANG-BARRIER


if __name__ == "__main__":
    main()
