"""torchrun --nproc_per_node=4 lessons/13_hsdp.py

HSDP: FSDP inside groups of ranks, plain replicas across them, on a 2-D device mesh; what each rank holds and sends.

Options: --shard S (ranks per shard group; default 2 where it divides the world size, else the world size:
plain FSDP); --blocks 4; --width 192; --steps 3; --pg-timeout S.

The model: --blocks equal blocks (Linear + ReLU), float32, each block and then the root under
fully_shard, SGD; rank r trains on its rows of a global batch. The mesh is (R, S) = (N / S, S): ranks
r and r + S, r + 2S, ... are replicas of one another, and the S ranks of a row split the weights.
Each step, per block: two all-gathers inside the shard group (forward and backward), a reduce-scatter
inside it, then an all-reduce of the gradient shard across the replicas: even when R = 1 (a call
that sends nothing: with one replica, use a 1-D mesh), and even at S = 1 (plain DDP). Asserted:
  - the groups: rank r's shard group is the S ranks of its row, its replica group the R ranks of its
    column (dist.get_process_group_ranks on the mesh's groups);
  - what a rank holds: 1/S of the weights, exactly (not 1/N), the same shard as its replicas;
  - the collectives per step and the bytes given to each (exactly), and the bytes sent (Traffic),
    within 2% of gloo's model: 2(S-1)/S M for the all-gathers, 2(S-1)/S M for the reduce-scatter
    (gloo's is an all-reduce) and 2(R-1)/R M/S for the all-reduce, M the model's bytes;
  - the weights after --steps steps equal one process's on the global batch (1e-6).
The ring model's figure is reported beside it: the all-gathers and reduce-scatter each (S-1)/S M.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lessonlib
from lessonlib.sharding import Traffic, held

blocks = lessonlib.load_lesson("13_fsdp_practice").blocks  # --blocks (Linear + ReLU) blocks

ROWS, LR = 4, 0.1  # rows per rank and step; SGD's rate
TOL = 0.02  # bytes sent against the model: gloo frames each message with a header
GAP = 1e-6  # float32 HSDP against one process: the same sums in another order


# [start: mesh]
def hsdp(net, world_size, shard):
    """fully_shard on a 2-D mesh: dim 0 replicates, dim 1 shards. HSDP, with nothing else to change."""
    mesh = init_device_mesh("cpu", (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    for block in net:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, mesh


# [end: mesh]


def model_bytes(n, shard, m):
    """Bytes one rank sends per step, by gloo's model and by the ring model, for a model of m bytes."""
    r = n // shard
    gather = 2 * (shard - 1) / shard * m  # two all-gathers of the whole weights, in the shard group
    allreduce = 2 * (r - 1) / r * m / shard  # the gradient shard, across the replicas
    return gather + 2 * (shard - 1) / shard * m + allreduce, gather + (shard - 1) / shard * m + allreduce


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--shard", type=int, choices=range(1, 65), metavar="1..64", help="ranks per shard group")
    parser.add_argument("--blocks", type=int, default=4, choices=range(1, 17), metavar="1..16")
    parser.add_argument("--width", type=int, default=192, choices=range(12, 1025, 12), metavar="12..1024 (x12)")
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective may wait (default 30)")
    args = parser.parse_args()
    n = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; 1 under plain python. Checked before anything starts
    shard = args.shard or (2 if n % 2 == 0 else n)
    if n % shard:
        parser.error(f"--shard {shard} does not divide the world size {n}: pick one of its divisors")
    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout or 30)
    n, rank = ctx.world_size, ctx.rank
    replicas = n // shard
    net, mesh = hsdp(blocks(args.blocks, args.width), n, shard)
    shard_group = dist.get_process_group_ranks(mesh.get_group("shard"))
    replica_group = dist.get_process_group_ranks(mesh.get_group("replicate"))
    row, col = divmod(rank, shard)
    assert shard_group == list(range(row * shard, (row + 1) * shard)), f"rank {rank}: shard group {shard_group}"
    assert replica_group == list(range(col, n, shard)), f"rank {rank}: replica group {replica_group}"
    m = 4 * args.blocks * args.width * (args.width + 1)  # the model's float32 bytes
    mine = held([p.to_local() for p in net.parameters()])
    assert mine == m // shard, f"rank {rank}: holds {mine} B, want M/S = {m // shard}"

    opt = torch.optim.SGD(net.parameters(), lr=LR)
    alone = blocks(args.blocks, args.width)
    alone_opt = torch.optim.SGD(alone.parameters(), lr=LR)
    rows = slice(ROWS * rank, ROWS * (rank + 1))
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(ROWS * n, args.width, generator=g) for _ in range(2))
        with Traffic() as traffic:
            F.mse_loss(net(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(alone(x), y).backward()
        alone_opt.step()
        alone_opt.zero_grad()
    gap = max((p.full_tensor() - q).abs().max().item() for p, q in zip(net.parameters(), alone.parameters()))
    assert gap < GAP, f"rank {rank}: HSDP's weights are {gap:.1e} from one process's"
    # the same shard as every replica of this rank: their local tensors, gathered over the replica group
    local = torch.cat([p.to_local().detach().flatten() for p in net.parameters()])
    copies = [torch.empty_like(local) for _ in range(replicas)]
    dist.all_gather(copies, local, group=mesh.get_group("replicate"))
    assert all(torch.equal(c, local) for c in copies), f"rank {rank}: a replica holds another shard"

    calls = {"all_gather": 2 * args.blocks, "reduce_scatter": args.blocks} if shard > 1 else {}
    calls["all_reduce"] = args.blocks  # a 2-D mesh all-reduces across replicas, even when there is one
    assert dict(traffic.calls) == calls, f"rank {rank}: collectives {dict(traffic.calls)}, want {calls}"
    payload = {"all_gather": 2 * m // shard, "reduce_scatter": m, "all_reduce": m // shard}  # bytes given
    assert dict(traffic.payload) == {k: payload[k] for k in calls}, f"rank {rank}: payload {dict(traffic.payload)}"
    gloo, ring = model_bytes(n, shard, m)
    if traffic.sent is not None and n > 1:
        assert abs(traffic.sent - gloo) <= TOL * gloo, f"rank {rank}: sent {traffic.sent} B, gloo's model {gloo:.0f}"
    row_report = {"rank": rank, "mesh": [replicas, shard], "shard group": shard_group, "replica group": replica_group}
    row_report.update(held=mine, model=m, calls=dict(traffic.calls), payload=dict(traffic.payload))
    row_report.update({"sent": traffic.sent, "gloo model": gloo, "ring model": ring, "gap": gap})
    lessonlib.report("hsdp", row_report)
    sent = "not measured (no /proc/self/io)" if traffic.sent is None else f"{traffic.sent / m:.3f} M"
    print(f"rank {rank}: shards with {shard_group}, replicas {replica_group}; holds M/{shard}, sent {sent}")
    if ctx.is_main:
        print(f"  mesh (replicate, shard) = ({replicas}, {shard}); M = {m} B; per step {calls}")
        print(f"  gloo's model {gloo / m:.3f} M, the ring model {ring / m:.3f} M; one process to {gap:.1e}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
