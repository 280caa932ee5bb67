"""torchrun --nproc_per_node=2 lessons/01_launch.py

What torchrun hands each process, and a first collective that proves they found each other.

Each rank reads the variables torchrun set, checks that they fit together (every rank distinct,
RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK, one MASTER_ADDR:MASTER_PORT for all), then runs
--steps rounds of all_reduce whose result it checks against a closed form.
Also runs as `python lessons/01_launch.py` (world size 1).

Two failures can be switched on, to see how they look (chapter 1, "When a rank fails"):
  --fail-rank R    rank R raises an exception just before the last all_reduce;
  --stall-rank R   rank R sleeps --stall-seconds instead of joining it, so the others wait in the
                   collective until the process-group timeout (--pg-timeout) turns the wait into an error.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import lessonlib

TORCHRUN_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]


# [start: read_env]
def read_env():
    """The variables torchrun sets for this process (None where unset, e.g. under plain python)."""
    env = {k: os.environ.get(k) for k in [*TORCHRUN_VARS, "OMP_NUM_THREADS"]}
    env["PID"] = os.getpid()
    env["PPID"] = os.getppid()  # under torchrun: the torchrun agent of this node
    return env


# [end: read_env]


# [start: check_env]
def check_env(ctx, env, everyone):
    """Assert that what each rank was told fits together; `everyone` is every rank's env."""
    ranks = sorted(int(e["RANK"] or 0) for e in everyone)
    assert ranks == list(range(ctx.world_size)), f"rank {ctx.rank}: ranks {ranks} are not 0..{ctx.world_size - 1}"
    assert len({e["PID"] for e in everyone}) == ctx.world_size, "two ranks share a process"
    if ctx.launched:
        assert {e["WORLD_SIZE"] for e in everyone} == {str(ctx.world_size)}, "ranks disagree on WORLD_SIZE"
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in everyone}) == 1, "ranks disagree on the master"
        assert 0 <= ctx.local_rank < ctx.local_world_size, f"rank {ctx.rank}: LOCAL_RANK out of range"
        expected = ctx.group_rank * ctx.local_world_size + ctx.local_rank
        assert ctx.rank == expected, f"rank {ctx.rank}: GROUP_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK = {expected}"
    # The names are upper case: os.environ["local_rank"] (as some tutorials write) is a KeyError.
    assert "local_rank" not in os.environ, "lower-case local_rank is set: something non-standard launched this"
    # Ranks on one node (same GROUP_RANK) share a parent: that node's torchrun agent.
    by_node = {}
    for e in everyone:
        by_node.setdefault(e["GROUP_RANK"], set()).add(e["PPID"])
    assert all(len(parents) == 1 for parents in by_node.values()), f"one node, several agents: {by_node}"


# [end: check_env]


def all_reduce_rounds(ctx, steps, fail_rank, stall_rank, stall_seconds):
    n = ctx.world_size
    for step in range(steps):
        last = step == steps - 1
        if last and ctx.rank == fail_rank:
            raise RuntimeError(f"rank {ctx.rank}: failing on purpose before all_reduce (--fail-rank)")
        if last and ctx.rank == stall_rank:
            print(f"rank {ctx.rank}: busy for {stall_seconds:g} s instead of joining all_reduce", flush=True)
            time.sleep(stall_seconds)
        t = torch.tensor([ctx.rank + step], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(t)  # SUM over ranks of (rank + step) = n(n-1)/2 + n*step
        expected = n * (n - 1) // 2 + n * step
        assert t.item() == expected, f"rank {ctx.rank} step {step}: all_reduce gave {t.item()}, expected {expected}"
        print(f"rank {ctx.rank}: step {step} all_reduce = {t.item()} (expected {expected})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=2, help="rounds of all_reduce")
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank raises before the last round")
    parser.add_argument("--stall-rank", type=int, default=-1, help="this rank sleeps instead of the last round")
    parser.add_argument("--stall-seconds", type=float, default=60.0)
    parser.add_argument("--pg-timeout", type=float, default=None, help="process-group timeout, seconds")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    ctx = lessonlib.setup(timeout=args.pg_timeout)
    env = read_env()
    print(f"rank {ctx.rank}: " + " ".join(f"{k}={env[k]}" for k in TORCHRUN_VARS) + f" pid={env['PID']}")
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, env)
    check_env(ctx, env, everyone)
    lessonlib.report("env", env)

    all_reduce_rounds(ctx, args.steps, args.fail_rank, args.stall_rank, args.stall_seconds)
    if ctx.is_main:
        print(f"all {ctx.world_size} ranks agree: {args.steps} all_reduce rounds checked, backend {ctx.backend}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
