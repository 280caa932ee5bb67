"""python lessons/train_one.py

The one-process training script that lessons/train_ddp.py starts from: the Start page shows the diff
between the two, line by line. torch and the standard library only (torchvision for --data mnist).

Options: --epochs 3, --batch-size 48, --lr 0.05, --samples 2048, --seed 0, --checkpoint PATH (resume
from it when it exists), --data synthetic or mnist (with --data-dir holding MNIST's files; nothing is
downloaded), --workers 0.
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


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


@torch.no_grad()
def evaluate(model, dataset, device, batch_size):
    """(mean loss, accuracy) over every sample of `dataset`."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in DataLoader(dataset, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def save_checkpoint(path, model, optimizer, epoch, step):
    """Write to a temporary file, then rename: a crash mid-save leaves the previous checkpoint whole."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train(args, device)


def train(args, device):
    torch.manual_seed(args.seed)  # the starting weights
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_epoch, step = 0, 0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, step = state["epoch"] + 1, state["step"]
        print(f"resumed from {ckpt} after epoch {state['epoch']} (step {step})")

    train_set, test_set = make_data(args)
    gen = torch.Generator()  # the augmentations' and workers' random numbers
    loader = DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
        generator=gen, drop_last=True, pin_memory=device.type == "cuda",
    )  # fmt: skip

    for epoch in range(start_epoch, args.epochs):
        gen.manual_seed(args.seed + 100_003 * epoch)  # a resumed run draws what an uninterrupted one would
        model.train()
        t0 = time.perf_counter()
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        for x, y in loader:
            x, y = augment(x, gen).to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            totals[0] += loss.detach() * len(y)
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
        test_loss, test_acc = evaluate(model, test_set, device, args.batch_size)
        print(
            f"epoch {epoch}: train loss {totals[0] / totals[2]:.4f} acc {totals[1] / totals[2]:.4f} | "
            f"test loss {test_loss:.4f} acc {test_acc:.4f} | {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        if ckpt:
            save_checkpoint(ckpt, model, optimizer, epoch, step)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--samples", type=int, default=2048, help="synthetic training samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default="", help="save here after every epoch; resume from it if it exists")
    p.add_argument("--data", choices=["synthetic", "mnist"], default="synthetic")
    p.add_argument("--data-dir", default="data", help="where MNIST's files already are (--data mnist)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = p.parse_args()
    if args.epochs < 1 or args.batch_size < 1 or args.workers < 0 or args.samples < args.batch_size:
        p.error("need --epochs >= 1, --batch-size >= 1, --workers >= 0 and --samples >= --batch-size")
    return args


if __name__ == "__main__":
    main()
