"""torchrun --standalone --nproc_per_node=2 lessons/train_ddp.py

A DDP training script to copy: torch and the standard library only (torchvision for --data mnist).
It runs on CPUs (gloo) and on GPUs (NCCL, one GPU per process), and as plain `python lessons/train_ddp.py`
(a world of one). To train something else, change the one block marked "task" below (data, model,
augmentation, loss, metrics and their options) and nothing else. The Start page maps every other
part to the chapter that shows why it is there.

Options (`--help` lists them): --device auto|cpu|cuda, --amp off|bf16|fp16, --epochs, --batch-size
(the global batch), --accum K, --lr, --lr-schedule constant|cosine, --clip-grad-norm, --seed,
--checkpoint PATH (saved after every epoch and when stopped; resumed from when it exists), --timeout S
(collectives), --save-timeout S (the checkpoint's own bound), --workers, and the task's own.

SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) stops the run after the step in progress, the
same step on every rank, saving that point when --checkpoint is given; the same command resumes from
it as if it had never stopped. Exit status: 0 finished (or nothing left to do), 2 bad options, 128 +
the signal's number (130 for SIGINT, 143 for SIGTERM) when stopped by a signal, 1 for any other error.
torchrun forwards a signal it gets to every rank; it then prints its own warnings and a SignalException
traceback and exits 1 whatever the ranks did (torch 2.14.1): the script's own output is one line.
"""

import argparse
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

# [start: task]
# ---- The task: data, model, augmentation, loss, metrics. To train something else, change only this. ----
METRICS = ("loss", "acc")  # what batch_sums adds up, in this order; printed as "loss 0.1234 acc 0.9876"


def add_task_options(p):
    p.add_argument("--samples", type=int, default=2048, help="synthetic training samples")
    p.add_argument("--data", choices=["synthetic", "mnist"], default="synthetic")
    p.add_argument("--data-dir", default="data", help="where MNIST's files already are (--data mnist)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout before the last layer")
    p.add_argument("--shift", type=int, default=2, help="augmentation: shift by up to N pixels (0: none)")


def make_data(args):
    """(train, test) datasets of 1x28x28 images with labels 0-9."""
    if args.data == "mnist":  # the files must already be in --data-dir: nothing is downloaded
        from torchvision import datasets, transforms

        tf = transforms.ToTensor()
        return (
            datasets.MNIST(args.data_dir, train=True, transform=tf, download=False),
            datasets.MNIST(args.data_dir, train=False, transform=tf, download=False),
        )
    # Ten smooth random patterns plus noise: a task that needs no download, the same from the same seed.
    g = torch.Generator().manual_seed(args.seed)
    patterns = F.interpolate(torch.rand(10, 1, 7, 7, generator=g), size=(28, 28), mode="bilinear")
    labels = torch.randint(0, 10, (args.samples + 512,), generator=g)
    images = patterns[labels] + 0.7 * torch.randn(len(labels), 1, 28, 28, generator=g)
    n = args.samples
    return TensorDataset(images[:n], labels[:n]), TensorDataset(images[n:], labels[n:])


def make_model(args):
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(args.dropout), nn.Linear(32 * 5 * 5, 10),
    )  # fmt: skip


def augment(x, args):
    """Shift the batch by up to --shift pixels each way (random numbers from the global generator)."""
    dx, dy = torch.randint(-args.shift, args.shift + 1, (2,)).tolist()
    return torch.roll(x, shifts=(dx, dy), dims=(2, 3))


def loss_fn(out, y):
    return F.cross_entropy(out, y)


def batch_sums(out, y):
    """Each of METRICS summed over the batch (divided by the number of samples at the end)."""
    return torch.stack([F.cross_entropy(out, y, reduction="sum"), (out.argmax(1) == y).sum()])


# [end: task]
AMP = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast's dtype for --amp
STOP = {"signal": 0}


def on_signal(signum, frame):
    STOP["signal"] = signum  # only a flag: the step in progress finishes, then the ranks agree to stop


