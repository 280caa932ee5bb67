"""Small deterministic training pieces the DDP chapters share (chapter 5).

    x, y = global_batch(step, rows)   # the same rows on every rank, whatever the world size
    x_mine = x[my_rows(sizes, rank)]  # this rank's contiguous slice, for per-rank sizes `sizes`
    model = mlp(seed)                 # float64: sums in another order agree to ~1e-15
    flat_grads(model), flat_params(model), gather(vec), max_gap(a, b)

The lessons compare a data-parallel run with one process training on every rank's rows at once, so
every rank must be able to build that reference itself: the data depend on the step alone, never
on the rank or the world size.
"""

import torch
import torch.distributed as dist

DIM = 6


def global_batch(step, rows, seed=0):
    """`rows` samples of a fixed regression task, the same on every rank (float64)."""
    g = torch.Generator().manual_seed(1_000 * seed + step)
    x = torch.randn(rows, DIM, generator=g, dtype=torch.float64)
    w = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    y = (x @ w).tanh().unsqueeze(1) + 0.1 * torch.randn(rows, 1, generator=g, dtype=torch.float64)
    return x, y


def my_rows(sizes, rank):
    """The slice of a global batch that belongs to `rank` when rank r holds sizes[r] rows."""
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def mlp(seed=0, hidden=8, extra=()):
    """A float64 MLP, built from `seed` (the same on every rank); `extra` modules go after the hidden layer."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(DIM, hidden), *extra, torch.nn.Tanh(), torch.nn.Linear(hidden, 1)]
    return torch.nn.Sequential(*layers).double()


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def flat_grads(model):
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()])


def gather(vec):
    """Every rank's `vec` (same shape on all ranks), as a list indexed by rank."""
    out = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
    dist.all_gather(out, vec.contiguous())
    return out


def max_gap(a, b):
    """Largest absolute difference between two tensors, as a float."""
    return (a - b).abs().max().item()
