"""torchrun --nproc_per_node=4 lessons/13_zero2.py

ZeRO-2 by hand: each bucket's gradients reduce-scattered as soon as backward has made them, then freed.

Options: --blocks 6; --width 96; --steps 3; --pg-timeout S.

The model: --blocks equal blocks (Linear + Tanh), float32, Adam; rank r trains on its rows of a global
batch. Each block's weight and bias are one bucket (backward makes them together, the last block first).
Two ways to split the gradients and the optimizer state over N ranks, each bucket cut into N padded
slices and rank r's Adam built on its slices alone:
  zero1: backward keeps every gradient whole; after it, each bucket is flattened and reduce-scattered.
  zero2: a post-accumulate-grad hook on every parameter notices when a bucket's gradients are all
    there, flattens and reduce-scatters them at once, keeps this rank's slice and sets the whole
    gradients to None: backward never holds more than a bucket or two of whole gradients.
After the step, each bucket's updated slices are all-gathered into every rank's weights. Measured
before every reduce-scatter and after backward: the bytes of gradients alive (whole .grad tensors,
flat buckets and this rank's slices, each storage once). Asserted: zero1's peak holds every gradient
whole (M bytes, the model's) plus one flat bucket; zero2's, at the last bucket, that bucket's whole
gradients and flat copy plus the other buckets' slices (2 M/L + (L-1) M/(L N), padded), and after
backward both hold only the slices (M/N, padded); both send the same
bytes (within 2%); both end with bitwise the same weights, those of one process on the global batch
(within GAP: Adam amplifies the rounding of a gradient close to 0).
"""

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lessonlib
from lessonlib.sharding import Traffic, held

ROWS, LR = 4, 1e-2  # rows per rank and step; Adam's rate
# Against one process, float32 sums in another order: Adam divides each update by the root of its second
# moment, so a gradient element close to 0 moves by more than its rounding (measured: 1e-7 to 3.4e-5).
GAP = 1e-4
TOL = 0.02  # bytes sent, zero2 against zero1: gloo's headers


def blocks(n_blocks, width):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(n_blocks)]
    )


