"""torchrun --standalone --nproc_per_node=2 lessons/train_ddp.py

A DDP training script to copy: torch and the standard library only (torchvision for --data mnist).
It runs unchanged on CPUs (gloo) and on GPUs (NCCL, one GPU per process), and as plain
`python lessons/train_ddp.py` (a world of one). Each line is there for a reason the course shows:
the Start page maps them to chapters.

Options: --epochs 3, --batch-size 48 (the global batch, split over the ranks), --lr 0.05,
--samples 2048, --seed 0, --checkpoint PATH (rank 0 saves after every epoch; every rank resumes from
it when it exists), --amp (autocast: bfloat16 on CPU, float16 with a GradScaler on GPU), --data
synthetic or mnist (with --data-dir holding MNIST's files; nothing is downloaded), --workers 0,
--timeout 60 (seconds a collective may wait before it fails instead of hanging).
"""

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


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


def make_model():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 5 * 5, 10),
    )  # fmt: skip


def augment(x, gen):
    """Shift the batch by up to 2 pixels each way, drawn from `gen`."""
    dx, dy = torch.randint(-2, 3, (2,), generator=gen).tolist()
    return torch.roll(x, shifts=(dx, dy), dims=(2, 3))


def setup(timeout):
    """Join the job torchrun describes in the environment: (rank, local_rank, world_size, device)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, per_node = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # Test for GPUs, not for a CUDA build: a CUDA build with no GPU runs on the CPU with gloo.
    if torch.cuda.is_available() and torch.cuda.device_count() >= per_node:
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # A short timeout: a collective that some rank never joins fails in seconds, not after 10-30 minutes.
    opts = dict(backend=backend, timeout=timedelta(seconds=timeout), device_id=device if backend == "nccl" else None)
    if "RANK" in os.environ:
        dist.init_process_group(**opts)  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from torchrun
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **opts)  # plain `python`
    return rank, local_rank, world_size, device


@torch.no_grad()
def evaluate(model, dataset, device, batch_size):
    """(mean loss, accuracy) over every sample of `dataset`."""
    model.eval()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = Subset(dataset, range(rank, len(dataset), world_size))  # each sample on one rank, none twice
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in DataLoader(shard, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    dist.all_reduce(totals)  # sums and counts over all ranks, divided once: not a mean of means
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def save_checkpoint(path, model, optimizer, scaler, epoch, step):
    """Write to a temporary file, then rename: a crash mid-save leaves the previous checkpoint whole."""
    state = {
        "model": model.module.state_dict(),  # the module's own keys, without DDP's "module." prefix
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "step": step,
    }
    if dist.get_rank() == 0:  # one writer: the replicas are identical
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier()  # no rank goes on (or ends the job) while the file is still being written


def main():
    args = parse_args()
    rank, local_rank, world_size, device = setup(args.timeout)
    try:
        train(args, rank, local_rank, world_size, device)
        dist.barrier()  # leave together: a rank that exits first can break a slower peer's last collective
    finally:
        dist.destroy_process_group()


def train(args, rank, local_rank, world_size, device):
    torch.manual_seed(args.seed)  # the starting weights: the same seed on every rank (DDP also broadcasts)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    # float16 needs its loss scaled so small gradients do not underflow; bfloat16 does not.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp and amp_dtype == torch.float16)
    start_epoch, step = 0, 0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt and ckpt.exists():  # every rank reads the same file, onto its own device
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, step = state["epoch"] + 1, state["step"]
        if rank == 0:
            print(f"resumed from {ckpt} after epoch {state['epoch']} (step {step})")
    # DDP broadcasts rank 0's weights now, and averages the gradients over the ranks in every backward.
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

    train_set, test_set = make_data(args)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)  # a shard per rank
    gen = torch.Generator()  # the augmentations' and workers' random numbers
    loader = DataLoader(
        train_set, batch_size=args.batch_size // world_size, sampler=sampler, num_workers=args.workers,
        generator=gen, drop_last=True, pin_memory=device.type == "cuda",
    )  # fmt: skip

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        gen.manual_seed(args.seed + 100_003 * epoch + rank)  # + rank: every rank draws its own augmentations
        model.train()
        t0 = time.perf_counter()
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        for x, y in loader:
            x, y = augment(x, gen).to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
            totals[0] += loss.detach() * len(y)
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
        dist.all_reduce(totals)
        test_loss, test_acc = evaluate(model.module, test_set, device, args.batch_size)
        if rank == 0:
            print(
                f"epoch {epoch}: train loss {totals[0] / totals[2]:.4f} acc {totals[1] / totals[2]:.4f} | "
                f"test loss {test_loss:.4f} acc {test_acc:.4f} | {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        if ckpt:
            save_checkpoint(ckpt, model, optimizer, scaler, epoch, step)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=48, help="the global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--samples", type=int, default=2048, help="synthetic training samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default="", help="save here after every epoch; resume from it if it exists")
    p.add_argument("--amp", action="store_true", help="mixed precision")
    p.add_argument("--data", choices=["synthetic", "mnist"], default="synthetic")
    p.add_argument("--data-dir", default="data", help="where MNIST's files already are (--data mnist)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    args = p.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.epochs < 1 or args.workers < 0 or args.timeout <= 0 or args.samples < args.batch_size:
        p.error("need --epochs >= 1, --workers >= 0, --timeout > 0 and --samples >= --batch-size")
    if args.batch_size < world_size or args.batch_size % world_size:
        p.error(f"--batch-size {args.batch_size} is the global batch: it must be a multiple of the {world_size} ranks")
    return args


if __name__ == "__main__":
    main()
