"""torchrun --nproc_per_node=2 lessons/10_load.py

Loading a checkpoint under DDP: on every rank, after a barrier, with map_location.

Options: --steps 3 (the default), --dir DIR (where to make the checkpoint folder; default: a temporary one).

Rank 0 writes a checkpoint (weights and SGD momentum, after a few steps in one process), atomically,
then a barrier. Every rank builds its model from seed + rank (chapter 4), so the ranks start apart.
Four ways to load it, each followed by --steps DDP steps, every rank's parameters gathered:
  pretrained, rank 0 loads before DDP(model): the construction broadcast copies them: equal, and stay so;
  pretrained, rank 0 loads after DDP(model):  nothing copies them again: different at once, and for good
                                              (the same averaged steps keep the gap as it was);
  resume, rank 0 loads before DDP(model):     weights equal, momentum on rank 0 only: they drift apart;
  resume, every rank loads:                   equal, and they stay equal (all asserted, from 2 ranks on).
No barrier: the order a slow rank 0 gives is forced, and the others read the previous checkpoint without
any error (asserted). map_location: a file whose tensors were saved on cuda:0 fails to load without
it on a machine with no GPU (the real error) and loads with it. Where CUDA is available, a real cuda:0
file is loaded by every rank: without map_location every rank's tensors land on GPU 0.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.exercises import load_function
from lessonlib.training import flat_params, gather, global_batch, mlp, my_rows

HERE = os.path.dirname(os.path.abspath(__file__))
atomic_save, shared_folder = (
    load_function(os.path.join(HERE, "10_save.py"), n) for n in ("atomic_save", "shared_folder")
)
ROWS = 4  # per rank and step
CASES = (
    "pretrained, rank 0 loads before DDP(model)",
    "pretrained, rank 0 loads after DDP(model)",
    "resume, rank 0 loads before DDP(model)",
    "resume, every rank loads",
)


def spread(ddp):
    """Largest gap between any rank's parameters and rank 0's."""
    every = gather(flat_params(ddp.module))
    return max((p - every[0]).abs().max().item() for p in every)


def step(model, opt, i, rows, mine=slice(None)):
    x, y = global_batch(i, rows)
    opt.zero_grad()
    F.mse_loss(model(x[mine]), y[mine]).backward()
    opt.step()


def pretrain(ctx, path, steps):
    """Rank 0 alone trains a few steps and writes weights and momentum; the others wait at the barrier."""
    if ctx.is_main:
        model = mlp(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for i in range(steps):
            step(model, opt, i, 8)
        atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 1}, path)
    dist.barrier()  # nobody reads before the file is complete


def case(name, ctx, path, steps):
    model = mlp(seed=100 + ctx.rank)  # seed + rank: every rank starts somewhere else
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # [start: load]
    state = torch.load(path, map_location="cpu")  # weights_only=True by default
    if "every rank" in name or ctx.is_main and "before" in name:
        model.load_state_dict(state["model"])
        if name.startswith("resume"):
            opt.load_state_dict(state["opt"])  # momentum buffers: DDP never sends these
    ddp = DDP(model)  # broadcasts rank 0's parameters and buffers, once
    if ctx.is_main and "after" in name:
        ddp.module.load_state_dict(state["model"])  # too late: no broadcast follows
    # [end: load]
    at_start, loaded_momentum = spread(ddp), bool(opt.state)
    for i in range(steps):
        step(ddp, opt, 10 + i, ROWS * ctx.world_size, my_rows([ROWS] * ctx.world_size, ctx.rank))
    return {
        "case": name,
        "gap at start": at_start,
        "gap after steps": spread(ddp),
        "steps": steps,
        "momentum loaded on this rank": loaded_momentum,
    }


def no_barrier(ctx, path):
    """Rank 0 writes epoch 2 over epoch 1; the others read without waiting for it."""
    # [start: no_barrier]
    if not ctx.is_main:
        read = torch.load(path, map_location="cpu")["epoch"]  # nothing made this rank wait
    dist.barrier()  # only to force the unlucky order every time: rank 0 is slower than the others
    if ctx.is_main:
        atomic_save({**torch.load(path), "epoch": 2}, path)
        read = 2
    # [end: no_barrier]
    every = [None] * ctx.world_size
    dist.all_gather_object(every, read)
    assert every == [2] + [1] * (ctx.world_size - 1), f"rank {ctx.rank}: epochs read: {every}"
    return every


# [start: as_if_from_gpu]
FROM_GPU = {"on": False}  # torch.save asks taggers, lowest priority first, where each tensor lives
torch.serialization.register_package(0, lambda storage: "cuda:0" if FROM_GPU["on"] else None, lambda s, loc: None)


def save_as_if_from_gpu(obj, path):
    """Write `obj` with every tensor recorded as saved from cuda:0, as a run on GPU 0 writes it."""
    FROM_GPU["on"] = True
    try:
        atomic_save(obj, path)
    finally:
        FROM_GPU["on"] = False


# [end: as_if_from_gpu]


def gpu_file(ctx, folder):
    """Load a checkpoint written on cuda:0: a real one where CUDA is available, else one recorded so."""
    path, cuda = os.path.join(folder, "from_gpu.pt"), torch.cuda.is_available()
    if ctx.is_main:
        w = torch.ones(256, 1024)  # 1 MiB
        atomic_save({"w": w.to("cuda:0")}, path) if cuda else save_as_if_from_gpu({"w": w}, path)
    dist.barrier()
    recorded = []
    torch.load(path, map_location=lambda storage, location: recorded.append(location) or storage)
    assert recorded == ["cuda:0"], recorded  # the same on a GPU machine and here
    row = {"rank": ctx.rank, "file says": recorded[0], "CUDA available": cuda}
    # [start: map_location]
    try:
        row["no map_location"] = str(torch.load(path)["w"].device)  # the device the file names
    except RuntimeError as e:
        row["no map_location"] = str(e)  # no GPU here
    row["map_location='cpu'"] = str(torch.load(path, map_location="cpu")["w"].device)
    own = f"cuda:{ctx.local_rank % torch.cuda.device_count()}" if cuda else "cpu"  # this rank's device
    row["map_location={'cuda:0': own}"] = str(torch.load(path, map_location={"cuda:0": own})["w"].device)
    # [end: map_location]
    if cuda:
        assert row["no map_location"] == "cuda:0", f"rank {ctx.rank}: {row}"  # every rank: GPU 0
        w = torch.load(path)["w"]
        row["MiB on GPU 0, copy held"] = torch.cuda.memory_allocated(0) / 2**20
        del w  # freed, but the caching allocator keeps the block for this process
        row["MiB on GPU 0, freed: allocated, reserved"] = [
            torch.cuda.memory_allocated(0) / 2**20,
            torch.cuda.memory_reserved(0) / 2**20,
        ]
        assert row["MiB on GPU 0, copy held"] >= 1 and row["MiB on GPU 0, freed: allocated, reserved"][1] >= 1, row
    else:
        assert "Attempting to deserialize object on a CUDA device" in row["no map_location"], row
        row["real GPU demonstration"] = "skipped: torch.cuda.is_available() is False"
    assert row["map_location='cpu'"] == "cpu" and row["map_location={'cuda:0': own}"] == own, row
    every = [None] * ctx.world_size
    dist.all_gather_object(every, row)
    return every


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--dir", help="where to make the checkpoint folder (a shared file system with several nodes)")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    with shared_folder(ctx, args.dir) as folder:
        path = os.path.join(folder, "checkpoint.pt")
        pretrain(ctx, path, 3)
        rows = {name: case(name, ctx, path, args.steps) for name in CASES}
        momentum = [None] * ctx.world_size
        dist.all_gather_object(momentum, [row["momentum loaded on this rank"] for row in rows.values()])
        if ctx.world_size > 1:
            a, b, c, d = rows.values()
            assert a["gap at start"] == 0 and a["gap after steps"] == 0, f"rank {ctx.rank}: {a}"
            assert b["gap at start"] > 0 and b["gap after steps"] > 0, f"rank {ctx.rank}: {b}"
            # the same averaged steps on every rank: the gap stays what it was, to float64 rounding
            assert abs(b["gap after steps"] - b["gap at start"]) < 1e-12, f"rank {ctx.rank}: {b}"
            # momentum: in the resume cases, on rank 0 alone when only rank 0 loads, else everywhere
            assert [held[2] for held in momentum] == [True] + [False] * (ctx.world_size - 1), momentum
            assert all(held[3] for held in momentum), f"rank {ctx.rank}: momentum loaded {momentum}"
            assert c["gap at start"] == 0 and c["gap after steps"] > 0, f"rank {ctx.rank}: {c}"
            assert d["gap at start"] == 0 and d["gap after steps"] == 0, f"rank {ctx.rank}: {d}"
        lessonlib.report("cases", {"rows": list(rows.values()), "momentum by rank": momentum})
        read = lessonlib.report("no_barrier", no_barrier(ctx, path))
        where = lessonlib.report("map_location", gpu_file(ctx, folder))
        if ctx.is_main:
            for row in rows.values():
                print(
                    f"{row['case']:43} largest gap to rank 0: at start {row['gap at start']:.1e}, "
                    f"after {row['steps']} steps {row['gap after steps']:.1e}"
                )
            print(f"no barrier: epochs read by rank: {read}")
            print("without map_location: " + "; ".join(f"rank {w['rank']}: {w['no map_location'][:60]}" for w in where))
    lessonlib.teardown()


if __name__ == "__main__":
    main()
