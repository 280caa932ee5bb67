"""torchrun --nproc_per_node=2 lessons/14_bucket_view.py

Two DDP flags: gradient_as_bucket_view (one copy of the gradients less) and static_graph (what it allows).

Options: --width 64 --layers 4 (part 1's model), --pg-timeout S (default 30).

1. gradient_as_bucket_view=True. A hook keeps each bucket's flat buffer. By default no .grad shares
   storage with a bucket: DDP copies gradients in and averages out, and the gradients and the buckets
   hold 2P bytes for P bytes of parameters. With the flag, every .grad is a view into a bucket (same
   storage, inside its byte range, asserted) and together they hold P; after opt.zero_grad()
   (set_to_none) and one more step, still views. Bytes from the storages (lessonlib.sharding.held).
2. static_graph=True, on a float64 model whose weights are compared with one process on every rank's
   rows (within TOL) after 3 SGD steps:
   a. an `aux` layer never used: DDP's default raises at iteration 2 (chapter 7); static_graph trains.
   b. re-entrant activation checkpointing (use_reentrant=True). Each block checkpointed once: plain DDP
      trains (asserted). The same block checkpointed twice, or find_unused_parameters=True: "Expected to
      mark a variable ready only once" (the real error); static_graph=True trains both.
      use_reentrant=False needs none of it: plain DDP trains the block used twice.
   c. The graph changes under static_graph=True: at step 2 the forward skips a block. No error at that
      step, but DDP did not average the gradients: at N > 1 the ranks' gradients and, after opt.step(),
      their weights differ (asserted); the error comes at the next forward.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import lessonlib
from lessonlib.sharding import held
from lessonlib.training import DIM, flat_params, gather, global_batch, max_gap, my_rows

CAP_MB = 0.03  # two layers of 64 x 64 per bucket: several buckets (chapter 7)
ROWS, LR, STEPS, TOL = 4, 0.1, 3, 1e-12


def layers(width, depth):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])


# [start: views]
def grads_and_buckets(as_view, width, depth, steps=3):
    """After `steps` steps: each .grad against the buckets' buffers (kept by a hook), and the bytes held."""
    model = layers(width, depth)
    buffers = {}

    def keep(state, bucket):  # a hook: note the bucket's flat buffer, then DDP's usual all-reduce
        buffers[bucket.index()] = bucket.buffer()
        return allreduce_hook(None, bucket)

    ddp = DDP(model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=as_view)
    ddp.register_comm_hook(None, keep)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()  # set_to_none=True: the .grad tensors are dropped between steps
        ddp(torch.randn(8, width, generator=torch.Generator().manual_seed(step))).square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    spans = {b.untyped_storage().data_ptr(): (b.data_ptr(), b.data_ptr() + b.nbytes) for b in buffers.values()}
    shared = [g.untyped_storage().data_ptr() in spans for g in grads]
    inside = [any(a <= g.data_ptr() and g.data_ptr() + g.nbytes <= b for a, b in spans.values()) for g in grads]
    return {
        "gradient_as_bucket_view": as_view,
        "buckets": len(buffers),
        ".grad sharing a bucket's storage": f"{sum(shared)} of {len(grads)}",
        ".grad inside a bucket's bytes": f"{sum(inside)} of {len(grads)}",
        "bytes: gradients": held(grads),
        "bytes: buckets": held(buffers.values()),
        "bytes: both together": held([*grads, *buffers.values()]),  # a storage two of them share counts once
    }


# [end: views]


