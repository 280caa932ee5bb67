"""torchrun --nproc_per_node=2 lessons/01_legacy_launch.py

How a script learns its local rank, under torchrun and under the deprecated torch.distributed.launch.

  python -m torch.distributed.launch --nproc_per_node=2 lessons/01_legacy_launch.py
passes `--local-rank=N` as the script's first argument (older releases spelled it `--local_rank`)
unless given `--use-env` (`--use_env`); torchrun never passes it and only sets LOCAL_RANK in the
environment. Today both launchers set LOCAL_RANK, so reading the environment works under either;
a script that requires the argument breaks under torchrun. This script accepts both spellings of the
argument and checks that, when present, it agrees with the environment.
Also runs as `python lessons/01_legacy_launch.py` (world size 1).
"""

import argparse
import os

import lessonlib


# [start: local_rank]
def local_rank_sources(argv_value):
    """Where this process's local rank came from: the command line, the environment, or both."""
    env_value = os.environ.get("LOCAL_RANK")
    env_value = int(env_value) if env_value is not None else None
    if argv_value is not None and env_value is not None:
        assert argv_value == env_value, f"--local-rank={argv_value} but LOCAL_RANK={env_value}"
    return {"argv": argv_value, "env": env_value, "used": env_value if env_value is not None else argv_value or 0}


# [end: local_rank]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    # Both spellings: torch.distributed.launch passed --local_rank before torch 2.0, --local-rank since.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank")
    parser.add_argument("--expect-argv", action="store_true", help="fail unless --local-rank was passed")
    args = parser.parse_args()
    ctx = lessonlib.setup()
    sources = local_rank_sources(args.local_rank)
    assert sources["used"] == ctx.local_rank, f"rank {ctx.rank}: local rank {sources['used']} != {ctx.local_rank}"
    if args.expect_argv:
        assert args.local_rank is not None, f"rank {ctx.rank}: no --local-rank argument was passed"
    print(f"rank {ctx.rank}: --local-rank argument = {sources['argv']}, LOCAL_RANK env = {sources['env']}")
    lessonlib.report("local_rank", sources)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
