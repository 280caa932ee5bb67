"""torchrun --nproc_per_node=2 lessons/01_init_methods.py

Three ways for ranks to find each other: `env://`, `tcp://HOST:PORT` and `file:///PATH`.

All three end the same way: every rank holds a key-value store, and the process group uses it to
exchange addresses. They differ in who says where the store is:
  env://   MASTER_ADDR and MASTER_PORT from the environment (torchrun sets them; its agent already
           runs the store there, so ranks connect to it);
  tcp://   an address in the URL; rank 0 listens on it, the others connect;
  file://  a file every rank can open (a shared file system across machines).
The lesson joins a group each way in turn, checks an all_reduce, and leaves it again.
Also runs as `python lessons/01_init_methods.py` (world size 1).
"""

import argparse
import contextlib
import datetime
import os
import tempfile

import torch
import torch.distributed as dist

import lessonlib

METHODS = ("env", "tcp", "file")


def agent_store(timeout):
    """A client of the store that torchrun's agent runs at MASTER_ADDR:MASTER_PORT (what env:// uses)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)


# [start: init_url]
def init_url(method, rank, world_size, timeout, stack):
    """The init_method URL for `method`; rank 0 picks what tcp:// and file:// need and shares it."""
    if method == "env":
        return "env://"
    if world_size == 1:  # nobody to tell
        value = str(stack.enter_context(lessonlib.reserve_port())) if method == "tcp" else ""
    else:
        store = agent_store(timeout)
        if rank == 0:
            value = str(stack.enter_context(lessonlib.reserve_port())) if method == "tcp" else ""
            store.set(f"lesson-{method}", value)
        value = store.get(f"lesson-{method}").decode()
    if method == "tcp":
        return f"tcp://127.0.0.1:{value}"
    # One file name that every rank derives from the id torchrun gave this run.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    return "file://" + os.path.join(tempfile.gettempdir(), f"lesson-init-{run_id}")


# [end: init_url]


def check_all_reduce(rank, world_size):
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    expected = world_size * (world_size + 1) // 2
    assert t.item() == expected, f"rank {rank}: all_reduce gave {t.item()}, expected {expected}"
    return t.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--method", choices=[*METHODS, "all"], default="all")
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    args = parser.parse_args()
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    with contextlib.ExitStack() as run:
        if "MASTER_ADDR" not in os.environ:  # plain python: give env:// a world of one and somewhere to meet
            port = run.enter_context(lessonlib.reserve_port())
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        for method in METHODS if args.method == "all" else (args.method,):
            with contextlib.ExitStack() as stack:
                url = init_url(method, rank, world_size, timeout, stack)
                kwargs = {} if method == "env" else {"rank": rank, "world_size": world_size}
                dist.init_process_group("gloo", init_method=url, timeout=timeout, **kwargs)
                total = check_all_reduce(rank, world_size)
                dist.destroy_process_group()
            print(f"rank {rank}: {method:>4}  init_method={url:<48} all_reduce -> {total}")
            lessonlib.report("init", {"method": method, "url": url, "all_reduce": total})


if __name__ == "__main__":
    main()
