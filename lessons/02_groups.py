"""torchrun --nproc_per_node=4 lessons/02_groups.py

Process groups: collectives among some of the ranks, group ranks versus global ranks, and a gloo
group beside the default one for object collectives.

1. Every rank creates two groups, even ranks and odd ranks (every rank calls new_group for both, in
   the same order, including the group it is not in) and all-reduces its rank within its own group.
2. src/dst are global ranks even inside a group; group_src/group_dst count within the group.
3. Pairs of neighbours with new_subgroups_by_enumeration.
4. A gloo group beside the default group, for object collectives that should stay off the GPU.
5. Timeouts: a group made by new_group does not inherit init_process_group's timeout (checked).

--members-only shows the classic mistake: only the members of the even group call new_group for it.
The ranks then number the next group differently: they wait for each other's keys in the store
until the group timeout (--group-timeout), or worse, connect to the wrong group. --local-sync adds
use_local_synchronization=True to that call: non-members may then skip it, but the numbering of the
next group still differs, and that group cannot form.
"""

import argparse
import datetime
import functools

import torch
import torch.distributed as dist

import lessonlib


# [start: subgroups]
def parity_groups(ctx, members_only, timeout, local_sync=False):
    n, r = ctx.world_size, ctx.rank
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    if members_only and r not in evens:
        even_group = None  # the mistake: non-members skip this new_group call
    else:
        even_group = dist.new_group(evens, timeout=timeout, use_local_synchronization=local_sync)
    odd_group = dist.new_group(odds, timeout=timeout) if odds else None  # [] would mean "all ranks"
    mine = even_group if r % 2 == 0 else odd_group
    x = torch.tensor([r], device=ctx.device)
    dist.all_reduce(x, group=mine)  # only the ranks of my group take part
    expected = sum(evens if r % 2 == 0 else odds)
    assert x.item() == expected, f"rank {r}: all_reduce in its parity group gave {x.item()}, expected {expected}"
    return even_group, odd_group, mine, x.item()


# [end: subgroups]


# [start: ranks]
def group_ranks(ctx, even_group, mine):
    r = ctx.rank
    in_group = dist.get_group_rank(mine, r)  # my position inside my group
    assert dist.get_global_rank(mine, in_group) == r
    x = torch.tensor([r], device=ctx.device)
    dist.broadcast(x, group_src=0, group=mine)  # from the first member of my group: global rank r % 2
    assert x.item() == r % 2, f"rank {r}: broadcast from group rank 0 gave {x.item()}"
    mistake = None
    if r % 2 == 0 and ctx.world_size > 1:  # src is a *global* rank: global rank 1 is not an even rank
        try:
            dist.broadcast(torch.tensor([r], device=ctx.device), src=1, group=even_group)
        except ValueError as e:
            mistake = str(e).split(" <")[0]
        assert mistake, f"rank {r}: broadcast(src=1, group=evens) was accepted"
    return {
        "global rank": r,
        "group rank": in_group,
        "broadcast(group_src=0) gave": x.item(),
        "broadcast(src=1, group=evens)": mistake,
    }


# [end: ranks]


def neighbour_pairs(ctx):
    n, r = ctx.world_size, ctx.rank
    pairs = [list(range(k, min(k + 2, n))) for k in range(0, n, 2)]  # [[0, 1], [2, 3]], or [[0, 1], [2]]
    pair_group, _ = dist.new_subgroups_by_enumeration(pairs, timeout=ctx.timeout)
    x = torch.tensor([r], device=ctx.device)
    dist.all_reduce(x, group=pair_group)
    expected = sum(next(p for p in pairs if r in p))
    assert x.item() == expected, f"rank {r}: all_reduce in its pair gave {x.item()}, expected {expected}"
    return x.item()


# [start: cpu_group]
@functools.cache
def cpu_group(timeout):
    """A gloo group of all ranks. Made on first use, which must happen on every rank (it is collective)."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD  # already on CPU: no second group needed
    return dist.new_group(backend="gloo", timeout=timeout)  # without timeout=, 30 minutes


def gather_object(data, timeout, dst=0):
    """Every rank's `data` as a list on global rank dst (None elsewhere), sent over CPU, not the GPU."""
    group = cpu_group(timeout)
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None  # dst: a global rank
    dist.gather_object(data, out, dst=dst, group=group)
    return out


# [end: cpu_group]


def timeouts(ctx, group_timeout):
    """What bound each group really has (read from the backend object: a private attribute)."""

    def bound(group):
        return group._get_backend(ctx.device).options._timeout.total_seconds()

    default = dist.new_group(timeout=None)  # every rank calls both, in the same order
    bounded = dist.new_group(timeout=group_timeout)
    seen = {
        "init_process_group": bound(dist.group.WORLD),
        "new_group()": bound(default),
        "new_group(timeout=...)": bound(bounded),
    }
    # torch's own defaults, not the init timeout: 30 minutes for gloo, 10 for NCCL
    torch_default = dist.default_pg_nccl_timeout if ctx.backend == "nccl" else dist.default_pg_timeout
    assert seen["init_process_group"] == ctx.timeout.total_seconds(), seen
    assert seen["new_group()"] == torch_default.total_seconds(), seen
    assert seen["new_group(timeout=...)"] == group_timeout.total_seconds(), seen
    return seen


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--members-only", action="store_true", help="only members call new_group (a bug)")
    parser.add_argument("--local-sync", action="store_true", help="with --members-only: use_local_synchronization")
    parser.add_argument(
        "--group-timeout",
        type=float,
        default=None,
        help="seconds for new_group's own bound (default: the process-group timeout)",
    )
    args = parser.parse_args()
    ctx = lessonlib.setup()
    group_timeout = datetime.timedelta(seconds=args.group_timeout) if args.group_timeout else ctx.timeout

    if args.local_sync and not args.members_only:
        parser.error("--local-sync only makes sense with --members-only")
    even_group, odd_group, mine, total = parity_groups(ctx, args.members_only, group_timeout, args.local_sync)
    print(f"rank {ctx.rank}: all_reduce in the {'even' if ctx.rank % 2 == 0 else 'odd'} group = {total}")
    row = lessonlib.report("ranks", group_ranks(ctx, even_group, mine))
    print(
        f"rank {ctx.rank}: group rank {row['group rank']}; "
        f"broadcast(group_src=0) gave {row['broadcast(group_src=0) gave']}"
    )
    if row["broadcast(src=1, group=evens)"]:
        print(f"rank {ctx.rank}: broadcast(src=1, group=evens) -> ValueError: {row['broadcast(src=1, group=evens)']}")
    print(f"rank {ctx.rank}: all_reduce in its pair of neighbours = {neighbour_pairs(ctx)}")
    everyone = gather_object({"rank": ctx.rank, "parity sum": total}, ctx.timeout)
    if ctx.is_main:
        assert [e["rank"] for e in everyone] == list(range(ctx.world_size))
        side = dist.get_backend(cpu_group(ctx.timeout))
        print(f"gathered over the {side} group: {everyone}")
        lessonlib.report("backends", {"default group": dist.get_backend(), "cpu_group()": side})
    seen = lessonlib.report("timeouts", timeouts(ctx, group_timeout))
    if ctx.is_main:
        print("timeouts (s): " + ", ".join(f"{k} {v:g}" for k, v in seen.items()))
    lessonlib.teardown()


if __name__ == "__main__":
    main()
