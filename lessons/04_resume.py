"""torchrun --nproc_per_node=2 lessons/04_resume.py

Resume from a checkpoint so that the run continues exactly as if it had never stopped.

Options: --epochs 4, --stop-after 2 (the defaults).

A small DDP run (noise from torch, `random` and numpy, dropout, per-rank seeds, a shuffling
DistributedSampler, a loader generator) trains --epochs epochs straight through. Then again, stopping
after --stop-after epochs: each rank saves model, optimizer, epoch, sampler seed and ITS OWN RNG states
(torch, random, numpy, loader generator) with torch.save into memory, everything is rebuilt with a
different seed (so a match cannot be luck), loaded, and trained to the end. Every random draw after
resume equals the straight run's, bitwise. Pitfalls, measured: skipping the RNG states (other draws),
and saving them only on rank 0 for every rank (after resume all ranks draw the same noise and masks).
One more step makes it bitwise at every world size: a new DDP's first iteration uses its initial
gradient-bucket layout, and only then rebuilds the buckets in the order gradients became ready. The
straight run is long past that rebuild, so without care the first step after resume sums gradients
laid out differently; from 3 ranks on, gloo's sum can then round differently. One throwaway
backward before loading (warm_up) puts the rebuild where it belongs.
This resumes at an epoch boundary; mid-epoch also needs the position in the epoch (batches to skip).
"""

import argparse
import hashlib
import io
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lessonlib


def build(seed, ctx):
    """Everything a run holds, made from `seed`; per-rank seeds so ranks draw different noise."""
    for seed_one in (torch.manual_seed, random.seed, np.random.seed):
        seed_one(seed + ctx.rank)
    g = torch.Generator().manual_seed(1234)  # the data set, fixed like a file on disk
    x = torch.randn(32, 8, generator=g)
    data = TensorDataset(x, x[:, :1] - x[:, 1:2])
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    )
    sampler = DistributedSampler(data, ctx.world_size, ctx.rank, shuffle=True, seed=seed)
    # The generator seeds workers, if any; without them iter() still draws from it, not from the global RNG.
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(seed + ctx.rank))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), "loader": loader}


def train(run, start, stop, curve, draws):
    model, opt, loader = run["model"], run["opt"], run["loader"]
    for epoch in range(start, stop):
        loader.sampler.set_epoch(epoch)  # the shuffle is a function of (sampler seed, epoch): no state
        for x, y in loader:
            noise = torch.randn_like(x) * random.uniform(0.02, 0.1) + np.random.normal(0, 0.02)
            draws.append(hashlib.sha1(noise.numpy().tobytes()).hexdigest())  # what this rank drew
            loss = torch.nn.functional.mse_loss(model(x + noise), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            curve.append((t / dist.get_world_size()).item())


# [start: checkpoint]
def save(run, epoch):
    name, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "model": run["model"].module.state_dict(),
        "opt": run["opt"].state_dict(),
        "epoch": epoch,
        "sampler_seed": run["loader"].sampler.seed,
        "rng": {
            "torch": torch.get_rng_state(),
            "random": random.getstate(),
            # numpy's key as a tensor: torch.load(weights_only=True) refuses ndarrays
            "numpy": (name, torch.from_numpy(key), pos, has_gauss, cached),
            "loader": run["loader"].generator.get_state(),
        },
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def load(run, blob, rng=True):
    state = torch.load(io.BytesIO(blob))  # weights_only=True, the default
    run["model"].module.load_state_dict(state["model"])
    run["opt"].load_state_dict(state["opt"])
    run["loader"].sampler.seed = state["sampler_seed"]
    if rng:
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["random"])
        name, key, pos, has_gauss, cached = state["rng"]["numpy"]
        np.random.set_state((name, key.numpy(), pos, has_gauss, cached))
        run["loader"].generator.set_state(state["rng"]["loader"])
    return state["epoch"]


# [end: checkpoint]