class Net(torch.nn.Module):
    """a -> block (b, maybe checkpointed, maybe twice, maybe skipped at one step) -> head; aux never used."""

    def __init__(self, aux=False, reentrant=None, twice=False, skip_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = torch.nn.Linear(DIM, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        self.aux = torch.nn.Linear(8, 1) if aux else None
        self.reentrant, self.twice, self.skip_at, self.step = reentrant, twice, skip_at, 0
        self.double()

    def block(self, h):
        return torch.tanh(self.b(h))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        for _ in range(2 if self.twice else 1):
            if self.step == self.skip_at:
                break  # this step's graph has no b
            # [start: reentrant]
            if self.reentrant is None:
                h = self.block(h)
            else:  # forward without saving activations; backward runs the block again
                h = checkpoint(self.block, h, use_reentrant=self.reentrant)
            # [end: reentrant]
        return self.head(h)


def reference(n, **flags):
    """One process, every rank's rows, no DDP and no checkpoint: the weights after STEPS SGD steps."""
    flags.pop("reentrant", None)
    net = Net(**flags)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = global_batch(step, ROWS * n)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return flat_params(net)


def attempt(ctx, ddp_kwargs, **flags):
    """Train Net(**flags) under DDP(**ddp_kwargs): 'trains' (weights checked) or the first line of the error."""
    net = Net(**flags)
    ddp = DDP(net, **ddp_kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    try:
        for step in range(STEPS):
            x, y = global_batch(step, ROWS * ctx.world_size)
            mine = my_rows([ROWS] * ctx.world_size, ctx.rank)
            opt.zero_grad()
            F.mse_loss(ddp(x[mine]), y[mine]).backward()
            opt.step()
    except RuntimeError as e:
        return f"step {step}: {str(e).split('. ')[0]}"
    gap = max_gap(flat_params(net), reference(ctx.world_size, **flags))
    assert gap < TOL, f"rank {ctx.rank}: {flags} {ddp_kwargs}: weights {gap:.1e} from one process"
    return "trains (weights = one process)"


STATIC = {"static_graph": True}
CASES = [  # (what, flags of Net, DDP's keyword arguments, what must happen)
    ("aux never used", {"aux": True}, {}, "Expected to have finished reduction"),
    ("aux never used", {"aux": True}, STATIC, "trains"),
    ("reentrant, each block once", {"reentrant": True}, {}, "trains"),
    (
        "reentrant, the block twice",
        {"reentrant": True, "twice": True},
        {},
        "Expected to mark a variable ready only once",
    ),
    ("reentrant, the block twice", {"reentrant": True, "twice": True}, STATIC, "trains"),
    (
        "reentrant, aux never used",
        {"reentrant": True, "aux": True},
        {"find_unused_parameters": True},
        "ready only once",
    ),
    ("reentrant, aux never used", {"reentrant": True, "aux": True}, STATIC, "trains"),
    ("non-reentrant, the block twice", {"reentrant": False, "twice": True}, {}, "trains"),
]


# [start: changes]
def graph_changes(ctx, skip_at=2):
    """static_graph=True, and at step `skip_at` the forward leaves block b out."""
    net = Net(skip_at=skip_at)
    ddp = DDP(net, static_graph=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    seen = {}
    for step in range(skip_at + 2):
        net.step = step
        x, y = global_batch(step, ROWS * ctx.world_size)
        mine = my_rows([ROWS] * ctx.world_size, ctx.rank)
        opt.zero_grad()
        try:
            F.mse_loss(ddp(x[mine]), y[mine]).backward()
        except RuntimeError as e:
            seen["error"] = f"step {step}: {str(e).split('. ')[0]}. {str(e).split('. ')[1]}"
            break
        used = [p for p in net.parameters() if p.grad is not None]
        grads = gather(torch.cat([p.grad.flatten() for p in used]))  # every rank's gradients
        seen[f"step {step}: ranks' gradients equal"] = all(torch.equal(g, grads[0]) for g in grads)
        opt.step()
        weights = gather(flat_params(net))
        seen[f"step {step}: ranks' weights equal"] = all(torch.equal(w, weights[0]) for w in weights)
    return seen


# [end: changes]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--width", type=int, default=64, choices=range(8, 257), metavar="8..256")
    parser.add_argument("--layers", type=int, default=4, choices=range(2, 17), metavar="2..16")
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    n = ctx.world_size

    views = [grads_and_buckets(flag, args.width, args.layers) for flag in (False, True)]
    p = sum(q.numel() * q.element_size() for q in layers(args.width, args.layers).parameters())
    k = 2 * args.layers  # parameter tensors
    plain, view = views
    assert plain[".grad sharing a bucket's storage"] == f"0 of {k}" and plain["bytes: both together"] == 2 * p, plain
    assert view[".grad sharing a bucket's storage"] == view[".grad inside a bucket's bytes"] == f"{k} of {k}", view
    assert view["bytes: both together"] == view["bytes: buckets"] == p and view["buckets"] > 1, view

    rows = []
    for what, flags, kwargs, expected in CASES:
        got = attempt(ctx, kwargs, **flags)
        assert expected in got, f"rank {ctx.rank}: {what} with {kwargs or 'defaults'}: {got}"
        rows.append({"model": what, "DDP(...)": ", ".join(f"{k}=True" for k in kwargs) or "defaults", "result": got})

    changed = graph_changes(ctx)
    assert changed["step 1: ranks' weights equal"] and "step 3: Expected to have finished" in changed["error"], changed
    assert "training graph has changed" in changed["error"], changed
    assert changed["step 2: ranks' gradients equal"] == changed["step 2: ranks' weights equal"] == (n == 1), changed

    if ctx.is_main:
        lessonlib.report("views", views)
        lessonlib.report("static_graph", rows)
        lessonlib.report("graph_changes", changed)
        for v in views:
            print(f"gradient_as_bucket_view={v['gradient_as_bucket_view']!s:5}: {v['bytes: both together']} bytes")
        for r in rows:
            print(f"{r['model']:31} {r['DDP(...)']:27} {r['result'][:70]}")
        print(changed["error"][:150])
    print(f"rank {ctx.rank}: every assertion held at world size {n}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
