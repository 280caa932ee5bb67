"""torchrun --nproc_per_node=2 lessons/16_hosts.py

One job on several hosts: where each rank runs, which address its gloo listens on, and one all-reduce.

On one machine, as above, every rank runs on the one host. On several, each host runs the same command
with a rendezvous on the first host's address (HOST0), for example with two ranks per host (one line):
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400
             --rdzv-id=job1 lessons/16_hosts.py
Chapter 16 does that on the hosts of a lessonlib.Hosts:
    lessonlib.launch("lessons/16_hosts.py", nproc=2, hosts=net)

Options: --pg-timeout S (the process group's bound, start-up included; default 10), --master-addr ADDR
(a mistake, for chapter 16 to show: set MASTER_ADDR to ADDR before the process group starts, as a script
that hard-codes MASTER_ADDR=127.0.0.1 does; torchrun's own value is then lost).

Asserted on every rank: the all-reduce of (rank + 1) is W(W+1)/2; the ranks on one host (same hostname)
are its local ranks 0..L-1; gloo listens on one address, the one its rule gives: GLOO_SOCKET_IFNAME's
(on Linux), else the hostname's, else loopback. Reported ("where"): hostname, the address it resolves to,
the address gloo listens on, rank, local rank, group rank.
"""

import argparse
import fcntl
import os
import socket
import struct
import sys

import torch
import torch.distributed as dist

import lessonlib
from lessonlib.sockets import own_tcp_sockets

WILDCARD = ("0.0.0.0", "::")
SIOCGIFADDR = 0x8915  # Linux: an interface's address


def interface_address(name):
    """The IPv4 address of network interface `name` (Linux: the SIOCGIFADDR ioctl), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def gloo_should_pick(resolved):
    """Where gloo listens, by its rule: GLOO_SOCKET_IFNAME's address, else what the hostname resolves to,
    else (with a warning) loopback."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return interface_address(os.environ["GLOO_SOCKET_IFNAME"]) if sys.platform.startswith("linux") else None
    return resolved if resolved[0].isdigit() else "127.0.0.1"


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
    parser.add_argument("--master-addr", default=None)
    args = parser.parse_args()
    if args.master_addr:  # where every rank looks for rank 0's store: right on one host only
        os.environ["MASTER_ADDR"] = args.master_addr
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    rank, world = ctx.rank, ctx.world_size
    group_rank = int(os.environ.get("GROUP_RANK", 0))
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
    for host in {p["host"] for p in everyone}:
        locals_ = sorted(p["local"] for p in everyone if p["host"] == host)
        assert locals_ == list(range(len(locals_))), f"rank {rank}: host {host} has local ranks {locals_}"
    expected = gloo_should_pick(me["resolves to"])
    if expected is not None:
        assert me["gloo listens on"] == [expected], (
            f"rank {rank}: gloo listens on {me['gloo listens on']}, not {expected}"
        )
    lessonlib.report("where", me)
    print(f"rank {rank}: all-reduce of rank+1 over {world} ranks = {total.item():g}, as expected")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
