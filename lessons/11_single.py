"""python lessons/11_single.py

Chapter 11, step 1 of 3: one process trains a small CNN on real handwritten digits.

Options: --epochs 3, --batch-size 48, --dataset digits (the defaults).

The data are scikit-learn's bundled digits (1,797 8x8 images, nothing to download) through a
torchvision pipeline with a small random affine augmentation, split into 1,440 training and 357 test
images by a fixed seed (lessonlib.digits); `--dataset mnist --data-dir DIR` reads MNIST files you
already have. The script logs the loss of every epoch, the test accuracy and the training time, and
asserts that the accuracy reaches the stated threshold. It saves the weights atomically at the end.
The next two steps (11_spawn.py, 11_torchrun.py) turn it into DDP with small diffs.
This script is one process: under torchrun with WORLD_SIZE > 1 it refuses (see main).
"""

import argparse
import logging
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from lessonlib import digits

MIN_ACCURACY = 0.9  # the claim: a few epochs reach at least this on the digits test set


def get_logger():
    logger = logging.getLogger("ch11")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.handlers[:], logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    return logger


# [start: train_epoch]
def train_epoch(model, loader, opt, device, show_bar):
    """One pass over the loader; returns (sum of per-sample losses, number of samples)."""
    model.train()
    loss_sum, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for x, y in tqdm(loader, disable=not show_bar, leave=False, desc="batches"):
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.detach() * len(y)  # a sum and a count, so uneven batches weigh right
        count += len(y)
    return loss_sum.item(), count


# [end: train_epoch]


@torch.no_grad()
def evaluate(model, loader, device):
    """(correct, seen) over the loader's samples."""
    model.eval()
    correct, seen = 0, 0
    for x, y in loader:
        correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
        seen += len(y)
    return correct, seen


def run(args):
    torch.set_num_threads(args.threads)  # a model this small gains nothing from more; extra threads fight over cores
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log = get_logger()
    torch.manual_seed(args.seed)  # the weights, the shuffle and the augmentation all draw from it

    train_set, test_set = digits.datasets(args.dataset, args.data_dir)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=128)
    model = digits.small_cnn().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    log.info(f"{args.dataset}: {len(train_set)} train, {len(test_set)} test; batch {args.batch_size}; {device}")

    losses, start = [], time.perf_counter()
    for epoch in range(args.epochs):
        loss_sum, count = train_epoch(model, train_loader, opt, device, sys.stderr.isatty())
        losses.append(loss_sum / count)
        log.info(f"epoch {epoch + 1}/{args.epochs}: train loss {losses[-1]:.4f} over {count:.0f} samples")
    seconds = time.perf_counter() - start
    correct, seen = evaluate(model, test_loader, device)
    accuracy = correct / seen
    log.info(f"test accuracy {accuracy:.4f} ({correct:.0f}/{seen:.0f}); training took {seconds:.2f} s")
    assert seen == len(test_set), f"evaluated {seen} of {len(test_set)} test samples"
    assert accuracy >= MIN_ACCURACY, f"test accuracy {accuracy:.4f} < {MIN_ACCURACY}"

    with tempfile.TemporaryDirectory() as folder:
        path = args.save or os.path.join(folder, "ch11.pt")
        digits.save_atomic({"model": model.state_dict(), "epochs": args.epochs}, path)
        saved = torch.load(path, map_location=device)["model"]
        ours = model.state_dict()
        assert saved.keys() == ours.keys() and all(torch.equal(saved[k], ours[k]) for k in ours), (
            "the checkpoint differs from the model"
        )
    log.info(f"saved {path}; the model equals it")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--epochs", type=int, default=3, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--batch-size", type=int, default=48, help="samples per optimizer step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="digits", choices=["digits", "mnist"])
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw/ (--dataset mnist)")
    parser.add_argument("--save", default=None, help="checkpoint path (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # N copies would each train on everything, and race to save
        parser.error(
            f"this script is one process, but WORLD_SIZE={os.environ['WORLD_SIZE']} (torchrun?): "
            "run it with python, or use lessons/11_spawn.py or lessons/11_torchrun.py for several ranks"
        )
    run(args)


if __name__ == "__main__":
    main()
