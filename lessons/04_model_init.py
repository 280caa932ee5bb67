"""torchrun --nproc_per_node=4 lessons/04_model_init.py

How ranks come to hold the same starting weights, and why averaged gradients cannot do it for them.

Options: --modes unseeded,same-seed,seed+rank,seed+rank+ddp (the default: all four).

Every rank builds the model itself, from its own torch RNG. Without torch.manual_seed each process
starts from a different random seed, so the models differ; the same seed on every rank makes them
equal; seed + rank (what tutorials often recommend, so that augmentation differs per rank) makes them
differ again. DistributedDataParallel fixes that at construction: it broadcasts rank 0's parameters
and buffers into every rank's module, in place. Then a few SGD steps: with gradients averaged by
hand, weights that started different stay different (SGD moves them all by the same step, so the gap
between two ranks does not shrink at all); with DDP they stay equal. Each model is fingerprinted
(a hash of its parameter bytes) per rank. Claims about ranks differing are asserted for world size > 1.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib

MODES = ["unseeded", "same-seed", "seed+rank", "seed+rank+ddp"]


def build():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def fingerprint(vec):
    return hashlib.sha1(vec.numpy().tobytes()).hexdigest()[:8]


def gather(vec):
    """Every rank's copy of `vec` (same shape everywhere), as a list indexed by rank."""
    out = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
    dist.all_gather(out, vec)
    return out


def make_model(mode, seed, rank):
    if mode == "same-seed":
        torch.manual_seed(seed)
    elif mode != "unseeded":  # seed+rank and seed+rank+ddp
        torch.manual_seed(seed + rank)
    return build()  # "unseeded": whatever seed this process started with


# [start: average_by_hand]
def train(model, steps, rank, by_hand):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch, as in training
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if by_hand:  # what DDP does for gradients, and only for gradients
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()


# [end: average_by_hand]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--modes", type=lessonlib.comma_list(choices=MODES), default=",".join(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 51), metavar="1..50")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    n, r = ctx.world_size, ctx.rank

    for mode in [m for m in MODES if m in args.modes]:  # unseeded first: it needs the untouched RNG
        model = make_model(mode, args.seed, r)
        before = [p.detach().clone() for p in model.parameters()]
        if mode == "seed+rank+ddp":
            # [start: ddp_broadcast]
            ddp = DDP(model)  # CPU: no device_ids; rank 0's parameters are copied into `model` in place
            # [end: ddp_broadcast]
            overwritten = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
            assert overwritten == (r > 0 and n > 1), f"rank {r}: DDP overwrote the module: {overwritten}"
            assert ddp.module is model, f"rank {r}: DDP should wrap the very module it was given"
        copies = gather(flat(model))
        same_as_0 = torch.equal(copies[r], copies[0])
        all_equal = all(torch.equal(c, copies[0]) for c in copies)
        if mode in ("same-seed", "seed+rank+ddp"):
            assert all_equal, f"rank {r}: {mode}: models differ across ranks"
        elif n > 1:  # with one rank there is nothing to differ from
            distinct = len({c.numpy().tobytes() for c in copies}) == n
            assert distinct, f"rank {r}: {mode}: some ranks built the same model"
        lessonlib.report(
            "init",
            {
                "mode": mode,
                "fingerprint": fingerprint(copies[r]),
                "same as rank 0": same_as_0,
                "initial seed": torch.initial_seed(),
            },
        )
        if ctx.is_main:
            print(f"{mode:16} fingerprints by rank: {' '.join(fingerprint(c) for c in copies)}")

    # Why it matters: start from seed+rank weights, then train with and without DDP.
    for how in ["averaged by hand", "DDP"]:
        model = make_model("seed+rank", args.seed, r)
        start_gap = flat(model) - gather(flat(model))[0]  # this rank's distance from rank 0
        train(DDP(model) if how == "DDP" else model, args.steps, r, by_hand=how != "DDP")
        copies = gather(flat(model))
        gap = copies[r] - copies[0]
        if how == "DDP":
            assert all(torch.equal(c, copies[0]) for c in copies), f"rank {r}: DDP ranks drifted apart"
        else:
            # Every rank took the same averaged step, so the gap is what it was at the start.
            assert torch.allclose(gap, start_gap, atol=1e-5), f"rank {r}: the gap to rank 0 changed"
            assert n == 1 or len({c.numpy().tobytes() for c in copies}) == n, f"rank {r}: weights became equal"
        row = lessonlib.report(
            "after_training",
            {
                "how": how,
                "steps": args.steps,
                "fingerprint": fingerprint(copies[r]),
                "max gap to rank 0 at start": start_gap.abs().max().item(),
                "max gap to rank 0 after": gap.abs().max().item(),
            },
        )
        if r == n - 1:  # rank 0's gap to itself is zero: let the last rank tell
            print(
                f"rank {r}: {how}, {args.steps} SGD steps: fingerprints {' '.join(fingerprint(c) for c in copies)}"
                f"; max gap to rank 0 {row['max gap to rank 0 at start']:.4f} -> "
                f"{row['max gap to rank 0 after']:.4f}"
            )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
