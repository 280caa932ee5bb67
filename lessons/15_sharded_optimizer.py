"""torchrun --nproc_per_node=3 lessons/15_sharded_optimizer.py

ShardedOptimizer(params, optimizer_cls, **kwargs): each rank keeps the optimizer's state for its share only.

Options: --steps 10 (the default); --pg-timeout S (default 30).

The model, TinyLM (float64 here): embed, + shift (a buffer), three Linear + Tanh blocks, fixed (a frozen
Linear), norm (LayerNorm), head, whose weight IS embed.weight (tied); its gradients are averaged by torch's
DDP (as ZeroRedundancyOptimizer expects). The matrices form one parameter group (AdamW, weight decay 0.1,
the frozen one included: AdamW skips it); the vectors are added afterwards with add_param_group, weight
decay 0. ShardedOptimizer flattens each group's trainable parameters into one vector, zero-padded to
N * ceil(P_g / N) elements, and builds optimizer_cls on this rank's slice alone; step() takes that slice of
the gradients, steps it, and all-gathers the updated slices into every rank's weights. Asserted on every
rank, after --steps steps on its rows of a global batch:
1. the weights equal one process's AdamW on the whole batch, and ZeroRedundancyOptimizer's, within TOL
   (the frozen weight unchanged);
2. this rank's optimizer state is chapter 13's formula, per group: per_rank_bytes(P_g, N, "zero1") with
   16 bytes per element (AdamW's two float64 moments), plus one 4-byte step per group, on every rank alike;
3. ZeroRedundancyOptimizer partitions whole parameters instead (largest first, each to the rank that holds
   least so far): its rank holds 16 bytes per element of the parameters it was given, plus a step each.
   Its total over the ranks is exactly the unsharded state; per rank it is uneven (a rank holds the
   embedding's whole state, and no parameter is split to even it out);
4. each step makes one all-gather per group, of this rank's slice (lessonlib.sharding.Traffic).
"""

import argparse
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import lessonlib
from lessonlib.sharding import Traffic, held, optimizer_state, per_rank_bytes
from lessonlib.training import flat_params, max_gap

ROWS, LR, DECAY, VOCAB, DIM = 4, 1e-2, 0.1, 31, 16  # tokens per rank and step; AdamW's; the model's sizes
# torch 2.14's name; torch 2.11 (a GPU machine's, maybe) has only the old one, deprecated since
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
TOL = 1e-12  # float64: the mean gradient summed in another order (measured: 0 to 2e-16)
STEP_BYTES = 4  # AdamW's `step`: a float32 scalar per parameter it updates


# [start: tiny_lm]
class TinyLM(torch.nn.Module):
    """head.weight is embed.weight (tied); `fixed` is frozen; `shift` is a buffer. float32 (.double() here)."""

    def __init__(self, seed=0, vocab=VOCAB, dim=DIM):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.register_buffer("shift", torch.randn(dim))
        self.blocks = torch.nn.Sequential(
            *(torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh()) for _ in range(3))
        )
        self.fixed = torch.nn.Linear(dim, dim).requires_grad_(False)
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(torch.tanh(self.fixed(self.blocks(self.embed(ids) + self.shift)))))


# [end: tiny_lm]


def batch(step, n, rank=None):
    """Step `step`'s tokens and next tokens: every rank's (rank None), or rank's ROWS of them."""
    g = torch.Generator().manual_seed(step)
    ids, targets = torch.randint(VOCAB, (2, ROWS * n), generator=g)
    mine = slice(None) if rank is None else slice(rank * ROWS, (rank + 1) * ROWS)
    return ids[mine], targets[mine]


