"""torchrun --nproc_per_node=2 lessons/15_naive_ddp.py

NaiveDDP(module): data parallelism built by hand, checked against one process and against torch's DDP.

Options: --steps 3 (the default), --pg-timeout S (default 30).

The model, TiedNet (float64): inp -> BatchNorm (used with its running statistics: buffers) -> enc ->
dec -> fixed -> out, where dec.weight IS enc.weight (tied: one tensor, two modules) and `fixed` is
frozen but used. Every rank builds it from its own seed, as a forgotten seed would, so that nothing
agrees until the wrapper makes it. Asserted, on every rank:
1. At N > 1 every parameter and buffer differs from rank 0's before NaiveDDP(model) and equals it
   after: the frozen weight and the running statistics too. torch's DDP broadcasts the frozen one too.
2. The bug first: averaging by walking the modules meets the tied weight twice. Divided once per
   visit, summed once, its gradient comes out N times too small (exactly 1/N of one process's
   within 1e-12, the others right) and it is sent twice: the all_reduce payload is the trainable
   bytes plus the tied weight's (counted by lessonlib.sharding.Traffic).
3. NaiveDDP's gradients after finish_gradient_synchronization(), at every one of --steps SGD steps,
   and its weights after them, equal one process on every rank's rows and torch's DDP within TOL;
   the frozen weight gets no gradient and is never sent (payload = the trainable bytes, once each).
TiedNet, reference() and train() are shared with the other chapter 15 lessons (loaded by path).
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.sharding import Traffic
from lessonlib.training import DIM, gather, global_batch, max_gap, my_rows

ROWS, LR = 4, 0.1  # rows per rank and step; SGD's learning rate
TOL = 1e-12  # float64: one process and N ranks add in another order; measured gaps are ~1e-16


# [start: tied_net]
class TiedNet(torch.nn.Module):
    """float64. dec.weight is enc.weight; `fixed` is frozen but used; `norm` keeps running statistics (buffers)."""

    def __init__(self, seed=0, hidden=8):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.norm = torch.nn.Linear(DIM, hidden), torch.nn.BatchNorm1d(hidden)
        self.enc, self.dec = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, hidden)
        self.dec.weight = self.enc.weight  # tied: one tensor that two modules hold
        self.fixed = torch.nn.Linear(hidden, hidden).requires_grad_(False)  # frozen, yet part of the forward
        self.out = torch.nn.Linear(hidden, 1)
        with torch.no_grad():  # as if trained already: each seed its own
            for t in (self.norm.weight, self.norm.bias, self.norm.running_mean):
                t.normal_()
            self.norm.running_var.uniform_(0.5, 2.0)
            self.norm.num_batches_tracked.fill_(seed)
        self.double().train()

    def train(self, mode=True):
        super().train(mode)
        # Normalize with the running statistics: a row's output does not depend on the rows beside it, so N
        # ranks can equal one process exactly (BatchNorm on batch statistics is chapter 7's SyncBatchNorm).
        self.norm.eval()
        return self

    def forward(self, x):
        h = torch.tanh(self.norm(self.inp(x)))
        h = torch.tanh(self.dec(torch.tanh(self.enc(h))))
        return self.out(torch.tanh(self.fixed(h)))


# [end: tied_net]


def state(model):
    """Every parameter and buffer, flat, in float64: what the ranks must agree on."""
    return torch.cat([t.detach().double().flatten() for t in [*model.parameters(), *model.buffers()]])


def trainable_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def train(model, steps, world_size, rank=None, sync=lambda: None):
    """`steps` SGD steps on `rank`'s rows (every rank's rows when rank is None: one process), calling `sync`
    after each backward(): each step's gradients (name -> tensor) and the weights after the last step."""
    grads = []
    for step in range(steps):
        x, y = global_batch(step, ROWS * world_size)  # the same global batch on every rank
        if rank is not None:
            x, y = x[my_rows([ROWS] * world_size, rank)], y[my_rows([ROWS] * world_size, rank)]
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        sync()
        named = getattr(model, "module", model).named_parameters()  # a wrapper's names without "module."
        grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return grads, state(model)


def reference(steps, world_size):
    """One process: rank 0's model (seed 0) on every rank's rows at once."""
    return train(TiedNet(seed=0), steps, world_size)


def grad_gap(a, b):
    """Largest difference between two steps' gradients (dicts by name), and the names must agree."""
    assert a.keys() == b.keys(), f"gradients for {sorted(a)} and for {sorted(b)}"
    return max(max_gap(a[n], b[n]) for n in a)


# [start: walking]
def average_walking(model, world_size):
    """A common first version: every module's own gradients, divided, then summed in one message."""
    grads = [p.grad for m in model.modules() for p in m.parameters(recurse=False) if p.requires_grad]
    for g in grads:  # enc.weight's gradient is here twice: enc holds it, and so does dec
        g /= world_size  # divided before the sum, as DDP does, so the sum cannot overflow
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)  # one message for all (chapter 7's flat), the tied gradient in it twice
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


# [end: walking]


