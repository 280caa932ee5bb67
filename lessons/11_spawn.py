"""python lessons/11_spawn.py --world-size 2

Chapter 11, step 2 of 3: the same training as DDP, the processes started by torch.multiprocessing.spawn.

Options: --epochs 3, --batch-size 48, --dataset digits (the defaults).

The script starts --world-size processes itself: it reserves a free port on 127.0.0.1 (bound to
port 0, so the kernel picks it) and hands it to every process, which joins with a tcp:// init
method and a short timeout. Against 11_single.py it adds: DDP around the model; a DistributedSampler
(with set_epoch) so each rank trains on its share; --batch-size kept as the GLOBAL batch, so each
rank takes batch-size / world-size and every world size takes the same steps; per-rank seeds for
the augmentation; the epoch loss and the test accuracy reduced as sums and counts, the test set cut
into unpadded shards; logging on rank 0 at INFO and WARNING elsewhere; rank 0 alone saving
model.module.state_dict(), which every rank then loads and compares with its own replica (asserted).
"""

import argparse
import contextlib
import datetime
import logging
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

import lessonlib
from lessonlib import digits

MIN_ACCURACY = 0.9  # the claim: a few epochs reach at least this on the digits test set


def get_logger(rank):
    logger = logging.getLogger("ch11")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s", "%H:%M:%S"))
    logger.handlers[:], logger.propagate = [handler], False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)  # the others speak only when it matters
    return logger


def train_epoch(model, loader, opt, device, show_bar):
    """One pass over the loader; returns (sum of per-sample losses, number of samples)."""
    model.train()
    loss_sum, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for x, y in tqdm(loader, disable=not show_bar, leave=False, desc="batches"):
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here: every rank steps with their mean
        opt.step()
        loss_sum += loss.detach() * len(y)  # a sum and a count, so uneven batches weigh right
        count += len(y)
    return loss_sum.item(), count


@torch.no_grad()
def evaluate(model, loader, device):
    """(correct, seen) over the loader's samples."""
    model.eval()
    correct, seen = 0, 0
    for x, y in loader:
        correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
        seen += len(y)
    return correct, seen


def reduce_sums(*values, device):
    """Every rank's values added up, on every rank: sums and counts, never a mean of means."""
    totals = torch.tensor(values, dtype=torch.float64, device=device)  # float64: counts stay exact
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return totals.tolist()


def run(rank, world_size, port, args):
    torch.set_num_threads(args.threads)  # a model this small gains nothing from more; extra threads fight over cores
    backend = lessonlib.pick_backend(world_size)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=args.pg_timeout),  # a hang becomes an error
        device_id=device if device.type == "cuda" else None,
    )  # NCCL: this rank's GPU
    is_main = rank == 0
    log = get_logger(rank)
    torch.manual_seed(args.seed)  # the same starting weights on every rank (DDP broadcasts rank 0's anyway)

    train_set, test_set = digits.datasets(args.dataset, args.data_dir)
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler)
    shard = Subset(test_set, range(rank, len(test_set), world_size))  # no padding: each sample counted once
    test_loader = DataLoader(shard, batch_size=128)
    model = DDP(digits.small_cnn().to(device))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    torch.manual_seed(args.seed + rank)  # but each rank its own augmentation draws (chapter 4)
    log.info(
        f"{args.dataset}: {len(train_set)} train, {len(test_set)} test; batch {args.batch_size} = "
        f"{world_size} x {args.batch_size // world_size}; {backend} on {device}"
    )

    losses, start = [], time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        loss_sum, count = reduce_sums(
            *train_epoch(model, train_loader, opt, device, is_main and sys.stderr.isatty()), device=device
        )
        losses.append(loss_sum / count)
        log.info(f"epoch {epoch + 1}/{args.epochs}: train loss {losses[-1]:.4f} over {count:.0f} samples")
    seconds = time.perf_counter() - start
    correct, seen = reduce_sums(*evaluate(model, test_loader, device), device=device)
    accuracy = correct / seen
    log.info(f"test accuracy {accuracy:.4f} ({correct:.0f}/{seen:.0f}); training took {seconds:.2f} s")
    assert seen == len(test_set), f"rank {rank}: evaluated {seen} of {len(test_set)} test samples"
    assert accuracy >= MIN_ACCURACY, f"rank {rank}: test accuracy {accuracy:.4f} < {MIN_ACCURACY}"

    with tempfile.TemporaryDirectory() as mine:
        folder = [mine]
        dist.broadcast_object_list(folder, src=0)  # every rank uses rank 0's folder
        path = args.save or os.path.join(folder[0], "ch11.pt")
        if is_main:  # one writer; model.module: the keys of the plain model, without "module."
            digits.save_atomic({"model": model.module.state_dict(), "epochs": args.epochs}, path)
        dist.barrier()  # nobody reads the file before rank 0 has written all of it
        saved = torch.load(path, map_location=device)["model"]
        ours = model.module.state_dict()
        assert saved.keys() == ours.keys() and all(torch.equal(saved[k], ours[k]) for k in ours), (
            f"rank {rank}: the checkpoint differs from this rank's replica"
        )
        dist.barrier()  # rank 0 removes its folder on leaving the block: not before everyone has read
    log.info(f"saved {path}; every rank's replica equals it")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--world-size", type=int, default=2, choices=range(1, 17), metavar="1..16")
    parser.add_argument("--epochs", type=int, default=3, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--batch-size", type=int, default=48, help="samples per optimizer step, all ranks together")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="digits", choices=["digits", "mnist"])
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw/ (--dataset mnist)")
    parser.add_argument("--save", default=None, help="checkpoint path (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--pg-timeout", type=float, default=20, help="process-group timeout, seconds")
    parser.add_argument("--port", type=int, default=0, help="a fixed port, as tutorials hard-code; default: a free one")
    args = parser.parse_args()
    if args.batch_size % args.world_size:
        parser.error(f"--batch-size {args.batch_size} must divide evenly over --world-size {args.world_size}")
    # Bound to port 0: the kernel picks a free port, held until the end. A fixed --port fails if a job holds it.
    with contextlib.nullcontext(args.port) if args.port else lessonlib.reserve_port() as port:
        mp.spawn(run, args=(args.world_size, port, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
