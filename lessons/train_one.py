"""python lessons/train_one.py

The one-process training script that lessons/train_ddp.py starts from: the Start page shows the diff
between the two, line by line. torch and the standard library only (torchvision for --data mnist).
The task (data, model, augmentation, loss, metrics and their options) is the block marked "task",
the same as in train_ddp.py.

Options (`--help` lists them): --device auto|cpu|cuda, --epochs, --batch-size, --accum K, --lr,
--lr-schedule constant|cosine, --clip-grad-norm, --seed, --checkpoint PATH (saved after every epoch
and when stopped; resumed from when it exists), --workers, and the task's own.

SIGINT (Ctrl-C) or SIGTERM stops the run after the step in progress, saving that point when
--checkpoint is given; the same command resumes from it as if it had never stopped. Exit status: 0
finished (or nothing left to do), 2 bad options, 128 + the signal's number when stopped by a signal.
"""

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

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
STOP = {"signal": 0}


def on_signal(signum, frame):
    STOP["signal"] = signum  # only a flag: the step in progress finishes first


def say(line):
    print(line, flush=True)


def pick_device(choice, gpus):
    """The device for --device `choice` with `gpus` GPUs on this machine."""
    if choice == "cpu" or (choice == "auto" and gpus == 0):
        return torch.device("cpu")
    if gpus == 0:
        raise ValueError("--device cuda, but torch sees no GPU: use --device cpu (or auto)")
    return torch.device("cuda")


def forward(model, x, args):
    """The model's outputs."""
    return model(x)


@torch.no_grad()
def evaluate(model, dataset, args):
    """Each metric over every sample of `dataset`."""
    model.eval()
    sums = zeros(args.device)
    for x, y in DataLoader(dataset, batch_size=args.batch_size):
        out = forward(model, x.to(args.device), args)
        add_batch(sums, out, y.to(args.device))
    return sums


def zeros(device):
    return torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=device)  # each metric's sum, then the count


def add_batch(sums, out, y):
    sums[:-1] += batch_sums(out.detach().float(), y)
    sums[-1] += len(y)


def describe(sums):
    return " ".join(f"{name} {value:.4f}" for name, value in zip(METRICS, (sums[:-1] / sums[-1]).tolist()))


def snapshot(model, parts, **position):
    """All that a resumed run needs."""
    return {"model": model.state_dict()} | {name: part.state_dict() for name, part in parts.items()} | position


def save_checkpoint(path, state):
    """Write to a temporary file, then rename: a crash mid-save leaves the previous checkpoint whole."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()  # every check on what was asked, before anything starts
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    sys.exit(train(args))


def train(args):
    device = args.device
    train_set, test_set = make_data(args)
    gen = torch.Generator()  # the shuffle's and the workers' random numbers
    batch_size = args.batch_size
    loader = DataLoader(
        train_set, batch_size=batch_size, shuffle=True, num_workers=args.workers,
        generator=gen, drop_last=True, pin_memory=device.type == "cuda",
    )  # fmt: skip
    torch.manual_seed(args.seed)  # the starting weights
    model = make_model(args).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    total = args.epochs * len(loader)
    cosine = lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine if args.lr_schedule == "cosine" else lambda s: 1)
    parts = dict(optimizer=optimizer, scheduler=scheduler)  # saved with the model
    start_epoch, batch, step, sums = 0, 0, 0, None
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        for name, part in parts.items():
            part.load_state_dict(state[name])
        start_epoch, batch, step, sums = state["epoch"], state["batch"], state["step"], state["sums"]
        if start_epoch >= args.epochs:
            say(f"{ckpt} has finished all {start_epoch} epochs: nothing to do (to train more, raise --epochs)")
            return 0
        say(f"resumed from {ckpt} at epoch {start_epoch}, batch {batch} (step {step})")
    say(
        f"running: device {device.type}, "
        f"batch {batch_size}, "
        f"in {args.accum} micro-batch(es) of {batch_size // args.accum}"
    )

    for epoch in range(start_epoch, args.epochs):
        gen.manual_seed(args.seed + 100_003 * epoch)  # the epoch's shuffle: a resumed run skips the same batches
        model.train()
        t0 = time.perf_counter()
        # What the epoch has added up so far: a resumed epoch goes on from the saved sums.
        sums, skip = (sums if sums is not None else zeros(device)), batch
        for batch, (x, y) in enumerate(loader):
            if batch < skip:
                continue  # trained before the stop this run resumes from
            # Dropout and augmentation draw from the global generator, seeded from the step: a resumed run
            # draws what an uninterrupted one would, on CPU and GPU, with no RNG state to save.
            torch.manual_seed(args.seed + 1_000_003 * step)
            x, y = augment(x, args).to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            for xs, ys in zip(x.chunk(args.accum), y.chunk(args.accum)):
                out = forward(model, xs, args)
                loss = loss_fn(out.float(), ys) / args.accum  # a mean over the whole batch once all are in
                add_batch(sums, out, ys)
                loss.backward()
            if args.clip_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            signum = STOP["signal"]
            if signum:
                if ckpt:
                    state = snapshot(model, parts, epoch=epoch, batch=batch + 1, step=step)
                    save_checkpoint(ckpt, state | {"sums": sums})
                saved = f"; checkpoint saved at {ckpt}" if ckpt else "; no --checkpoint, nothing saved"
                say(f"stopped at epoch {epoch}, step {step} ({signal.Signals(signum).name}){saved}")
                return 128 + signum
        test = evaluate(model, test_set, args)
        say(f"epoch {epoch}: train {describe(sums)} | test {describe(test)} | {time.perf_counter() - t0:.1f} s")
        batch, sums = 0, None
        if ckpt:
            state = snapshot(model, parts, epoch=epoch + 1, batch=0, step=step)
            save_checkpoint(ckpt, state | {"sums": zeros(device)})
    return 0


class Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def parse_args():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if there are GPUs")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--accum", type=int, default=1, help="micro-batches each batch is split into")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant")
    p.add_argument("--clip-grad-norm", type=float, default=0.0, help="clip the gradients' norm to this (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default="", help="save here after every epoch; resume from it if it exists")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    add_task_options(p)
    args = p.parse_args()
    if args.epochs < 1 or args.workers < 0 or args.accum < 1:
        p.error("need --epochs >= 1, --accum >= 1 and --workers >= 0")
    if args.batch_size < 1 or args.batch_size % args.accum:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --accum {args.accum}")
    if getattr(args, "samples", args.batch_size) < args.batch_size:
        p.error(f"--samples {args.samples} is less than one global batch (--batch-size {args.batch_size})")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # GPUs, not a CUDA build
    try:
        args.device = pick_device(args.device, gpus)
    except ValueError as e:
        p.error(str(e))
    return args


if __name__ == "__main__":
    main()
