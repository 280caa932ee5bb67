"""Ranks that break as tests/test_faults.py asks: python faults.py MODE [options]."""

import argparse
import os
import signal
import subprocess
import sys
import time

import lessonlib
from lessonlib.processes.bounded import poll_until


def ready(name, text=""):
    """Tell the test that this rank has reached the line after which it fails or hangs."""
    path = os.path.join(os.environ["TEST_READY_DIR"], name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def wait_for(name, timeout=60):
    path = os.path.join(os.environ["TEST_READY_DIR"], name)
    poll_until(lambda: os.path.exists(path), timeout, interval=0.05, what=f"{name} to appear")


def peer_fails(rank, how):
    """Rank 1 raises or SIGKILLs itself while rank 0 waits for it in all_reduce."""
    import torch
    import torch.distributed as dist

    lessonlib.setup(device="cpu", timeout=120)  # long: rank 1's failure, not gloo's timeout, ends the wait
    if rank == 0:
        ready("rank0.ready")
        dist.all_reduce(torch.ones(1))  # FAULT-PEER-WAIT
    else:
        wait_for("rank0.ready")
        time.sleep(0.5)  # rank 0 is inside all_reduce by now
        if how == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    lessonlib.teardown()


def shapes(rank):
    import torch
    import torch.distributed as dist

    lessonlib.setup(device="cpu", timeout=5)
    dist.all_reduce(torch.ones(3 if rank == 0 else 4))
    lessonlib.teardown()


def rank0_barrier(rank):
    """The barrier only the main rank reaches, while the others go on to the next collective."""
    import torch
    import torch.distributed as dist

    lessonlib.setup(device="cpu", timeout=600)  # the launch's bound, not gloo's, must end this run
    ready(f"rank{rank}.ready")
    if rank == 0:
        dist.barrier()  # FAULT-RANK0-BARRIER
    dist.all_reduce(torch.ones(1))  # FAULT-NEXT-COLLECTIVE
    lessonlib.teardown()


def say(rank, args):
    """--lines lines that name the run (--token) and the rank, on stdout and on stderr; no process group."""
    for i in range(args.lines):
        print(f"{args.token} rank {rank} out {i}")
        print(f"{args.token} rank {rank} err {i}", file=sys.stderr)


def sleep(rank, world, args):
    """No process group: sleep, after starting a grandchild or ignoring SIGTERM if asked; or fail."""
    if rank == args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0 and args.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        ready("grandchild.pid", str(child.pid))
    ready(f"rank{rank}.ready", str(os.getpid()))
    if rank == args.fail_rank:
        for other in range(world):
            wait_for(f"rank{other}.ready")
        time.sleep(args.fail_after)
        raise RuntimeError(f"rank {rank} fails on purpose")
    time.sleep(600)  # FAULT-SLEEP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["raise", "sigkill", "shapes", "rank0-barrier", "say", "sleep"])
    parser.add_argument("--ignore-sigterm", type=int, default=-1, help="this rank ignores SIGTERM")
    parser.add_argument("--grandchild", action="store_true", help="rank 0 starts a process in a session of its own")
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank raises once every rank is ready")
    parser.add_argument("--fail-after", type=float, default=0, help="seconds --fail-rank waits, once all are ready")
    parser.add_argument("--lines", type=int, default=3)
    parser.add_argument("--token", default="")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.mode in ("raise", "sigkill"):
        peer_fails(rank, args.mode)
    elif args.mode == "shapes":
        shapes(rank)
    elif args.mode == "rank0-barrier":
        rank0_barrier(rank)
    elif args.mode == "say":
        say(rank, args)
    else:
        sleep(rank, world, args)


if __name__ == "__main__":
    main()
