"""torchrun --standalone --nproc_per_node=2 lessons/train_fsdp.py

An FSDP2 (fully_shard) training script to copy: torch and the standard library only. It runs unchanged on
CPUs (gloo) and on GPUs (NCCL, one GPU per process), and as plain `python lessons/train_fsdp.py`.

The model is built on the meta device (no memory), each of its `blocks` wrapped in this order: activation
checkpointing (--checkpoint-activations), torch.compile (--compile), fully_shard; then the root; then
to_empty allocates this rank's shards only, which are filled from --init FILE (a one-file state dict that
rank 0 alone reads and broadcasts piece by piece) or initialised fresh; the optimizer comes last.

Options: --epochs 3, --batch-size 48 (global), --lr 3e-3 (AdamW), --lr-schedule constant|cosine (cosine:
from --lr down to 0 over all --epochs), --seed 0, --device auto|cpu|cuda, --amp off|bf16|fp16
(MixedPrecisionPolicy: weights and compute in that dtype, gradients reduced in float32), --accum K
(micro-batches per step), --clip-grad-norm X, --timeout S (collectives), --checkpoint DIR (a
torch.distributed.checkpoint folder, saved after every epoch, resumed from at any world size),
--save-timeout S (the save's own bound), --init FILE, --export FILE (the whole model in one torch.save
file for inference, written at the end), --samples, --width, --depth, --dropout.

SIGINT or SIGTERM: the ranks finish the step in progress, agree to stop after the same step, save a
mid-epoch checkpoint (with --checkpoint), rank 0 prints one line "stopped at epoch E, step S", and the
processes exit with status 0 (run the same command again to resume; a torchrun that got the signal
itself still reports it, with its own traceback, and exits 1). Exit status 2: bad options; 1: no such
device (--device), a save not done within --save-timeout (one line, no traceback), or an error, with its
traceback.
"""

import argparse
import math
import os
import shutil
import signal
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions as Options
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, Subset, TensorDataset


# ---- Your task: data, model, loss and metrics. Change this block; the rest stays as it is. ----
def make_data(args):
    """(train, test) datasets: 32 features, 10 classes, from the seed (no download)."""
    g = torch.Generator().manual_seed(args.seed)
    centres = torch.randn(10, 32, generator=g)
    labels = torch.randint(0, 10, (args.samples + 512,), generator=g)
    x = centres[labels] + 1.5 * torch.randn(len(labels), 32, generator=g)
    n = args.samples
    return TensorDataset(x[:n], labels[:n]), TensorDataset(x[n:], labels[n:])


class Block(nn.Module):
    def __init__(self, width, dropout):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, h):
        return h + self.drop(self.fc2(F.gelu(self.fc1(self.norm(h)))))


class Net(nn.Module):
    """FSDP shards each module of `blocks`, then the rest (stem, norm, head) with the root."""

    def __init__(self, width=64, depth=4, dropout=0.1):
        super().__init__()
        self.stem = nn.Linear(32, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 10)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_model(args):
    return Net(args.width, args.depth, args.dropout)


def loss_and_metrics(out, y):
    """The loss to minimise, and sums to report (each summed over samples, then divided by their count)."""
    out = out.float()  # under --amp the model computes in bf16/fp16; the loss in float32
    loss = F.cross_entropy(out, y)
    return loss, {"loss": loss.detach() * len(y), "acc": (out.argmax(1) == y).sum()}


# ---- End of your task. ----
STOP = {"signal": None}


def on_signal(signum, frame):
    STOP["signal"] = signum  # only a flag: the step in progress finishes, then the ranks agree