def piece(tensors, world_size, rank, device=None):
    """Rank `rank`'s slice of `tensors` flattened into one vector, zero-padded to N * ceil(P / N) elements."""
    flat = torch.cat([t.detach().flatten() for t in tensors] or [torch.zeros(0, device=device)])
    flat = F.pad(flat, (0, -flat.numel() % world_size))
    return flat.view(world_size, flat.numel() // world_size)[rank]


def slice_of_grads(params, mine, rank, out=None):
    """This rank's slice of the params' flat gradients, copied into `out` (reused when given; zero where a
    parameter has no gradient, and in the padding): no temporary as large as the parameters."""
    out = torch.zeros_like(mine) if out is None else out.zero_()
    start, end, at = rank * mine.numel(), (rank + 1) * mine.numel(), 0
    for p in params:
        lo, hi = max(start, at), min(end, at + p.numel())  # the part of p inside this rank's slice
        if lo < hi and p.grad is not None:
            out[lo - start : hi - start] = p.grad.reshape(-1)[lo - at : hi - at]
        at += p.numel()
    return out


# [start: sharded]
class ShardedOptimizer(torch.optim.Optimizer):
    """optimizer_cls on this rank's slice of each parameter group; step() updates the slice, then every rank.

    The gradients must be averaged already (by DDP, as for torch's ZeroRedundancyOptimizer). A frozen
    parameter is never updated, so it gets no slice. A trainable one without a gradient counts as zero where
    others in its group have one (torch's AdamW would skip it: a flat slice is stepped whole).
    """

    whole_flat_gradient = False  # True: the first version, which made the whole padded flat gradient to slice it

    def __init__(self, params, optimizer_cls, **kwargs):
        self.optimizer_cls, self.local, self.slices = optimizer_cls, None, []
        super().__init__(params, defaults=kwargs)  # calls add_param_group for each group

    def add_param_group(self, group):
        super().add_param_group(group)  # checks the group and fills in the defaults
        group, n, rank = self.param_groups[-1], dist.get_world_size(), dist.get_rank()
        params = [p for p in group["params"] if p.requires_grad]
        device = group["params"][0].device if group["params"] else None  # every tensor made here lives there
        mine = piece(params, n, rank, device).clone().requires_grad_()  # my slice, a tensor of its own
        options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        if self.local is None:  # the optimizer whose state is this rank's only
            self.local = self.optimizer_cls([{"params": [mine], **options}])
        else:
            self.local.add_param_group({"params": [mine], **options})
        self.slices.append((params, mine))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        n, rank = dist.get_world_size(), dist.get_rank()
        for group, local, (params, mine) in zip(self.param_groups, self.local.param_groups, self.slices):
            local.update({k: v for k, v in group.items() if k not in ("params", "param_names")})  # a scheduler's lr
            if all(p.grad is None for p in params):
                mine.grad = None
            elif self.whole_flat_gradient:  # two whole-size temporaries (cat, then pad) for one slice
                grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
                mine.grad = piece(grads, n, rank).clone()
            else:  # copied from each .grad straight into the slice's buffer, the last step's reused
                mine.grad = slice_of_grads(params, mine, rank, mine.grad)
        self.local.step()  # state (AdamW: two moments and a step) for my slices only
        for params, mine in self.slices:
            full = mine.new_empty(n * mine.numel())  # the one whole-size temporary left: every rank's slice
            all_gather_single(full, mine.detach())  # every rank's updated slice
            sizes = [p.numel() for p in params]
            for p, part in zip(params, full[: sum(sizes)].split(sizes)):  # the padding at the end stays out
                p.copy_(part.view_as(p))
        return loss

    def state_dict(self):
        raise NotImplementedError("each rank holds a slice of the state: gather it first (torch's ZeRO does)")


# [end: sharded]


# [start: groups]
def build(kind):
    """TinyLM (under DDP but for one process), and an optimizer of `kind`: the matrices, decayed, then the
    vectors (biases, LayerNorm's), added as a second group without decay."""
    model = TinyLM(seed=0).double()
    model = model if kind == "alone" else DDP(model)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}
    if kind == "sharded":
        opt = ShardedOptimizer(matrices, torch.optim.AdamW, lr=LR, weight_decay=DECAY)
    elif kind == "zero":
        opt = ZeroRedundancyOptimizer(matrices, optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=DECAY)
    else:
        opt = torch.optim.AdamW(matrices, lr=LR, weight_decay=DECAY)
    opt.add_param_group(vectors)
    return model, opt


# [end: groups]


# [start: peak]
class Peak(TorchDispatchMode):
    """The most bytes of storage made inside the block and alive at once, on any device: every op's output
    whose storage is none of its inputs' (a view or an in-place write makes none) counts until it is freed."""

    def __enter__(self):
        self.live, self.peak, self.tracked = 0, 0, set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = lambda xs: [t for x in xs for t in (x if isinstance(x, (list, tuple)) else [x]) if torch.is_tensor(t)]  # noqa: E731
        given = {t.untyped_storage().data_ptr() for t in tensors([*args, *(kwargs or {}).values()])}
        for t in tensors(out if isinstance(out, (list, tuple)) else [out]):
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in given | self.tracked:
                self.tracked.add(storage.data_ptr())
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, storage.data_ptr(), storage.nbytes())  # when it is freed
        return out

    def _freed(self, pointer, nbytes):
        self.tracked.discard(pointer)
        self.live -= nbytes