# [start: warm_up]
def warm_up(model):
    """One throwaway backward, before loading, so the real first step runs with rebuilt buckets."""
    model.eval()  # no dropout: no draws from the RNG (loading restores it anyway)
    model(torch.zeros(1, model.module[0].in_features)).sum().backward()  # all-reduces, on every rank
    model.train()
    model.zero_grad(set_to_none=True)


# [end: warm_up]


def weights(run):
    return torch.nn.utils.parameters_to_vector(run["model"].parameters()).detach()


def same_across_ranks(draws):
    """Fraction of steps at which every rank drew exactly the same noise (None with one rank)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, draws)
    return sum(len(set(step)) == 1 for step in zip(*everyone)) / len(draws) if len(everyone) > 1 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=4, choices=range(2, 21), metavar="2..20")
    parser.add_argument("--stop-after", type=int, default=2, choices=range(1, 20), metavar="1..19")
    args = parser.parse_args()
    if args.stop_after >= args.epochs:
        parser.error("--stop-after must be below --epochs, or there is nothing left to resume")
    ctx = lessonlib.setup(device="cpu")
    n, r, E, k = ctx.world_size, ctx.rank, args.epochs, args.stop_after

    straight, straight_draws, rows = [], [], {}
    run = build(args.seed, ctx)
    train(run, 0, E, straight, straight_draws)
    straight_weights = weights(run)
    for how in ["all RNG states", "no RNG states", "rank 0's RNG states"]:
        curve, draws = [], []
        run = build(args.seed, ctx)
        train(run, 0, k, curve, draws)
        blob = save(run, k)
        # [start: rank0_checkpoint]
        if how == "rank 0's RNG states":  # the pitfall: one checkpoint, written by rank 0, read by all
            box = [blob]
            dist.broadcast_object_list(box, src=0)
            blob = box[0]
        # [end: rank0_checkpoint]
        run = build(args.seed + 1000, ctx)  # another seed: whatever matches now came from the checkpoint
        warm_up(run["model"])
        start = load(run, blob, rng=how != "no RNG states")
        at = len(curve)
        train(run, start, E, curve, draws)
        same = torch.tensor([int(draws == straight_draws)])  # noise hashes, step by step, on every rank
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        rows[how] = {
            "resumed at step": at,
            "losses": curve,
            "same curve": curve == straight,
            "same draws": bool(same.item()),
            "max weight difference": (weights(run) - straight_weights).abs().max().item(),
            "identical draws across ranks before": same_across_ranks(draws[:at]),
            "identical draws across ranks after": same_across_ranks(draws[at:]),
        }

    good, no_rng, rank0 = rows.values()
    assert good["same draws"], f"rank {r}: after resume some rank drew other noise than the straight run"
    assert good["same curve"] and good["max weight difference"] == 0, f"rank {r}: resume is not bitwise"
    at = no_rng["resumed at step"]
    assert no_rng["losses"][:at] == straight[:at], f"rank {r}: the run changed before it was interrupted"
    assert not no_rng["same draws"] and not no_rng["same curve"], f"rank {r}: no RNG states, yet same draws"
    if n > 1:  # with one rank, rank 0's states are this rank's own: nothing to get wrong
        assert good["identical draws across ranks after"] == 0.0, f"rank {r}: ranks drew the same noise"
        assert rank0["identical draws across ranks before"] == 0.0, f"rank {r}: ranks drew the same noise"
        assert rank0["identical draws across ranks after"] == 1.0, (
            f"rank {r}: after loading rank 0's RNG states, {rank0['identical draws across ranks after']:.0%} same"
        )
    lessonlib.report("straight", {"losses": straight, "epochs": E})
    for how, row in rows.items():
        lessonlib.report("resumed", {"how": how, "stop after epoch": k, **row})
    if ctx.is_main:
        print(f"straight run: {E} epochs, {len(straight)} steps, final loss {straight[-1]:.6f}")
        for how, row in rows.items():
            same = "n/a" if n == 1 else f"{row['identical draws across ranks after']:.0%}"
            print(
                f"resumed with {how:20}: same draws {str(row['same draws']):5} same curve {str(row['same curve']):5} "
                f"max weight diff {row['max weight difference']:.1e}; identical draws across ranks after {same}"
            )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