def setup(args):
    """Join the job; (rank, world_size, device). Refuses a device it cannot give before any group starts."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, per_node = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # GPUs, not a CUDA build
    if args.device == "cuda" and not gpus:
        sys.exit("--device cuda: no GPU is available here; use --device cpu (gloo) or auto")
    if args.device in ("auto", "cuda") and 0 < gpus < per_node:
        sys.exit(f"{per_node} ranks on this node but {gpus} GPUs: one GPU per rank; --device cpu runs on CPUs")
    device = torch.device("cuda", local_rank) if args.device != "cpu" and gpus else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    opts = dict(backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
    if "RANK" not in os.environ:  # plain `python`: a group of one
        opts.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(**opts, device_id=device if device.type == "cuda" else None)
    return rank, world_size, device


# [start: build]
def build(args, device, world_size):
    """The model, sharded, on `device`: no rank ever holds all of it (rank 0 reads --init's file)."""
    with torch.device("meta"):  # shapes only: a model of any size costs nothing here
        model = make_model(args)
    mesh = init_device_mesh(device.type, (world_size,))
    dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    for i, block in enumerate(model.blocks):  # the order: checkpointing, compile, then fully_shard
        if args.checkpoint_activations:
            block = checkpoint_wrapper(block)  # keeps only the block's input for backward
        if args.compile != "off":
            block.compile(backend=args.compile)  # in place: state_dict keys do not change
        fully_shard(block, mesh=mesh, mp_policy=mp)
        model.blocks[i] = block
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root: stem, norm and head in one unit
    model.to_empty(device=device)  # storage for this rank's shards, nothing else
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensors: the whole shapes
    if args.init:
        peak = load_whole(model, args.init, device)
    else:  # each rank draws its own shards: the values depend on the world size, the distribution does not
        torch.manual_seed(args.seed + 1_000_003 * dist.get_rank())
        with warnings.catch_warnings():  # "DTensor random operators may not have complete support on cpu":
            warnings.simplefilter("ignore")  # on a CPU each shard draws from this rank's generator, seeded above
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        peak = None
    return model, whole, peak


def load_whole(model, path, device):
    """Rank 0 reads the file (memory-mapped) and broadcasts it tensor by tensor; every rank keeps its
    shard of each. The peak bytes this rank allocated meanwhile: torch.cuda's allocator on a GPU; on a
    CPU, torch's MemTracker (torch.distributed._tools, a private module)."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True) if dist.get_rank() == 0 else {}
    opts = Options(full_state_dict=True, broadcast_from_rank0=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        set_model_state_dict(model, state, options=opts)
        return torch.cuda.max_memory_allocated(device)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        set_model_state_dict(model, state, options=opts)
    return tracker.get_tracker_snapshot("peak")[device]["Total"]


# [end: build]


def shard_of_epoch(args, epoch, start, n, world_size, rank):
    """This rank's sample indices for steps start.. of `epoch`. Step s uses the global batch order[s*B:(s+1)*B]
    whatever the world size, so a run resumed at another world size sees the same samples in each step."""
    b = args.batch_size
    order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + epoch))[: n // b * b]
    return order[start * b :][rank::world_size].tolist(), n // b


@torch.no_grad()
def evaluate(model, dataset, device, batch_size):
    """Means over every sample of `dataset`. Every rank runs the same number of forwards (FSDP's
    all-gathers are collectives): a shorter shard is padded with sample 0, weighted 0."""
    model.eval()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine, per = list(range(rank, len(dataset), world_size)), math.ceil(len(dataset) / world_size)
    weights = torch.tensor([1.0] * len(mine) + [0.0] * (per - len(mine)))
    mine += [0] * (per - len(mine))
    totals = {}
    for i in range(0, per, batch_size):
        x, y = dataset[mine[i : i + batch_size]]
        out = model(x.to(device)).float()
        w = weights[i : i + batch_size].to(device)
        sums = {"loss": (F.cross_entropy(out, y.to(device), reduction="none") * w).sum()}
        sums["acc"] = ((out.argmax(1) == y.to(device)) * w).sum()
        for k, v in sums.items():
            totals[k] = totals.get(k, 0) + v.double()
    model.train()
    t = torch.stack(list(totals.values()))
    dist.all_reduce(t)
    return {k: v / len(dataset) for k, v in zip(totals, t.tolist())}


# [start: checkpoint]
def save(args, model, opt, progress, group):
    """A torch.distributed.checkpoint folder: every rank writes its shards at once. Written next to the
    old one, then renamed over it: a save that dies half-way leaves the previous checkpoint whole. Every
    wait in here is on `group`, bounded by --save-timeout: the ranks that finish writing first wait for
    the slowest, which on a shared file system can take minutes."""
    path, tmp, t0 = Path(args.checkpoint), Path(args.checkpoint + ".tmp"), time.monotonic()
    try:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save({**state, "progress": progress}, checkpoint_id=tmp, process_group=group)
        if dist.get_rank() == 0:
            old = Path(args.checkpoint + ".old")
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        dist.barrier(group)
    except Exception as e:
        waited = time.monotonic() - t0
        if waited < args.save_timeout:
            raise  # not a timeout: the error as it is
        why = str(e).partition("\n")[0][:200]  # gloo's first line; the rest is a C++ stack
        raise SystemExit(
            f"rank {dist.get_rank()}: the checkpoint save to {tmp} was not done within --save-timeout "
            f"{args.save_timeout:g} s (waited {waited:.1f} s): give a slow file system a larger --save-timeout. "
            f"({why})"
        ) from None


def resume(args, model, opt, progress, group):
    """Loads the checkpoint into the model, the optimizer and `progress` (in place), at this or any
    other world size."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load({**state, "progress": progress}, checkpoint_id=args.checkpoint, process_group=group)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


# [end: checkpoint]


def main():
    args = parse_args()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)  # before setup: a signal may come at any time
    rank, world_size, device = setup(args)
    try:
        train(args, rank, world_size, device)
        dist.barrier()  # leave together
    finally:
        dist.destroy_process_group()