def stop_requested(device):
    """The signal any rank got (0: none), the same answer on every rank, at the same step."""
    flag = torch.tensor([STOP["signal"]], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def say(line):
    if int(os.environ.get("RANK", 0)) == 0:  # one voice: rank 0 prints, the others stay quiet
        print(line, flush=True)


def pick_device(choice, gpus, local_rank, per_node):
    """(device, backend) for --device `choice` with `gpus` GPUs and `per_node` ranks on this machine."""
    if choice == "cpu" or (choice == "auto" and gpus == 0):
        return torch.device("cpu"), "gloo"
    if gpus == 0:
        raise ValueError("--device cuda, but torch sees no GPU: use --device cpu (or auto)")
    if gpus < per_node:  # never fall back to the CPU in silence: say what is wrong
        raise ValueError(
            f"{per_node} ranks on this machine but {gpus} GPUs: start at most {gpus} per machine "
            "(--nproc_per_node), or choose the CPU with --device cpu"
        )
    return torch.device("cuda", local_rank), "nccl"


def setup(args):
    """Join the job torchrun describes in the environment; the checkpoint's own group (its own bound)."""
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
    # A short timeout: a collective that some rank never joins fails in seconds, not after 10-30 minutes.
    opts = dict(backend=args.backend, timeout=timedelta(seconds=args.timeout))
    opts["device_id"] = args.device if args.backend == "nccl" else None
    if "RANK" in os.environ:
        dist.init_process_group(**opts)  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from torchrun
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **opts)  # plain `python`
    # Waiting for rank 0's save is not a collective that should be quick: a large model on a shared file
    # system takes minutes. A gloo group with --save-timeout bounds that wait alone.
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=args.save_timeout))


def forward(model, x, args):
    """The model's outputs, under autocast when --amp is on."""
    with torch.autocast(x.device.type, dtype=AMP[args.amp], enabled=args.amp != "off"):
        return model(x)


@torch.no_grad()
def evaluate(model, dataset, args):
    """Each metric over every sample of `dataset`."""
    model.eval()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = Subset(dataset, range(rank, len(dataset), world_size))  # each sample on one rank, none twice
    sums = zeros(args.device)
    for x, y in DataLoader(shard, batch_size=args.batch_size):
        out = forward(model, x.to(args.device), args)
        add_batch(sums, out, y.to(args.device))
    dist.all_reduce(sums)  # sums and counts over all ranks, divided once: not a mean of means
    return sums


def zeros(device):
    return torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=device)  # each metric's sum, then the count


def add_batch(sums, out, y):
    sums[:-1] += batch_sums(out.detach().float(), y)
    sums[-1] += len(y)


def describe(sums):
    return " ".join(f"{name} {value:.4f}" for name, value in zip(METRICS, (sums[:-1] / sums[-1]).tolist()))


def snapshot(model, parts, **position):
    """All that a resumed run needs; the model with the module's own keys, without DDP's "module." prefix."""
    return {"model": model.module.state_dict()} | {name: part.state_dict() for name, part in parts.items()} | position


def save_checkpoint(path, state, args, group):
    """Write to a temporary file, then rename: a crash mid-save leaves the previous checkpoint whole."""
    t0 = time.monotonic()
    if dist.get_rank() == 0:  # one writer: the replicas are identical
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    try:  # no rank goes on (or ends the job) while the file is still being written
        dist.barrier(group=group)
    except Exception as e:
        raise SystemExit(
            f"rank {dist.get_rank()}: the save of {path} was not done within --save-timeout {args.save_timeout:g} s "
            f"(waited {time.monotonic() - t0:.1f} s): give a slow file system a larger --save-timeout. ({e})"
        ) from None


def main():
    args = parse_args()  # every check on what was asked, before anything starts
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    save_group = setup(args)
    try:
        status = train(args, save_group)
        dist.barrier()  # leave together: a rank that exits first can break a slower peer's last collective
    finally:
        dist.destroy_process_group()
    sys.exit(status)


