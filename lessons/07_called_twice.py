"""torchrun --nproc_per_node=2 lessons/07_called_twice.py

A model called twice before one backward (a GAN's discriminator on real and fake rows): gradients, buffers.

Options: --pg-timeout S (default 30).

The model: Linear(8, 16), BatchNorm1d(16), Linear(16, 1), float32, under DDP; each rank has rows of its own,
"real" and "fake" (another distribution). Each way is one training step from the same weights, checked
against every rank's own computation on a copy of the model (what DDP promises without SyncBatchNorm: the
gradient is the mean of the ranks' gradients). Asserted, on every rank:
  twice: d(real), then d(fake), one backward of the sum. No error on torch 2.14.1 (CPU). The gradients
    equal the mean of the ranks' own (1e-6). The running statistics do not: DDP broadcasts rank 0's
    buffers before EVERY forward, so rank r > 0 ends with rank 0's statistics after its real rows, then
    updated by its own fake rows (asserted: equal to that, recomputed), and the ranks end different.
  no_grad: the second forward under torch.no_grad() (the discriminator's view of a detached sample):
    the same broadcast, the same statistics as twice.
  own_buffers: DDP(..., forward_sync_buffers=False), torch 2.14.1's flag for no broadcast in forward:
    each rank keeps its own statistics (asserted), the gradients as twice. The deprecated
    broadcast_buffers=False is still accepted, with a FutureWarning (caught, reported) saying that the
    new flag, unlike the old, still syncs the buffers at construction (asserted).
  concat: one forward of cat(real, fake): one broadcast, but batch norm now normalises the real and
    the fake rows together, so the gradients differ from twice's (asserted): another model, not a fix.
  static_graph=True and find_unused_parameters=True each train 3 steps of two forwards without an
    error (asserted); find_unused_parameters warns that it found no unused parameter (in stderr).
"""

import argparse
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib

ROWS, TOL = 6, 1e-6


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))


def rows(rank, step=0):
    """This rank's real and fake rows (the fake ones from another distribution)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, 8, generator=g), 3 * torch.randn(ROWS, 8, generator=g) + 1


# [start: ways]
def step(d, real, fake, way):
    """One forward-forward-backward of discriminator d (DDP or a plain copy); the loss's gradients flow."""
    if way == "concat":  # one call: batch norm sees the real and the fake rows as one batch
        out = d(torch.cat([real, fake]))
        return F.softplus(-out[:ROWS]).mean() + F.softplus(out[ROWS:]).mean()
    on_real = d(real)
    if way == "no_grad":  # the second call without a graph (its output only scores)
        with torch.no_grad():
            on_fake = d(fake)
    else:
        on_fake = d(fake)
    return F.softplus(-on_real).mean() + F.softplus(on_fake).mean()  # a GAN discriminator's loss


# [end: ways]


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


def run(way, n, rank):
    """DDP's gradients and running statistics for `way`, and each rank's own, computed on copies."""
    options = {"forward_sync_buffers": False} if way == "own_buffers" else {}
    d = DDP(model(), **options)
    step(d, *rows(rank), way).backward()
    mine = {"grads": flat(p.grad for p in d.parameters()), "stats": flat(d.module[1].running_mean)}
    own = []
    for r in range(n):  # every rank's own computation, on a fresh copy: what no buffer broadcast gives
        m = model()
        step(m, *rows(r), way if way != "own_buffers" else "twice").backward()
        own.append({"grads": flat(p.grad for p in m.parameters()), "stats": flat(m[1].running_mean)})
    return mine, own


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    n, rank = ctx.world_size, ctx.rank
    seen = {}
    for way in ("twice", "no_grad", "own_buffers", "concat"):
        mine, own = run(way, n, rank)
        mean = sum(o["grads"] for o in own) / n
        gap = (mine["grads"] - mean).abs().max().item()
        assert gap < TOL, f"rank {rank}: {way}: gradients {gap:.1e} from the mean of the ranks' own"
        seen[way] = {"grads": mine["grads"], "stats": mine["stats"], "own stats": own[rank]["stats"], "gap": gap}
    # What DDP's broadcast before the second forward leaves: rank 0's statistics after its real rows,
    # then this rank's fake rows on top.
    m = model()
    m(rows(0)[0])  # rank 0's first forward: its statistics after the real rows
    m(rows(rank)[1])  # this rank's second forward, starting from those
    expected = flat(m[1].running_mean)
    for way in ("twice", "no_grad"):
        got = seen[way]["stats"]
        assert torch.allclose(got, expected, atol=TOL), f"rank {rank}: {way}: statistics not rank 0's + own fake rows"
        if rank > 0:
            assert not torch.allclose(got, seen[way]["own stats"]), f"rank {rank}: {way} kept its own statistics"
    own = seen["own_buffers"]
    assert torch.allclose(own["stats"], own["own stats"], atol=TOL), f"rank {rank}: own_buffers was overwritten"
    assert torch.equal(seen["twice"]["grads"], own["grads"]), f"rank {rank}: buffers changed the gradients"
    differ = (seen["concat"]["grads"] - seen["twice"]["grads"]).abs().max().item()
    assert differ > 1e-3, f"rank {rank}: concat's gradients equal twice's ({differ:.1e})"
    stats = [torch.empty_like(seen["twice"]["stats"]) for _ in range(n)]
    dist.all_gather(stats, seen["twice"]["stats"])
    assert n == 1 or not torch.allclose(stats[0], stats[1]), "the ranks' statistics agree after twice"
    # The deprecated name, and the two flags, with two forwards per step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DDP(model(), broadcast_buffers=False)
    deprecation = next(str(w.message) for w in caught if "broadcast_buffers" in str(w.message))
    assert "still syncs buffers at init" in deprecation, f"rank {rank}: the warning changed: {deprecation}"
    for flag in ("static_graph", "find_unused_parameters"):
        d = DDP(model(), **{flag: True})
        opt = torch.optim.SGD(d.parameters(), lr=0.1)
        for i in range(3):
            opt.zero_grad()
            step(d, *rows(rank, i + 1), "twice").backward()
            opt.step()
    row = {way: {"gradient gap": s["gap"], "running_mean[:3]": s["stats"][:3].tolist()} for way, s in seen.items()}
    row.update(rank=rank, expected=expected[:3].tolist(), own=seen["twice"]["own stats"][:3].tolist())
    row.update({"concat vs twice, largest gradient difference": differ, "broadcast_buffers warns": deprecation})
    lessonlib.report("called twice", row)
    print(f"rank {rank}: gradients as the ranks' own in every way; running_mean[:3] after twice {row['twice']}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
