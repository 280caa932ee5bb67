"""torchrun --nproc_per_node=2 lessons/11_torchrun.py

Chapter 11, step 3 of 3: the DDP script under torchrun, with mixed precision.

Options: --epochs 3, --batch-size 48, --dataset digits (the defaults).

Against 11_spawn.py: torchrun starts the processes and puts RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT in their environment, which lessonlib.setup reads (env://, with a short timeout), so
no spawn and no port in the script, and it also runs as plain `python` (a world of one). And AMP:
forward and loss under torch.autocast, bfloat16 on CPU and float16 on CUDA, where a GradScaler
scales the loss (bfloat16 has float32's exponent range and needs none: there the scaler is
disabled and says so). The ranks also get their own DataLoader generator (it seeds workers, if
--workers > 0). Asserted on every rank: the autocast dtype of the logits, the scaler on exactly when
CUDA is used, the accuracy threshold over every test sample counted once, and the saved
model.module.state_dict() equal to every rank's replica.
"""

import argparse
import logging
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
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


def train_epoch(model, loader, opt, scaler, amp_dtype, device, show_bar):
    """One pass over the loader; returns (sum of per-sample losses, number of samples)."""
    model.train()
    loss_sum, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for x, y in tqdm(loader, disable=not show_bar, leave=False, desc="batches"):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=amp_dtype):  # forward and loss; backward outside
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        assert logits.dtype == amp_dtype, f"autocast gave {logits.dtype} logits, not {amp_dtype}"
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces the gradients here: every rank steps with their mean
        scaler.step(opt)  # skips the step if float16 gradients overflowed
        scaler.update()
        loss_sum += loss.detach() * len(y)  # a sum and a count, so uneven batches weigh right
        count += len(y)
    return loss_sum.item(), count


@torch.no_grad()
def evaluate(model, loader, amp_dtype, device):
    """(correct, seen) over the loader's samples."""
    model.eval()
    correct, seen = 0, 0
    for x, y in loader:
        with torch.autocast(device.type, dtype=amp_dtype):
            correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
        seen += len(y)
    return correct, seen


def reduce_sums(*values, device):
    """Every rank's values added up, on every rank: sums and counts, never a mean of means."""
    totals = torch.tensor(values, dtype=torch.float64, device=device)  # float64: counts stay exact
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return totals.tolist()


def run(args):
    torch.set_num_threads(args.threads)  # a model this small gains nothing from more; extra threads fight over cores
    ctx = lessonlib.setup(timeout=args.pg_timeout)  # init_process_group("env://"): torchrun's variables
    rank, world_size, device, is_main = ctx.rank, ctx.world_size, ctx.device, ctx.is_main
    log = get_logger(rank)
    torch.manual_seed(args.seed)  # the same starting weights on every rank (DDP broadcasts rank 0's anyway)

    train_set, test_set = digits.datasets(args.dataset, args.data_dir)
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)
    loader_rng = torch.Generator().manual_seed(args.seed + rank)  # seeds the workers: rank-specific (chapter 4)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size // world_size,
        sampler=sampler,
        num_workers=args.workers,
        generator=loader_rng,
    )
    shard = Subset(test_set, range(rank, len(test_set), world_size))  # no padding: each sample counted once
    test_loader = DataLoader(shard, batch_size=128)
    model = DDP(digits.small_cnn().to(device), device_ids=[ctx.local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    torch.manual_seed(args.seed + rank)  # but each rank its own augmentation draws (chapter 4)
    # [start: amp]
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")  # float16 needs loss scaling
    assert scaler.is_enabled() == (device.type == "cuda"), f"rank {rank}: GradScaler on {device.type}"
    # [end: amp]
    log.info(
        f"{args.dataset}: {len(train_set)} train, {len(test_set)} test; batch {args.batch_size} = "
        f"{world_size} x {args.batch_size // world_size}; {ctx.backend} on {device}; autocast {amp_dtype}"
    )
    if not scaler.is_enabled():
        log.info("GradScaler: skipped: no CUDA here; bfloat16 keeps float32's exponent range, nothing underflows")

    losses, start = [], time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        loss_sum, count = reduce_sums(
            *train_epoch(model, train_loader, opt, scaler, amp_dtype, device, is_main and sys.stderr.isatty()),
            device=device,
        )
        losses.append(loss_sum / count)
        log.info(f"epoch {epoch + 1}/{args.epochs}: train loss {losses[-1]:.4f} over {count:.0f} samples")
    seconds = time.perf_counter() - start
    correct, seen = reduce_sums(*evaluate(model, test_loader, amp_dtype, device), device=device)
    accuracy = correct / seen
    log.info(f"test accuracy {accuracy:.4f} ({correct:.0f}/{seen:.0f}); training took {seconds:.2f} s")
    assert seen == len(test_set), f"rank {rank}: evaluated {seen} of {len(test_set)} test samples"
    assert accuracy >= MIN_ACCURACY, f"rank {rank}: test accuracy {accuracy:.4f} < {MIN_ACCURACY}"

    with tempfile.TemporaryDirectory() as mine:
        folder = [mine]
        dist.broadcast_object_list(folder, src=0)  # every rank uses rank 0's folder
        path = args.save or os.path.join(folder[0], "ch11.pt")
        if is_main:  # one writer; model.module: the keys of the plain model, without "module."
            digits.save_atomic(
                {
                    "model": model.module.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scaler": scaler.state_dict(),
                    "epochs": args.epochs,
                },
                path,
            )
        dist.barrier()  # nobody reads the file before rank 0 has written all of it
        saved = torch.load(path, map_location=device)["model"]
        ours = model.module.state_dict()
        assert saved.keys() == ours.keys() and all(torch.equal(saved[k], ours[k]) for k in ours), (
            f"rank {rank}: the checkpoint differs from this rank's replica"
        )
        dist.barrier()  # rank 0 removes its folder on leaving the block: not before everyone has read
    log.info(f"saved {path}; every rank's replica equals it")
    if is_main:
        lessonlib.report(
            "result",
            {
                "script": "11_torchrun",
                "world size": world_size,
                "batch per rank": args.batch_size // world_size,
                "losses": losses,
                "accuracy": accuracy,
                "train seconds": seconds,
                "steps per epoch": len(train_loader),
                "samples per epoch": count,
                "autocast": str(amp_dtype),
                "GradScaler": scaler.is_enabled(),
            },
        )
    lessonlib.teardown()  # dist.barrier(), then dist.destroy_process_group(): the pair of init_process_group


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--epochs", type=int, default=3, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--batch-size", type=int, default=48, help="samples per optimizer step, all ranks together")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="digits", choices=["digits", "mnist"])
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw/ (--dataset mnist)")
    parser.add_argument("--save", default=None, help="checkpoint path (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--pg-timeout", type=float, default=20, help="process-group timeout, seconds")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; read here only to check the batch
    if args.batch_size % world_size:
        parser.error(f"--batch-size {args.batch_size} must divide evenly over {world_size} ranks")
    run(args)


if __name__ == "__main__":
    main()
