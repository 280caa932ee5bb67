"""torchrun --nproc_per_node=2 lessons/13_checkpoint.py

Sharded checkpoints: torch.distributed.checkpoint (DCP) saves FSDP at one world size and loads it at another.

Options: --save DIR or --load DIR (default: both, in a temporary folder); --steps 3 (K, with --save or the
default); --pg-timeout S (how long a collective waits; default 30).

A float32 MLP (267k parameters), fully_shard per Linear and at the root, Adam; at step i every rank takes
its slice of global_batch(i, 24) (lessonlib.training): the same run at every world size dividing 24.
  --save DIR: train K steps, dcp.save the sharded model and optimizer state dicts into DIR. It holds
    .metadata and one __r_0.distcp per rank r: rank r's shards and torch.save's header around each piece,
    nothing else (asserted exactly, from .metadata); the shards add up to the whole model and Adam state,
    each file 1/N of it within 1%. Rank 0 also writes the gathered whole weights to model.pt: the bare
    nn.Module, in one process, loads it with weights_only=True and computes what the sharded model
    computes, bitwise. Train on to step 2K and write those weights to uninterrupted.pt.
  --load DIR, at any world size: build the model from another seed, dcp.load (each rank reads the saved
    pieces its shards overlap, from whichever files: reported), the weights equal model.pt bitwise; train
    the K steps left. The final weights equal uninterrupted.pt's: bitwise at the world size that saved,
    within TOL at another (gradients summed in another order). Without the optimizer state (Adam's
    moments from zero) they end more than 100 TOL away.
A --save DIR that is not empty, or a --load DIR this lesson did not save, is refused before anything starts.
"""

import argparse
import contextlib
import math
import os
import shutil
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lessonlib
from lessonlib.training import DIM, global_batch, my_rows

HIDDEN, ROWS, LR = 512, 24, 1e-3  # ROWS: the global batch
TOL = 1e-6  # float32; measured: 3.0e-8 (2**-25, one rounding step of a weight near 0.25), any pair in 1..4 ranks
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0 only, in CPU memory


def bare_model(seed):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(HIDDEN, 1))