def train(args, save_group):
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), args.device
    train_set, test_set = make_data(args)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)  # a shard per rank
    gen = torch.Generator()  # the workers' seeds, for random transforms inside a Dataset
    batch_size = args.batch_size // world_size  # per rank
    loader = DataLoader(
        train_set, batch_size=batch_size, sampler=sampler, num_workers=args.workers,
        generator=gen, drop_last=True, pin_memory=device.type == "cuda",
    )  # fmt: skip
    torch.manual_seed(args.seed)  # the starting weights: the same seed on every rank (DDP also broadcasts)
    model = make_model(args).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    total = args.epochs * len(loader)
    cosine = lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine if args.lr_schedule == "cosine" else lambda s: 1)
    # float16 needs its loss scaled so small gradients do not underflow; bfloat16 does not.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    parts = dict(optimizer=optimizer, scheduler=scheduler, scaler=scaler)  # saved with the model
    start_epoch, batch, step, sums = 0, 0, 0, None
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt and ckpt.exists():  # every rank reads the same file, onto its own device
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        for name, part in parts.items():
            part.load_state_dict(state[name])
        start_epoch, batch, step, sums = state["epoch"], state["batch"], state["step"], state["sums"]
        if start_epoch >= args.epochs:
            say(f"{ckpt} has finished all {start_epoch} epochs: nothing to do (to train more, raise --epochs)")
            return 0
        say(f"resumed from {ckpt} at epoch {start_epoch}, batch {batch} (step {step})")
    # DDP broadcasts rank 0's weights now, and averages the gradients over the ranks in every backward.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    say(
        f"running: backend {args.backend}, device {device.type}, world size {world_size}, "
        f"global batch {args.batch_size} = {world_size} x {batch_size} per rank, "
        f"in {args.accum} micro-batch(es) of {batch_size // args.accum}"
        f", amp {args.amp}"
    )

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        gen.manual_seed(args.seed + 100_003 * epoch + rank)  # + rank: each rank's workers their own numbers
        model.train()
        t0 = time.perf_counter()
        # What the epoch has added up so far: a resumed epoch goes on from the saved sums, held by rank 0.
        sums, skip = (sums if sums is not None and rank == 0 else zeros(device)), batch
        for batch, (x, y) in enumerate(loader):
            if batch < skip:
                continue  # trained before the stop this run resumes from
            # Dropout and augmentation draw from the global generator, seeded from the step and the rank: a
            # resumed run draws what an uninterrupted one would, on CPU and GPU, with no RNG state to save.
            torch.manual_seed(args.seed + 1_000_003 * step + rank)
            x, y = augment(x, args).to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            for i, (xs, ys) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum))):
                # DDP decides in forward: after a forward under no_sync, backward all-reduces nothing.
                with nullcontext() if i == args.accum - 1 else model.no_sync():
                    out = forward(model, xs, args)
                loss = loss_fn(out.float(), ys) / args.accum  # a mean over the whole batch once all are in
                add_batch(sums, out, ys)
                scaler.scale(loss).backward()
            if args.clip_grad_norm:
                scaler.unscale_(optimizer)  # clip the true gradients, not float16's scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            signum = stop_requested(device)
            if signum:
                dist.all_reduce(sums)  # the epoch so far, for the resumed run to go on from
                if ckpt:
                    state = snapshot(model, parts, epoch=epoch, batch=batch + 1, step=step)
                    save_checkpoint(ckpt, state | {"sums": sums}, args, save_group)
                saved = f"; checkpoint saved at {ckpt}" if ckpt else "; no --checkpoint, nothing saved"
                say(f"stopped at epoch {epoch}, step {step} ({signal.Signals(signum).name}){saved}")
                return 128 + signum
        dist.all_reduce(sums)
        test = evaluate(model.module, test_set, args)
        say(f"epoch {epoch}: train {describe(sums)} | test {describe(test)} | {time.perf_counter() - t0:.1f} s")
        batch, sums = 0, None
        if ckpt:
            state = snapshot(model, parts, epoch=epoch + 1, batch=0, step=step)
            save_checkpoint(ckpt, state | {"sums": zeros(device)}, args, save_group)
    return 0


class Parser(argparse.ArgumentParser):
    def error(self, message):  # said once, by rank 0; every rank exits with status 2
        if int(os.environ.get("RANK", 0)) == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def parse_args():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if there are GPUs")
    p.add_argument("--amp", choices=list(AMP), default="off", help="autocast dtype (bf16 on A100/H100-class GPUs)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=48, help="the global batch, split over the ranks")
    p.add_argument("--accum", type=int, default=1, help="micro-batches each rank's batch is split into")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant")
    p.add_argument("--clip-grad-norm", type=float, default=0.0, help="clip the gradients' norm to this (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default="", help="save here after every epoch; resume from it if it exists")
    p.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    p.add_argument("--save-timeout", type=float, default=600, help="seconds the ranks wait for a checkpoint save")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    add_task_options(p)
    args = p.parse_args()
    world_size, per_node = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if args.epochs < 1 or args.workers < 0 or args.timeout <= 0 or args.save_timeout <= 0 or args.accum < 1:
        p.error("need --epochs >= 1, --accum >= 1, --workers >= 0, --timeout > 0 and --save-timeout > 0")
    if args.batch_size < 1 or args.batch_size % (world_size * args.accum):
        p.error(
            f"--batch-size {args.batch_size} is the global batch: it must be a multiple of "
            f"{world_size} ranks x --accum {args.accum} = {world_size * args.accum}"
        )
    if getattr(args, "samples", args.batch_size) < args.batch_size:
        p.error(f"--samples {args.samples} is less than one global batch (--batch-size {args.batch_size})")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # GPUs, not a CUDA build
    try:
        args.device, args.backend = pick_device(args.device, gpus, int(os.environ.get("LOCAL_RANK", 0)), per_node)
    except ValueError as e:
        p.error(str(e))
    if args.amp == "bf16" and args.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        p.error("--amp bf16: this GPU has no bfloat16 (it needs an A100/H100 class GPU): use --amp fp16")
    return args


if __name__ == "__main__":
    main()
