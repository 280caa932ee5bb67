"""torchrun --nproc_per_node=2 lessons/12_startup.py

Jobs that never start: a rank that does not arrive, and a world size larger than the ranks started.

Options: --late-rank R --late S (rank R sleeps S seconds before it joins; default: nobody is late),
--claim-world-size N (pass world_size=N to init_process_group, more than torchrun started), --pg-timeout S
(default 30).

init_process_group waits until every rank of the world has joined, for at most its timeout. A rank that
arrives later than that (stuck importing, loading data, or on a node that never started) turns the wait
into an error on every rank that came in time. The error names the key it waited for in the rendezvous
store: gloo's address of a rank, and the key's last part is that rank's number.
Claiming a world size that no launch provides (a WORLD_SIZE hard-coded in a script, a tutorial's
`world_size=torch.cuda.device_count()` on a machine with fewer devices) waits in the same place.
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

import lessonlib


def join(args):
    rank = int(os.environ.get("RANK", 0))
    if rank == args.late_rank:
        print(f"rank {rank}: busy for {args.late:g} s before joining", flush=True)
        time.sleep(args.late)
    if args.claim_world_size is None:
        return lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    # [start: claim]
    dist.init_process_group(
        "gloo",
        world_size=args.claim_world_size,  # more ranks than torchrun started: nobody will fill the gap
        rank=rank,
        timeout=datetime.timedelta(seconds=args.pg_timeout),
    )
    # [end: claim]
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--late-rank", type=int, default=None, help="the rank that joins late")
    parser.add_argument("--late", type=float, default=0.0, help="how late it joins, seconds")
    parser.add_argument("--claim-world-size", type=int, default=None, help="world_size to pass to init")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="init_process_group's timeout, seconds")
    args = parser.parse_args()
    started = time.monotonic()
    ctx = join(args)
    waited = time.monotonic() - started
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    world = dist.get_world_size()
    assert total.item() == world, f"rank {dist.get_rank()}: {total.item()} ranks answered, world size {world}"
    if ctx is not None and ctx.is_main:
        print(f"all {world} rank(s) joined; rank 0 waited {waited:.2f} s in init_process_group")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