def build(seed, mesh):
    model = bare_model(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def train(model, opt, steps, ctx):
    for step in steps:
        x, y = global_batch(step, ROWS)
        mine = my_rows([ROWS // ctx.world_size] * ctx.world_size, ctx.rank)
        loss = F.mse_loss(model(x[mine].float()), y[mine].float())
        opt.zero_grad()
        loss.backward()
        opt.step()


def whole(model):
    """The whole weights on rank 0, {} elsewhere: it all-gathers, so every rank calls it."""
    full = get_model_state_dict(model, options=FULL)
    assert dist.get_rank() == 0 or full == {}, f"rank {dist.get_rank()}: got {len(full)} whole tensors"
    return full


def atomic_save(obj, path):  # chapter 10: the file appears complete, or not at all
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def gap(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


# [start: save]
def save(model, opt, step, folder, ctx):
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": step}
    dcp.save(state, checkpoint_id=folder)  # every rank writes its shards; then rank 0 writes .metadata
    full = whole(model)  # for a reader with one process: whole tensors, gathered on rank 0
    if ctx.is_main:
        atomic_save(full, os.path.join(folder, "model.pt"))
    dist.barrier()  # the files are complete before anyone reads them


# [end: save]


# [start: load]
class Reads(dcp.FileSystemReader):
    """DCP's reader for a folder, noting the bytes this rank reads from each file."""

    def read_data(self, plan, planner):
        self.read = Counter()
        for item in plan.items:  # one per saved piece that overlaps one of this rank's shards
            where = self.storage_data[item.storage_index]
            self.read[where.relative_path] += where.length
        return super().read_data(plan, planner)


def load(model, opt, folder, with_optimizer=True):
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": -1}
    if not with_optimizer:
        del state["optim"]  # the pitfall: the weights alone
    reader = Reads(folder)
    dcp.load(state, storage_reader=reader)  # fills this rank's shards in place, whatever the world size saved
    set_model_state_dict(model, state["model"])
    if with_optimizer:
        set_optimizer_state_dict(model, opt, state["optim"])
    return state["step"], dict(reader.read)


# [end: load]


# [start: contents]
def contents(folder):
    """What .metadata says each file holds: {file: {"pieces", "tensor bytes", "bytes"}}."""
    meta = dcp.FileSystemReader(folder).read_metadata()
    files = {}
    for index, where in meta.storage_data.items():  # a piece: a chunk of a tensor, or a Python value
        f = files.setdefault(where.relative_path, {"pieces": 0, "tensor bytes": 0, "bytes": 0})
        entry = meta.state_dict_metadata[index.fqn]
        if getattr(entry, "size", None):  # a tensor with dimensions (not Adam's scalar step, not an int)
            chunk = next(c for c in entry.chunks if c.offsets == index.offset)
            f["tensor bytes"] += math.prod(chunk.sizes) * entry.properties.dtype.itemsize
        f["pieces"] += 1
        f["bytes"] += where.length  # the piece as torch.save wrote it, header included
    return files


# [end: contents]


def shard_bytes(model, opt):
    """Bytes of this rank's shards of the weights and of Adam's two moments (DCP writes no padding)."""
    tensors = [*model.parameters(), *(v for s in opt.state.values() for k, v in s.items() if k != "step")]
    return sum(t.to_local().numel() * t.element_size() for t in tensors)


def save_run(folder, steps, mesh, ctx):
    model, opt = build(0, mesh)
    train(model, opt, range(steps), ctx)
    save(model, opt, steps, folder, ctx)
    shards = [None] * ctx.world_size
    dist.all_gather_object(shards, shard_bytes(model, opt))
    files = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}
    held, mine = contents(folder), f"__{ctx.rank}_0.distcp"  # one file per saving rank
    assert set(files) == {".metadata", "model.pt", *held} and len(held) == ctx.world_size, f"rank {ctx.rank}: {files}"
    print(f"rank {ctx.rank}: wrote {mine}, {files[mine]:,} B: {shards[ctx.rank]:,} B of shards + headers")
    total = sum(t.numel() * t.element_size() for t in bare_model(0).state_dict().values()) * 3  # weights, 2 moments
    assert sum(shards) == total, f"rank {ctx.rank}: the shards add up to {sum(shards)} B, not {total} B"
    for r in range(ctx.world_size):
        f = held[f"__{r}_0.distcp"]
        assert f["bytes"] == files[f"__{r}_0.distcp"] and f["tensor bytes"] == shards[r], f"rank {r}: {f}"
        assert abs(shards[r] - total / ctx.world_size) < 0.01 * total / ctx.world_size, f"rank {r}: {shards}"
    x, _ = global_batch(0, ROWS)
    with torch.no_grad():
        out = model(x.float())  # every rank: the forward all-gathers the weights
    if ctx.is_main:
        # [start: reader]
        bare = bare_model(seed=1)  # a reader with one process: no FSDP, no process group
        bare.load_state_dict(torch.load(os.path.join(folder, "model.pt"), weights_only=True))
        # [end: reader]
        with torch.no_grad():
            assert torch.equal(bare(x.float()), out), "rank 0: the bare model computes another output"
        lessonlib.report("files", {"sizes": files, "contents": held, "shard bytes": shards, "whole": total})
    train(model, opt, range(steps, 2 * steps), ctx)
    final = whole(model)
    if ctx.is_main:
        straight = {"weights": final, "steps": 2 * steps, "world size": ctx.world_size}
        atomic_save(straight, os.path.join(folder, "uninterrupted.pt"))
    dist.barrier()


def load_run(folder, mesh, ctx):
    straight = torch.load(os.path.join(folder, "uninterrupted.pt"), weights_only=True)
    saved = torch.load(os.path.join(folder, "model.pt"), weights_only=True) if ctx.is_main else None
    end, gaps = straight["steps"], {}
    for with_optimizer in (True, False):
        model, opt = build(1, mesh)  # another seed: only the checkpoint can make it match
        start, read = load(model, opt, folder, with_optimizer)
        loaded = whole(model)  # at one rank, the parameters themselves: compare before training
        if ctx.is_main:
            assert gap(loaded, saved) == 0, f"rank 0: dcp.load gave other weights than model.pt: {gap(loaded, saved)}"
        if with_optimizer:
            print(f"rank {ctx.rank}: read " + ", ".join(f"{f} ({n:,} B)" for f, n in sorted(read.items())))
            lessonlib.report("reads", read)
        train(model, opt, range(start, end), ctx)
        final = whole(model)
        if ctx.is_main:
            gaps[with_optimizer] = gap(final, straight["weights"])
    if ctx.is_main:
        n, resumed, without = straight["world size"], gaps[True], gaps[False]
        assert resumed == 0 if n == ctx.world_size else resumed <= TOL, f"rank 0: {resumed:.1e} from uninterrupted"
        assert without > 100 * TOL, f"rank 0: without the optimizer state, only {without:.1e} apart"
        print(
            f"saved at {n} ranks, loaded at {ctx.world_size}, steps {start}..{end}: {resumed:.1e} from the "
            f"uninterrupted run (tolerance {TOL:g}); {without:.1e} without the optimizer state"
        )
        row = {"saved at": n, "loaded at": ctx.world_size, "steps": [start, end], "max difference": resumed}
        lessonlib.report("resumed", {**row, "without optimizer state": without, "tolerance": TOL})


@contextlib.contextmanager
def temporary_folder(ctx):
    """A folder every rank knows (rank 0 makes it and broadcasts its path), removed at the end."""
    box = [tempfile.mkdtemp(prefix="ch13-") if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    try:
        yield box[0]
    finally:
        if ctx.is_main:
            shutil.rmtree(box[0], ignore_errors=True)


def check_folder(parser, args):
    """Refuse a folder that would be mixed up (--save) or was not written by this lesson (--load)."""
    if args.save and os.path.exists(args.save) and (not os.path.isdir(args.save) or os.listdir(args.save)):
        parser.error(f"--save {args.save}: not a new or empty folder (DCP would mix its files with what is there)")
    if args.load:
        try:
            meta = dcp.FileSystemReader(args.load).read_metadata()
        except OSError:
            parser.error(f"--load {args.load}: no DCP checkpoint there (no .metadata); make one with --save")
        want = {f"model.{k}": tuple(v.shape) for k, v in bare_model(0).state_dict().items()}
        got = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
        if got != want or "step" not in meta.state_dict_metadata:
            differ = [f"{k} {got.get(k)} (here {want.get(k)})" for k in sorted(got | want) if got.get(k) != want.get(k)]
            parser.error(f"--load {args.load}: not a checkpoint of this lesson's model: {', '.join(differ[:3])}")
        files = {w.relative_path for w in meta.storage_data.values()} | {"model.pt", "uninterrupted.pt"}
        if missing := sorted(f for f in files if not os.path.exists(os.path.join(args.load, f))):
            parser.error(f"--load {args.load}: incomplete, {', '.join(missing)} missing; save again with --save")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--save", metavar="DIR", help="train, save a sharded checkpoint into DIR (new or empty)")
    how.add_argument("--load", metavar="DIR", help="load the checkpoint in DIR at this world size, train on")
    parser.add_argument("--steps", type=int, choices=range(1, 21), metavar="1..20", help="K (default 3)")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective waits (default 30)")
    args = parser.parse_args()
    if args.load and args.steps:
        parser.error("--steps goes with --save: --load trains the steps the checkpoint has left")
    check_folder(parser, args)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout or 30)
    if ROWS % ctx.world_size:
        raise ValueError(f"rank {ctx.rank}: {ROWS} rows do not split evenly over {ctx.world_size} ranks")
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    steps = args.steps or 3
    if args.save:
        if ctx.is_main:
            os.makedirs(args.save, exist_ok=True)
        dist.barrier()
        save_run(args.save, steps, mesh, ctx)
    elif args.load:
        load_run(args.load, mesh, ctx)
    else:
        with temporary_folder(ctx) as folder:
            save_run(folder, steps, mesh, ctx)
            load_run(folder, mesh, ctx)
            dist.barrier()  # nobody still reads when rank 0 removes the folder
    lessonlib.teardown()


if __name__ == "__main__":
    main()
