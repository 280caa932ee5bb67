"""torchrun --nproc_per_node=2 lessons/04_reproducible.py

A DDP training run that repeats bitwise, what quietly breaks that, and the fix.

Options: --seed 0, --epochs 3 (the defaults).

A small MLP with Dropout learns generated data; each batch gets a little random noise (a stand-in for
augmentation); the DistributedSampler shuffles per epoch. The loss of every step is all-reduced into
one curve. (i) The same seeds give the same curve and the same final weights, bit for bit. (ii) An
evaluation pass between epochs breaks that: every iter() of a DataLoader without its own generator
draws one number from the global torch RNG, which dropout and the noise also draw from, so every
later mask shifts. (iii) The fix: give every DataLoader its own torch.Generator; then the run with an
evaluation pass equals the run without. (iv) torch.use_deterministic_algorithms(True) changes
nothing here (CPU ops are deterministic already) but makes an op without a deterministic kernel raise
instead of varying. The curves are reported, so two separate launches can be compared bitwise too.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lessonlib


def make_data(n=48):
    g = torch.Generator().manual_seed(1234)  # the data set, fixed like a file on disk
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g))


# [start: loaders]
def loaders(data, seed, ctx, own_generators):
    def generator():  # the fix: DataLoaders stop drawing from the global RNG
        return torch.Generator().manual_seed(seed) if own_generators else None

    train = DataLoader(
        data,
        batch_size=4,
        generator=generator(),
        sampler=DistributedSampler(data, ctx.world_size, ctx.rank, shuffle=True, seed=seed),
    )
    evaluate = DataLoader(
        data,
        batch_size=16,
        generator=generator(),
        sampler=DistributedSampler(data, ctx.world_size, ctx.rank, shuffle=False),
    )
    return train, evaluate


# [end: loaders]


def mean_over_ranks(value):
    t = torch.tensor(value)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


def run(seed, epochs, ctx, eval_between=False, own_generators=False):
    """Train from scratch; the per-step loss curve (all-reduced) and the final parameters."""
    torch.manual_seed(seed + ctx.rank)  # per rank: different noise and dropout masks on every rank
    data = make_data()
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    )  # DDP: rank 0's initial weights everywhere
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    train, evaluate = loaders(data, seed, ctx, own_generators)
    curve = []
    for epoch in range(epochs):
        train.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        for x, y in train:
            x = x + 0.05 * torch.randn_like(x)  # augmentation: global RNG
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(mean_over_ranks(loss.item()))
        # [start: eval_pass]
        if eval_between and epoch < epochs - 1:
            model.eval()
            with torch.no_grad():  # no randomness here, yet iter(evaluate) draws from the global RNG
                for x, _ in evaluate:
                    model(x)
        # [end: eval_pass]
    return curve, torch.cat([p.detach().flatten() for p in model.parameters()])


# [start: deterministic]
def nondeterministic_op_error():
    """The first line of the error a nondeterministic op raises under use_deterministic_algorithms(True)."""
    try:
        torch.zeros(5).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))  # two writes to one slot
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


# [end: deterministic]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3, choices=range(2, 21), metavar="2..20")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    r, E = ctx.rank, args.epochs

    first, w1 = run(args.seed, E, ctx)
    second, w2 = run(args.seed, E, ctx)
    assert first == second and torch.equal(w1, w2), f"rank {r}: the same seeds gave a different run"
    steps = len(first) // E  # per epoch
    broken, _ = run(args.seed, E, ctx, eval_between=True)
    assert broken[:steps] == first[:steps], f"rank {r}: the first epoch changed before any eval pass"
    assert broken[steps] != first[steps], f"rank {r}: the step after the eval pass did not change"
    fixed, w3 = run(args.seed, E, ctx, own_generators=True)
    fixed_eval, w4 = run(args.seed, E, ctx, eval_between=True, own_generators=True)
    assert fixed == fixed_eval and torch.equal(w3, w4), f"rank {r}: with own generators the eval pass still mattered"

    torch.use_deterministic_algorithms(True)
    try:
        strict, w5 = run(args.seed, E, ctx, own_generators=True)
        error = nondeterministic_op_error()
    finally:
        torch.use_deterministic_algorithms(False)  # a global switch: leave it as found
    assert strict == fixed and torch.equal(w5, w3), f"rank {r}: deterministic mode changed the run"
    assert error is not None and "deterministic" in error, f"rank {r}: put_ did not raise: {error}"

    curves = {
        "first": first,
        "second": second,
        "eval pass": broken,
        "own generators": fixed,
        "own generators + eval pass": fixed_eval,
        "deterministic algorithms": strict,
    }
    for name, curve in curves.items():
        lessonlib.report("curve", {"run": name, "seed": args.seed, "epochs": E, "losses": curve})
    lessonlib.report("deterministic_error", error)
    if ctx.is_main:
        first_diff = next(i for i, (a, b) in enumerate(zip(first, broken)) if a != b)
        print(f"{E} epochs x {steps} steps; final loss {first[-1]:.6f} twice (bitwise equal)")
        print(f"eval pass between epochs: curve departs at step {first_diff} (epoch boundary at {steps})")
        print(f"own generators: with eval pass == without: {fixed == fixed_eval}")
        short = error.split(", but")[0]
        print(f"use_deterministic_algorithms(True): same curve; put_ raised: {short}...")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
