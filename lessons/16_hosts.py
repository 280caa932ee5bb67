"""torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 lessons/16_hosts.py

One job on several hosts: where each rank runs, which address its gloo listens on, and one all-reduce.

Run it on each host with the same command (HOST0: the first host's address or name), or from a notebook
with lessonlib.launch("lessons/16_hosts.py", nproc=2, hosts=net) on chapter 16's lessonlib.Hosts. On one
machine (plain torchrun --nproc_per_node=2, or python) it runs too, every rank on the one host.

Options: --pg-timeout S (the process group's bound, start-up included; default 10).

Asserted on every rank: the all-reduce of (rank + 1) is W(W+1)/2; the ranks on one host (same hostname)
are its local ranks 0..L-1; each rank's gloo listens on one address, and on a machine of its own that is
the address its hostname resolves to. Reported ("where"): hostname, that address, the address gloo
listens on, rank, local rank, group rank.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist

import lessonlib
from lessonlib.launcher.hosts import own_tcp_sockets

WILDCARD = ("0.0.0.0", "::")


# [start: where]
def where_am_i():
    """This rank's host, the address its hostname resolves to, and the addresses its gloo listens on."""
    hostname = socket.gethostname()
    try:
        resolved = socket.gethostbyname(hostname)
    except OSError as e:
        resolved = f"unresolved ({e.strerror})"
    # gloo listens on one address; torch's stores (the rendezvous's, which a forked rank holds too) on all.
    listening = sorted({a for state, a, _, _, _ in own_tcp_sockets() if state == "LISTEN" and a not in WILDCARD})
    return {"host": hostname, "resolves to": resolved, "gloo listens on": listening}


# [end: where]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--pg-timeout", type=float, default=10.0)
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    rank, world = ctx.rank, ctx.world_size
    group_rank = int(os.environ.get("GROUP_RANK", 0))
    # [start: job]
    me = where_am_i()
    me.update(rank=rank, local=ctx.local_rank, node=group_rank)
    print(
        f"rank {rank} (local {ctx.local_rank}, node {group_rank}) on {me['host']}: hostname resolves to "
        f"{me['resolves to']}, gloo listens on {', '.join(me['gloo listens on'])}"
    )
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2, f"rank {rank}: all-reduce gave {total.item()}"
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    # [end: job]
    for host in {p["host"] for p in everyone}:
        locals_ = sorted(p["local"] for p in everyone if p["host"] == host)
        assert locals_ == list(range(len(locals_))), f"rank {rank}: host {host} has local ranks {locals_}"
    for p in everyone:
        assert len(p["gloo listens on"]) == 1, f"rank {rank}: rank {p['rank']} listens on {p['gloo listens on']}"
    if len({p["host"] for p in everyone}) > 1:  # machines of their own: gloo took the hostname's address
        for p in everyone:
            assert p["gloo listens on"] == [p["resolves to"]], f"rank {rank}: rank {p['rank']} {p}"
    lessonlib.report("where", me)
    print(f"rank {rank}: all-reduce of rank+1 over {world} ranks = {total.item():g}, as expected")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