class Sharded:
    """Buckets (a block's parameters each), this rank's slice of each, and Adam on the slices."""

    def __init__(self, net, stage):
        self.n, self.rank, self.stage = dist.get_world_size(), dist.get_rank(), stage
        self.buckets = [list(block.parameters()) for block in reversed(net)]  # the order backward makes them
        sizes = [sum(p.numel() for p in b) for b in self.buckets]
        self.slices = [torch.zeros(math.ceil(s / self.n), requires_grad=True) for s in sizes]
        for bucket, mine in zip(self.buckets, self.slices):
            with torch.no_grad():
                mine.copy_(self.flat(bucket, "data").view(self.n, -1)[self.rank])
        self.opt = torch.optim.Adam(self.slices, lr=LR)
        self.peak, self.flats = 0, []
        self.bucket_of = {p: k for k, b in enumerate(self.buckets) for p in b}
        if stage == 2:
            for p in self.bucket_of:
                p.register_post_accumulate_grad_hook(self.ready)

    def flat(self, bucket, attr):
        """The bucket's .data or .grad, flattened and zero-padded to N equal slices."""
        flat = torch.cat([getattr(p, attr).detach().flatten() for p in bucket])
        return F.pad(flat, (0, self.n * math.ceil(flat.numel() / self.n) - flat.numel()))

    def alive(self):
        grads = [p.grad for p in self.bucket_of if p.grad is not None]
        return held(grads + self.flats + [s.grad for s in self.slices if s.grad is not None])

    # [start: zero2]
    def ready(self, p):
        """A post-accumulate-grad hook: once the bucket of p has every gradient, reduce-scatter it."""
        bucket = self.buckets[self.bucket_of[p]]
        if all(q.grad is not None for q in bucket):
            self.reduce(self.bucket_of[p])
            for q in bucket:
                q.grad = None  # the whole gradients go: this rank keeps only its slice

    def reduce(self, k):
        self.flats = [self.flat(self.buckets[k], "grad")]
        self.peak = max(self.peak, self.alive())  # the moment before the reduce-scatter: the most alive
        mine = torch.empty_like(self.slices[k])
        dist.reduce_scatter_single(mine, self.flats[0])  # my slice of the sum over ranks
        self.slices[k].grad = mine / self.n
        self.flats = []

    # [end: zero2]

    def step(self):
        if self.stage == 1:  # the gradients waited whole until now
            for k in range(len(self.buckets)):
                self.reduce(k)
                for q in self.buckets[k]:
                    q.grad = None
        after = self.alive()  # after backward and the reduce-scatters: only this rank's slices
        self.opt.step()
        self.opt.zero_grad()
        for bucket, mine in zip(self.buckets, self.slices):
            full = torch.empty(self.n * mine.numel())
            dist.all_gather_single(full, mine.detach())
            with torch.no_grad():
                offset = 0
                for p in bucket:
                    p.copy_(full[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        return after


def run(stage, ctx, args):
    net = blocks(args.blocks, args.width)
    sharded = Sharded(net, stage)
    rows = slice(ROWS * ctx.rank, ROWS * (ctx.rank + 1))
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(ROWS * ctx.world_size, args.width, generator=g) for _ in range(2))
        sharded.peak = 0
        with Traffic() as traffic:
            F.mse_loss(net(x[rows]), y[rows]).backward()
            after = sharded.step()
    return net, {"peak": sharded.peak, "after backward": after, "sent": traffic.sent, "calls": dict(traffic.calls)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--blocks", type=int, default=6, choices=range(2, 33), metavar="2..32")
    parser.add_argument("--width", type=int, default=96, choices=range(12, 1025, 12), metavar="12..1024 (x12)")
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--pg-timeout", type=float, help="seconds a collective may wait (default 30)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout or 30)
    n, rank, L = ctx.world_size, ctx.rank, args.blocks
    bucket = 4 * args.width * (args.width + 1)  # a block's float32 gradient bytes
    m, part = L * bucket, 4 * math.ceil(bucket / 4 / n)  # the model's bytes; one bucket's slice
    alone = blocks(L, args.width)
    opt = torch.optim.Adam(alone.parameters(), lr=LR)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(ROWS * n, args.width, generator=g) for _ in range(2))
        opt.zero_grad()
        F.mse_loss(alone(x), y).backward()
        opt.step()
    rows = {}
    for stage in (1, 2):
        net, row = run(stage, ctx, args)
        gap = max((p - q).abs().max().item() for p, q in zip(net.parameters(), alone.parameters()))
        assert gap < GAP, f"rank {rank}: zero{stage}: weights {gap:.1e} from one process's"
        assert row["calls"] == {"reduce_scatter": L, "all_gather": L}, f"rank {rank}: zero{stage}: {row['calls']}"
        assert row["after backward"] == L * part, f"rank {rank}: zero{stage}: {row['after backward']} B after backward"
        rows[stage] = {**row, "gap": gap, "weights": torch.cat([p.detach().flatten() for p in net.parameters()])}
    one, two = rows[1], rows[2]
    assert torch.equal(one.pop("weights"), two.pop("weights")), f"rank {rank}: zero1 and zero2 differ"
    # zero1: every whole gradient, the flat copy of the first bucket, no slice yet
    assert one["peak"] == m + n * part, f"rank {rank}: zero1's peak {one['peak']} B, want M + a flat bucket"
    # zero2: at the last bucket, its whole gradients and their flat copy, and the slices of the others
    assert two["peak"] == 2 * bucket + (L - 1) * part, f"rank {rank}: zero2's peak {two['peak']} B"
    if one["sent"] is not None and n > 1:
        ratio = two["sent"] / one["sent"]
        assert abs(ratio - 1) <= TOL, f"rank {rank}: zero2 sent {ratio:.3f}x zero1's bytes"
    for stage, row in rows.items():
        lessonlib.report("zero2", {"stage": stage, "rank": rank, "model": m, "bucket": bucket, "slice": part, **row})
        in_m = {k: f"{row[k] / m:.3f} M" for k in ("peak", "after backward")}
        print(f"rank {rank} zero{stage}: gradient bytes alive: peak {in_m['peak']}, after {in_m['after backward']}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
