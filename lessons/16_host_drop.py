"""torchrun --nproc_per_node=2 lessons/16_host_drop.py

A host drops off the network mid-training: what each other rank sees, and when.

Chapter 16 runs it on the hosts of a lessonlib.Hosts, with --drop-host host1 --drop-at 5: at that step,
that host's local rank 0 pulls the host's cable (`ip link set eth0 down`, in the host's own network
namespace). Without --drop-host it trains --steps steps and ends, on any machine.

Options: --steps N (default 12), --drop-at STEP (default 5), --drop-host NAME (default: none),
--step-time S (each step's work, a sleep; default 0.05), --pg-timeout S (the group's bound; default 5).

Each step all-reduces a tensor standing for the gradients. The step that fails ends the rank: it prints
and reports ("lost") the step, the error and how long its all-reduce waited, then raises. Under torchrun
with --max-restarts and --nnodes=MIN:MAX, the ranks that are started again report ("restarted") the
world size they now train in. Asserted: every completed all-reduce has the right sum; a rank that loses
its peers does so at the drop step or the one after it.
"""

import argparse
import os
import socket
import subprocess
import time

import torch
import torch.distributed as dist

import lessonlib


# [start: pull_cable]
def pull_cable():
    """Take this host's eth0 down: the host is gone for everyone else (it must be a lessonlib.Hosts host)."""
    out = subprocess.run(["ip", "link", "set", "eth0", "down"], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise SystemExit(f"{socket.gethostname()}: could not pull the cable: {out.stderr.strip()}")


# [end: pull_cable]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--drop-at", type=int, default=5)
    parser.add_argument("--drop-host", default=None)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--pg-timeout", type=float, default=5.0)
    args = parser.parse_args()
    host = socket.gethostname()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    rank, world = ctx.rank, ctx.world_size
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt:
        lessonlib.report("restarted", {"rank": rank, "world": world, "host": host, "attempt": attempt})
        print(f"rank {rank} on {host}: started again (attempt {attempt}) in a world of {world}")
    dropping = args.drop_host == host and ctx.local_rank == 0 and attempt == 0
    # [start: train]
    for step in range(args.steps):
        time.sleep(args.step_time)  # forward and backward
        if dropping and step == args.drop_at:
            pull_cable()
            print(f"rank {rank} on {host}: pulled the cable at step {step}")
        grads = torch.full((1024,), float(rank + 1))
        t0 = time.perf_counter()
        try:
            dist.all_reduce(grads)
        except Exception as e:  # gloo's error, whatever it is
            waited = time.perf_counter() - t0
            lost = {"rank": rank, "host": host, "step": step, "waited": waited, "error": f"{type(e).__name__}: {e}"}
            lessonlib.report("lost", lost)
            print(f"rank {rank} on {host}: step {step} failed after {waited:.2f} s: {lost['error'][:200]}")
            assert args.drop_host and step in (args.drop_at, args.drop_at + 1), f"rank {rank}: lost at step {step}"
            raise
        assert grads[0].item() == world * (world + 1) / 2, f"rank {rank}: step {step}: sum {grads[0].item()}"
    # [end: train]
    print(f"rank {rank} on {host}: {args.steps} steps done in a world of {world}")
    lessonlib.report("done", {"rank": rank, "world": world, "host": host})
    lessonlib.teardown()


if __name__ == "__main__":
    main()
