"""torchrun --nproc_per_node=2 lessons/17_ranks.py

Who am I, under a scheduler: each rank's node, Slurm's numbers and torchrun's, then one all-reduce.

Options: --expect-world N (fail unless the job has N ranks; default: any), --expect-nodes N (fail unless
the ranks are on N hosts; default: any), --pg-timeout 30.

Each rank prints one line: its host, Slurm's SLURM_PROCID, SLURM_LOCALID and SLURM_NODEID (empty outside
Slurm) and torchrun's RANK, LOCAL_RANK, GROUP_RANK and WORLD_SIZE. Under `srun` with one task per rank
and no torchrun, lessonlib.setup fills torchrun's variables from Slurm's first (lessonlib.dist.from_slurm).
Then every rank gathers every rank's line and asserts what a correct job has: ranks 0 to WORLD_SIZE-1
once each, one node index per host, local ranks 0 to n-1 on each host, and RANK = the ranks of the nodes
before this one + LOCAL_RANK; under Slurm, ranks on every node of the job's node list, and on no other.
A job started twice over, or whose nodes all believe they are node 0, fails here (or before: in
init_process_group, within --pg-timeout). Rank 0 prints the table.
"""

import argparse
import os
import re
import socket
import sys

import torch
import torch.distributed as dist

import lessonlib

# [start: identity]
SLURM = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")
TORCHRUN = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")


def identity(ctx):
    """This process's host and the numbers the scheduler and the launcher gave it (under plain python,
    torchrun's are the ones lessonlib.setup assumed: rank 0 of 1)."""
    row = {"host": socket.gethostname(), "pid": os.getpid()}
    row.update({name: os.environ.get(name, "") for name in SLURM})
    assumed = (ctx.rank, ctx.local_rank, ctx.group_rank, ctx.world_size)
    row.update({name: os.environ.get(name) or str(value) for name, value in zip(TORCHRUN, assumed)})
    return row


# [end: identity]


# [start: expand]
def expand(nodelist):
    """Slurm's compressed node list as host names, in order: "gpu[08-10],cpu1" is gpu08 gpu09 gpu10 cpu1."""
    names = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,\[]*", nodelist):  # commas outside brackets separate
        m = re.fullmatch(r"(.*)\[(.*)\](.*)", item)
        if not m:
            names.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            for i in range(int(low), int(high or low) + 1):
                names.append(f"{prefix}{i:0{len(low)}d}{suffix}")
    return names


# [end: expand]


# [start: check]
def problems(rows, nodelist=None):
    """What is wrong with a job's rows (all ranks'), as sentences; [] for a correct job. Under Slurm,
    `nodelist` (SLURM_JOB_NODELIST) names the job's nodes: each must run ranks, and no other host."""
    world = len(rows)
    found = []
    if nodelist:
        nodes, hosts = expand(nodelist), {r["host"] for r in rows}
        found += [f"no rank on {n}, a node of the job" for n in nodes if n not in hosts]
        found += [f"ranks on {h}, which is not a node of the job" for h in sorted(hosts - set(nodes))]
    ranks = sorted(int(r["RANK"]) for r in rows)
    if ranks != list(range(world)):
        found.append(f"ranks {ranks}, not 0..{world - 1} once each")
    nodes = {}
    for r in rows:
        nodes.setdefault(r["host"], set()).add(r["GROUP_RANK"])
    for host, ids in nodes.items():
        if len(ids) != 1:
            found.append(f"{host} has node indices {sorted(ids)}")
    by_index = {}
    for r in rows:
        by_index.setdefault(r["GROUP_RANK"], set()).add(r["host"])
    for index, hosts in by_index.items():
        if len(hosts) > 1:
            found.append(f"node index {index} is claimed by {len(hosts)} hosts: {', '.join(sorted(hosts))}")
    for host in nodes:
        local = sorted(int(r["LOCAL_RANK"]) for r in rows if r["host"] == host)
        if local != list(range(len(local))):
            found.append(f"{host} has local ranks {local}")
    per_node = {}
    for r in rows:
        per_node[int(r["GROUP_RANK"])] = per_node.get(int(r["GROUP_RANK"]), 0) + 1
    for r in rows:
        before = sum(n for g, n in per_node.items() if g < int(r["GROUP_RANK"]))
        if int(r["RANK"]) != before + int(r["LOCAL_RANK"]):
            found.append(f"rank {r['RANK']} on {r['host']} is not {before} + LOCAL_RANK {r['LOCAL_RANK']}")
    return found


# [end: check]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--expect-world", type=int, choices=range(1, 65), metavar="1..64")
    parser.add_argument("--expect-nodes", type=int, choices=range(1, 17), metavar="1..16")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="seconds a collective may wait")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    me = identity(ctx)
    line = "  ".join(f"{k}={v}" for k, v in me.items() if k != "pid")
    sys.stdout.write(f"rank {ctx.rank}: {line}\n")
    sys.stdout.flush()
    rows = [None] * ctx.world_size
    dist.all_gather_object(rows, me)
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    lessonlib.report("rows", rows)
    if ctx.is_main:
        lessonlib.show_table(rows, title=f"{ctx.world_size} ranks on {len({r['host'] for r in rows})} hosts")
    assert total.item() == ctx.world_size, f"all_reduce of ones gave {total.item()}, not {ctx.world_size}"
    found = problems(rows, os.environ.get("SLURM_JOB_NODELIST"))
    assert not found, f"rank {ctx.rank}: this job is wrong: {'; '.join(found)}"
    if args.expect_world is not None:
        assert ctx.world_size == args.expect_world, f"{ctx.world_size} ranks, not {args.expect_world}"
    if args.expect_nodes is not None:
        hosts = len({r["host"] for r in rows})
        assert hosts == args.expect_nodes, f"ranks on {hosts} hosts, not {args.expect_nodes}"
    sys.stdout.write(f"rank {ctx.rank}: a correct job of {ctx.world_size} ranks\n")  # one write: lines stay whole
    lessonlib.teardown()


if __name__ == "__main__":
    main()
