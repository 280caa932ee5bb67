"""torchrun --nproc_per_node=4 lessons/06_lr_scaling.py

Batch size and learning rate: the per-rank batch, the global batch, the linear scaling rule and warm-up.

Options: --batch 16, --epochs 4, --lr 0.02 (the defaults).

With a DistributedSampler and a DataLoader batch of b, one step of N ranks uses N x b rows: the
global batch is N times the single-process one, and an epoch has N times fewer steps. Keep the
single-process learning rate and the run makes less progress per epoch than one process; the rate
times N makes more than the unscaled rate (both asserted here, for N > 1, on a task where the
learning rate is small enough to be the bottleneck). The linear scaling rule (Goyal
et al., 2017) multiplies the learning rate by N to make up for the fewer steps; warm-up ramps it from
the single-process value to N times that over the first steps, because a large rate is most
dangerous at the start. The schedule is asserted, and that warm-up starts behind the scaled run and,
by the last of 3 or more epochs, is within a quarter of its first-epoch gap; each run's loss after
every epoch is reported. To reproduce one process with batch B exactly instead, give each rank B / N
rows and keep the rate (chapter 5's equivalence).
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lessonlib
from lessonlib.training import global_batch, mlp

ROWS = 1024


# [start: warmup]
def warmup(opt, base_lr, factor, warmup_steps):
    """Linear warm-up from base_lr to factor x base_lr over warmup_steps, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 1 + (factor - 1) * min(step, warmup_steps) / warmup_steps
    )


# [end: warmup]


def train(ctx, data, batch, lr, epochs, distributed, factor=1.0, warmup_steps=0):
    """Loss on all rows after every epoch, the learning rates used, and steps per epoch."""
    model = mlp(seed=0)
    if distributed:
        model = DDP(model)
        sampler = DistributedSampler(data, shuffle=True, seed=0)  # each rank: 1/N of the rows
    else:
        sampler = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=lr * (1 if warmup_steps else factor))
    schedule = warmup(opt, lr, factor, warmup_steps) if warmup_steps else None
    losses, lrs = [], []
    x_all, y_all = data.tensors
    for epoch in range(epochs):
        if distributed:
            sampler.set_epoch(epoch)
        for x, y in loader:
            lrs.append(opt.param_groups[0]["lr"])
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            if schedule:
                schedule.step()
        with torch.no_grad():
            losses.append(F.mse_loss(model(x_all), y_all).item())
    return {"losses": losses, "lrs": lrs, "steps per epoch": len(loader)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--batch", type=int, default=16, choices=range(1, 129), metavar="1..128", help="rows per rank per step (b)"
    )
    parser.add_argument("--epochs", type=int, default=4, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--lr", type=float, default=0.02, help="the single-process learning rate (0 < lr <= 0.05)")
    args = parser.parse_args()
    if not 0 < args.lr <= 0.05:
        parser.error(
            f"--lr {args.lr}: use a rate in (0, 0.05]; the lesson's comparison assumes a rate small "
            "enough to be what limits progress"
        )
    ctx = lessonlib.setup(device="cpu")
    n, b = ctx.world_size, args.batch
    data = TensorDataset(*global_batch(0, ROWS))

    # [start: runs]
    runs = {
        "1 process, batch b, lr": train(ctx, data, b, args.lr, args.epochs, distributed=False),
        "N ranks, batch b each, lr": train(ctx, data, b, args.lr, args.epochs, True),
        "N ranks, lr x N": train(ctx, data, b, args.lr, args.epochs, True, factor=n),
        "N ranks, lr x N, warm-up": train(
            ctx, data, b, args.lr, args.epochs, True, factor=n, warmup_steps=math.ceil(ROWS / (n * b))
        ),  # one epoch
    }
    # [end: runs]
    single, same_lr, scaled, warm = runs.values()
    assert single["steps per epoch"] == math.ceil(ROWS / b)
    assert same_lr["steps per epoch"] == math.ceil(math.ceil(ROWS / n) / b), same_lr["steps per epoch"]
    w = warm["steps per epoch"]
    expected = [args.lr * (1 + (n - 1) * min(s, w) / w) for s in range(len(warm["lrs"]))]
    assert all(abs(a - e) < 1e-12 for a, e in zip(warm["lrs"], expected)), "warm-up schedule is off"
    if n > 1:
        assert same_lr["losses"][-1] > single["losses"][-1], (
            f"N ranks at the same lr should lag one process here: {same_lr['losses']} vs {single['losses']}"
        )
        assert scaled["losses"][-1] < same_lr["losses"][-1], (
            f"lr x {n} should beat the unscaled rate here: {scaled['losses']} vs {same_lr['losses']}"
        )
        gaps = [wl - sl for wl, sl in zip(warm["losses"], scaled["losses"])]  # warm-up behind the scaled run
        assert len(gaps) < 3 or gaps[0] > 0 and abs(gaps[-1]) < gaps[0] / 4, (
            f"warm-up should start behind the scaled run and, after 3 epochs or more, nearly catch up: {gaps}"
        )
    for name, run in runs.items():
        row = lessonlib.report("runs", {"run": name, "world size": n, **run})
        if ctx.is_main:
            print(
                f"{name:28} {run['steps per epoch']:3} steps/epoch, lr {run['lrs'][0]:.3f}->{run['lrs'][-1]:.3f}, "
                f"loss by epoch {' '.join(f'{v:.4f}' for v in row['losses'])}"
            )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