def train(args, rank, world_size, device):
    model, whole, peak = build(args, device, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # last: it must hold the sharded parameters
    total = args.epochs * (args.samples // args.batch_size)  # optimizer steps, whatever the world size
    cosine = lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, cosine if args.lr_schedule == "cosine" else lambda s: 1)
    # fp16 gradients underflow unscaled. The sharded scaler all-reduces "found inf": every rank must skip the
    # same steps and keep the same scale, since the reduce-scatter sums gradients scaled on every rank.
    scaler = ShardedGradScaler(device.type, enabled=args.amp == "fp16")
    warnings.filterwarnings("ignore", "Found a non-scalar tensor with numel=1")  # its found-inf flag, on DTensors
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.save_timeout))  # the saves' bound
    ckpt = args.checkpoint and (Path(args.checkpoint) / ".metadata").exists()

    def progress(epoch, step, totals):  # saved beside the weights; the scaler's state is {} without fp16
        return dict(epoch=epoch, step=step, totals=totals.cpu(), scaler=scaler.state_dict(), lr=schedule.state_dict())

    epoch, start, totals = 0, 0, torch.zeros(3, dtype=torch.float64)
    if ckpt:
        saved = progress(epoch, start, totals)
        resume(args, model, opt, saved, group)
        schedule.load_state_dict(saved["lr"])
        if scaler.is_enabled():
            scaler.load_state_dict(saved["scaler"])
        # the totals are the whole job's so far: rank 0 carries them on
        epoch, start, totals = saved["epoch"], saved["step"], saved["totals"] * (rank == 0)
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    b, micro = args.batch_size // world_size, args.batch_size // world_size // args.accum
    say = print if rank == 0 else lambda *a, **k: None
    say(
        f"running: backend {dist.get_backend()}, device {device.type}, world size {world_size}, "
        f"AMP {args.amp}, lr {args.lr:g} {args.lr_schedule}, global batch {args.batch_size}, "
        f"per-rank batch {b} ({args.accum} x {micro}); "
        f"FSDP: {len(model.blocks)} blocks + root, {whole} bytes of weights, {held} on rank 0",
        flush=True,
    )
    if args.init and not ckpt:
        say(f"loaded {args.init}: peak bytes per rank while loading {peaks} (the whole model: {whole})", flush=True)
    if ckpt and epoch < args.epochs:
        say(f"resumed from {args.checkpoint} at epoch {epoch}, step {start}", flush=True)
    elif ckpt:
        say(f"{args.checkpoint} has finished all {args.epochs} epochs: nothing to do; --epochs N > {epoch} trains on")
    train_set, test_set = make_data(args)
    while epoch < args.epochs:
        t0 = time.perf_counter()
        mine, steps = shard_of_epoch(args, epoch, start, len(train_set), world_size, rank)
        loader = DataLoader(Subset(train_set, mine), batch_size=micro, pin_memory=device.type == "cuda")
        batches = iter(loader)
        totals = totals.to(device)
        # [start: step]
        for step in range(start, steps):
            torch.manual_seed(args.seed + 7919 * rank + 104_729 * (epoch * steps + step))  # dropout: resumable
            for k in range(args.accum):
                x, y = (t.to(device, non_blocking=True) for t in next(batches))
                model.set_requires_gradient_sync(k == args.accum - 1)  # reduce-scatter on the last only
                loss, sums = loss_and_metrics(model(x), y)
                scaler.scale(loss / args.accum).backward()
                totals += torch.stack([sums["loss"], sums["acc"], torch.tensor(len(y), device=device)]).double()
            if args.clip_grad_norm:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)  # the whole gradient's norm
            scaler.step(opt)
            scaler.update()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            flag = torch.tensor([0 if STOP["signal"] is None else 1], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the same answer on every rank, after the same step
            if flag.item():
                dist.all_reduce(totals)
                if args.checkpoint:
                    save(args, model, opt, progress(epoch, step + 1, totals), group)
                where = f"; checkpoint saved at {args.checkpoint}" if args.checkpoint else "; nothing saved"
                say(f"stopped at epoch {epoch}, step {step + 1}{where}", flush=True)
                return
        # [end: step]
        dist.all_reduce(totals)
        ev = evaluate(model, test_set, device, micro)
        say(
            f"epoch {epoch}: train loss {totals[0] / totals[2]:.4f} acc {totals[1] / totals[2]:.4f} | "
            f"test loss {ev['loss']:.4f} acc {ev['acc']:.4f} | {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        epoch, start, totals = epoch + 1, 0, torch.zeros(3, dtype=torch.float64)
        if args.checkpoint:
            save(args, model, opt, progress(epoch, 0, totals), group)
    if args.export:
        export(args, model)


def export(args, model):
    """The whole model in one torch.save file (make_model's keys) for inference; gathered to rank 0's
    CPU memory tensor by tensor, so only rank 0 holds it all."""
    full = get_model_state_dict(model, options=Options(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, args.export + ".tmp")
        os.replace(args.export + ".tmp", args.export)
        print(f"exported the whole model to {args.export}", flush=True)
    dist.barrier()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # once, from rank 0: torchrun starts every rank with the same options
        if os.environ.get("RANK", "0") == "0":
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=48, help="the global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip-grad-norm", type=float, default=0.0, help="0: no clipping")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--compile", choices=["off", "inductor", "aot_eager"], default="off")
    p.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    p.add_argument("--save-timeout", type=float, default=600, help="seconds a checkpoint save may take")
    p.add_argument("--checkpoint", default="", help="a folder: saved after every epoch, resumed from")
    p.add_argument("--init", default="", help="a torch.save file of make_model's state_dict to start from")
    p.add_argument("--export", default="", help="write the trained model here, one torch.save file")
    p.add_argument("--samples", type=int, default=1536)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    args = p.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if min(args.epochs, args.accum, args.width, args.depth) < 1 or args.lr < 0 or args.clip_grad_norm < 0:
        p.error("need --epochs, --accum, --width and --depth >= 1, --lr >= 0 and --clip-grad-norm >= 0")
    if args.timeout <= 0 or args.save_timeout <= 0 or not 0 <= args.dropout < 1:
        p.error("need --timeout > 0, --save-timeout > 0 and 0 <= --dropout < 1")
    if args.batch_size < 1 or args.batch_size % (world_size * args.accum):
        p.error(
            f"--batch-size {args.batch_size} is the global batch: it must be a multiple of the {world_size} "
            f"ranks times --accum {args.accum}"
        )
    if args.samples < args.batch_size:
        p.error(f"--samples {args.samples} must be at least --batch-size {args.batch_size}")
    if args.init and not Path(args.init).is_file():
        p.error(f"--init {args.init}: no such file")
    if args.checkpoint and Path(args.checkpoint).exists() and not (Path(args.checkpoint) / ".metadata").exists():
        p.error(f"--checkpoint {args.checkpoint} exists but holds no checkpoint (.metadata): another path?")
    return args


if __name__ == "__main__":
    main()