# [end: peak]


def train(kind, steps, n, rank=None):
    """`steps` AdamW steps on `rank`'s rows (every rank's rows when rank is None); the model, the optimizer,
    the collectives of the last step's optimizer.step() and the peak bytes it made. kind "fresh": ShardedOptimizer
    with whole_flat_gradient."""
    model, opt = build("sharded" if kind == "fresh" else kind)
    opt.whole_flat_gradient = kind == "fresh"
    for step in range(steps):
        ids, targets = batch(step, n, rank)
        opt.zero_grad()
        F.cross_entropy(model(ids), targets).backward()
        with Traffic() as traffic, Peak() as peak:
            opt.step()
    return model, opt, traffic, peak.peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=10, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    n, rank = ctx.world_size, ctx.rank
    alone, ref, *_ = train("alone", args.steps, n)  # one process: every rank's rows
    runs = {kind: train(kind, args.steps, n, rank) for kind in ("sharded", "fresh", "zero")}
    # [start: check]
    (model, opt, traffic, peak), (zmodel, zopt, *_) = runs["sharded"], runs["zero"]
    gaps = {"one process": max_gap(flat_params(model), flat_params(alone))}
    gaps["ZeroRedundancyOptimizer"] = max_gap(flat_params(model), flat_params(zmodel))
    for what, gap in gaps.items():
        assert gap < TOL, f"rank {rank}: after {args.steps} steps the weights are {gap:.1e} from {what}'s"
    sizes = [sum(p.numel() for p in g["params"] if p.requires_grad) for g in opt.param_groups]  # P_g
    mine = held(optimizer_state(opt.local))
    want = sum(per_rank_bytes(p, n, "zero1", state_bytes=16)["optimizer state"] + STEP_BYTES for p in sizes)
    assert mine == want, f"rank {rank}: ShardedOptimizer holds {mine} B of state, chapter 13's formula {want} B"
    theirs = held(optimizer_state(zopt.optim))  # ZeroRedundancyOptimizer's AdamW: this rank's whole parameters
    given = [p for g in zopt.optim.param_groups for p in g["params"] if p.requires_grad]
    assert theirs == sum(16 * p.numel() + STEP_BYTES for p in given), f"rank {rank}: ZeRO holds {theirs} B"
    every = [None] * n
    dist.all_gather_object(every, (mine, theirs, sorted(p.numel() for p in given)))
    unsharded = held(optimizer_state(ref))
    assert sum(t for _, t, _ in every) == unsharded, f"rank {rank}: ZeRO's ranks hold {every}, AdamW {unsharded}"
    assert n == 1 or len({t for _, t, _ in every}) > 1, f"rank {rank}: ZeRO's split came out even: {every}"
    slices = [opt.local.param_groups[i]["params"][0] for i in range(len(sizes))]
    payload = sum(s.numel() * s.element_size() for s in slices)
    assert dict(traffic.calls) == {"all_gather": len(sizes)}, f"rank {rank}: step() called {dict(traffic.calls)}"
    assert traffic.payload["all_gather"] == payload, f"rank {rank}: all-gathered {traffic.payload}, want {payload}"
    # [end: check]
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    first = runs["fresh"][3]  # the first version's step(), which made the whole flat gradient
    assert peak < first, f"rank {rank}: step() made {peak} B at its peak, the first version {first} B"
    print(f"rank {rank}: step() made at most {peak} B at once, the first version {first} B; parameters {params} B")
    lessonlib.report(
        "state",
        {"rank": rank, "sharded": mine, "zero": theirs, "zero elements": every[rank][2]}
        | {"peak": peak, "first version's peak": first, "parameter bytes": params},
    )
    if ctx.is_main:
        lessonlib.report("summary", {"world_size": n, "unsharded": unsharded, "groups": sizes, "gaps": gaps})
        gaps = ", ".join(f"{k} {v:.0e}" for k, v in gaps.items())
        print(f"P = {sum(sizes)} (groups {sizes}); unsharded AdamW state {unsharded} B; weights from {gaps}")
        for r, (m, t, elems) in enumerate(every):
            print(f"  rank {r}: ShardedOptimizer {m} B, ZeroRedundancyOptimizer {t} B (whole parameters {elems})")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