# [start: naive]
class NaiveDDP(torch.nn.Module):
    """Rank 0's weights and buffers everywhere at the start; the mean gradient after every backward().
    Several backward()s before one finish_gradient_synchronization() add up first, as chapter 6's
    accumulation wants: the mean of the sum is sent once."""

    def __init__(self, module):
        super().__init__()
        self.module = module  # a submodule: parameters(), state_dict() and train() reach the model's
        self.require_sync = True  # False inside no_sync(): the hooks of the subclasses send nothing
        for t in [*module.parameters(), *module.buffers()]:  # frozen ones too: they shape the output as well
            dist.broadcast(t.detach(), src=0)  # in place; detach(): no autograd on a parameter

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward()s in here only add to this rank's .grad; the next one outside sends the sum (DDP's name)."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def finish_gradient_synchronization(self):
        missing = [k for k, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
        if missing:  # checked before any collective: a rank that skipped a parameter would pair the others wrong
            raise RuntimeError(
                f"rank {dist.get_rank()}: {', '.join(missing)} got no gradient in this backward(): every rank must"
                " use every trainable parameter; freeze the unused ones (requires_grad_(False))"
            )
        n = dist.get_world_size()
        for p in self.module.parameters():  # each tensor once: a tied weight is one parameter
            if p.requires_grad:  # a frozen parameter has no gradient to average
                dist.all_reduce(p.grad)  # the sum over ranks...
                p.grad /= n  # ...and the mean


# [end: naive]


def ratio(a, b):
    """How many times b is a (least squares): 1 when equal, 1/N when N times too small."""
    return (a.flatten() @ b.flatten() / b.square().sum()).item()


def check_construction(ctx):
    """Each rank's own TiedNet, then NaiveDDP: every tensor equal to rank 0's. torch's DDP alike.
    Returns both wrappers and, per tensor, whether every rank held rank 0's (before, after)."""
    model = TiedNet(seed=ctx.rank)  # each rank its own weights, frozen ones and buffers included
    tensors = [*model.named_parameters(), *model.named_buffers()]
    start = gather(state(model))
    ddp = NaiveDDP(model)
    now = gather(state(model))
    sizes = [t.numel() for _, t in tensors]
    agree = {
        name: [
            all(torch.equal(a, every[0].split(sizes)[i]) for a in (s.split(sizes)[i] for s in every))
            for every in (start, now)
        ]
        for i, (name, _) in enumerate(tensors)
    }
    assert all(after for _, after in agree.values()), f"rank {ctx.rank}: still differ from rank 0's: {agree}"
    agreed = [name for name, (before, _) in agree.items() if before]
    assert ctx.world_size == 1 or not agreed, f"{agreed} agreed before the broadcast: nothing was tested"
    theirs = DDP(TiedNet(seed=ctx.rank))
    frozen = gather(theirs.module.fixed.weight.detach().flatten())
    assert all(torch.equal(f, frozen[0]) for f in frozen), f"rank {ctx.rank}: DDP left the frozen weight as it was"
    return ddp, theirs, agree


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 21), metavar="1..20")
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    n, rank = ctx.world_size, ctx.rank
    want_grads, want_weights = reference(args.steps, n)
    ddp, theirs, agree = check_construction(ctx)

    walked = TiedNet(seed=0)  # the bug, one step
    with Traffic() as walk:
        got, _ = train(walked, 1, n, rank, lambda: average_walking(walked, n))
    ratios = {k: ratio(got[0][k], w) for k, w in want_grads[0].items()}
    for k, r in ratios.items():
        assert abs(r - (1 / n if k == "enc.weight" else 1)) < TOL, f"rank {rank}: walking gave {k} {r:.6f} x"
    tied = walked.enc.weight.numel() * walked.enc.weight.element_size()
    assert walk.payload["all_reduce"] == trainable_bytes(walked) + tied, f"rank {rank}: {walk.payload}"

    with Traffic() as traffic:
        grads, weights = train(ddp, args.steps, n, rank, ddp.finish_gradient_synchronization)
    theirs_grads, theirs_weights = train(theirs, args.steps, n, rank)
    gaps = {
        "one process": max(max_gap(weights, want_weights), *map(grad_gap, grads, want_grads)),
        "torch DDP": max(max_gap(weights, theirs_weights), *map(grad_gap, grads, theirs_grads)),
    }
    for what, gap in gaps.items():
        assert gap < TOL, f"rank {rank}: NaiveDDP's gradients or weights are {gap:.1e} from {what}'s"
    assert "fixed.weight" not in grads[0] and ddp.module.fixed.weight.grad is None, f"rank {rank}: frozen has a grad"
    sent, calls = traffic.payload["all_reduce"] // args.steps, traffic.calls["all_reduce"] // args.steps
    assert (sent, calls) == (trainable_bytes(ddp), len(grads[0])), f"rank {rank}: {traffic.calls} {traffic.payload}"
    differed = sum(not before for before, _ in agree.values())
    gap = gaps["one process"]
    print(f"rank {rank}: {differed} of {len(agree)} tensors differed before NaiveDDP, none after; gap {gap:.0e}")
    if ctx.is_main:
        frozen = {n for n, p in ddp.module.named_parameters() if not p.requires_grad}
        lessonlib.report(
            "construction",
            [
                {
                    "tensor": k,
                    "kind": "buffer"
                    if k.startswith("norm.running") or k.endswith("tracked")
                    else "frozen"
                    if k in frozen
                    else "parameter",
                    "same on every rank before": b,
                    "after": a,
                }
                for k, (b, a) in agree.items()
            ],
        )
        lessonlib.report(
            "walking",
            {
                "ratio to one process": ratios,
                "all_reduce bytes": walk.payload["all_reduce"],
                "trainable bytes": trainable_bytes(walked),
            },
        )
        lessonlib.report(
            "naive", {"max gap": gaps, "all_reduce bytes per step": sent, "all_reduce calls per step": calls}
        )
        print(f"walking the modules: enc.weight's gradient is {ratios['enc.weight']:.4f} x one process's (1/{n})")
        print(f"NaiveDDP: largest gap to one process {gaps['one process']:.1e}, to torch DDP {gaps['torch DDP']:.1e}")
        print(f"all_reduce per step: {calls} calls, {sent} bytes (the trainable parameters, each once)")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
