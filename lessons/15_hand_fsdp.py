"""torchrun --nproc_per_node=3 lessons/15_hand_fsdp.py

HandFSDP(module, compute_dtype=None, shard=...): each chosen module's weights kept as a flat padded shard.

Options: --steps 3 (the default); --pg-timeout S (default 30).

The model: lessons/15_sharded_optimizer.py's TinyLM in float32 (head.weight IS embed.weight; `fixed` frozen;
`shift` a buffer). HandFSDP shards every Linear and Embedding: its own trainable parameters, flattened and
zero-padded to N equal pieces, of which this rank keeps one (the module's `shard`; flat_shard and
reduce_gradient are lessons/15_exercise_fsdp.py's reference answers, loaded from there). A tied weight
belongs to the first module holding it; head gathers embed's flat too, once per use, and each use
reduce-scatters its share of the gradient, which autograd adds up in the shard. Frozen parameters stay
replicated (nothing to reduce), as do LayerNorm's (all-reduced, as DDP does); all is broadcast from rank 0
first. Asserted on every rank, each starting from its own seed, on the last of --steps SGD steps:
1. gather_full_params() equals one process on every rank's rows and torch's fully_shard within F32_TOL;
   every parameter's .grad has its parameter's shape and dtype (the shards': float32).
2. The peak of gathered bytes (storage, read at every all-gather) is the largest module's (head: embed's
   flat and its bias, N * ceil(size / N) elements each), or with prefetch (the next module's all-gather
   started early) the largest two consecutive modules'. In the events, module b (after a) is gathered after
   a is freed, or with prefetch before a computes, in both passes; prefetching changes no weight.
3. compute_dtype bfloat16 and float16: the all-gathers carry half the bytes and the reduce-scatters the same
   (float32 gradients); the weights differ from the float32 run's, within BF16_TOL / F16_TOL. (The blocks
   compute in it by construction: the gathered weights are made in that dtype.) fully_shard is not run in
   low precision here: with MixedPrecisionPolicy(param_dtype=...) it reduces gradients in that dtype unless
   reduce_dtype says otherwise, where this class reduces in float32.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lessonlib
from lessonlib.sharding import Traffic

optimizer_lesson = lessonlib.load_lesson("15_sharded_optimizer")
TinyLM, batch = optimizer_lesson.TinyLM, optimizer_lesson.batch
# The exercise's two pieces: this rank's piece of the flattened tensors, zero-padded to N equal pieces (float32);
# this rank's piece of the mean over ranks of a whole flat gradient, in float32 whatever the compute dtype.
exercise = lessonlib.load_lesson("15_exercise_fsdp")
flat_shard, reduce_gradient = exercise.flat_shard, exercise.reduce_gradient
all_gather_single = optimizer_lesson.all_gather_single  # torch 2.11 has only all_gather_into_tensor
LR = 0.1  # SGD's
F32_TOL = 1e-6  # float32, sums in another order; weights up to 3 (measured: 0 to 2.4e-7 at 1 to 4 ranks)
BF16_TOL, F16_TOL = 1e-2, 2e-3  # vs HandFSDP in float32 after 3 steps (measured at 1 to 4 ranks: 3.2e-3, 5.4e-4)
RUNS = {"float32": None, "prefetch": None, "bfloat16": torch.bfloat16, "float16": torch.float16}  # compute_dtype


# [start: gathered]
class Gathered:
    """A module's flat weights, whole on this rank, for one use. free() gives the memory back (the storage is
    resized to 0 bytes) and gather() fills it again, in the same storage: autograd saved views of it."""

    def __init__(self, shard, dtype, user):
        self.shard, self.user, self.work = shard, user, None
        self.full = shard.new_empty(shard.numel() * dist.get_world_size(), dtype=dtype)  # on the shard's device
        # Written through an alias: an in-place write to `full` would make the saved views look modified.
        self.alias = self.full.new_empty(0).set_(self.full.untyped_storage(), 0, self.full.shape)

    def gather(self):
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        mine = self.shard.detach().to(self.full.dtype)  # the compute dtype: what the all-gather carries
        self.work = all_gather_single(self.alias, mine, async_op=True)

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None

    def free(self):
        self.wait()
        self.full.untyped_storage().resize_(0)


class _Gather(torch.autograd.Function):
    """Forward: the whole flat weights (gathered already). Backward: this rank's shard of the mean gradient."""

    @staticmethod
    def forward(ctx, shard, fsdp, buffer):
        ctx.fsdp, ctx.buffer = fsdp, buffer
        buffer.wait()
        return buffer.full

    @staticmethod
    def backward(ctx, grad):
        out = reduce_gradient(grad, dist.get_world_size())  # float32, whatever the compute dtype
        ctx.buffer.free()
        ctx.fsdp.events.append(("backward", "free", ctx.buffer.user))
        return out, None, None


# [end: gathered]


def linear_or_embedding(module):
    return isinstance(module, (torch.nn.Linear, torch.nn.Embedding))


# [start: hand_fsdp]
class HandFSDP(torch.nn.Module):
    """Gathers each chosen module's weights just before it runs (forward and backward), frees them after."""

    def __init__(self, module, compute_dtype=None, shard=linear_or_embedding):
        super().__init__()
        self.module, self.dtype, n, rank = module, compute_dtype, dist.get_world_size(), dist.get_rank()
        for t in [*module.parameters(), *module.buffers()]:  # rank 0's everywhere, frozen ones and buffers too
            dist.broadcast(t.detach(), src=0)
        first = {p: name for name, p in module.named_parameters()}  # a tied weight once, by its first name
        kept = {p for m in module.modules() if not shard(m) for p in m.parameters(recurse=False)}
        owner, self.uses, self.shards_of, self.paths = {}, {}, {}, {}  # parameter -> (shard, start, shape)
        for path, m in module.named_modules():
            mine = [(k, p) for k, p in m.named_parameters(recurse=False) if p.requires_grad and p not in kept]
            if not shard(m) or not mine:
                continue
            new = [p for _, p in mine if p not in owner]  # a tied weight seen before belongs to its first module
            if new:
                flat = torch.nn.Parameter(flat_shard(new, n, rank))
                starts = [sum(q.numel() for q in new[:i]) for i in range(len(new))]  # where each lies in the flat
                owner.update({p: (flat, start, p.shape) for p, start in zip(new, starts)})
                m.register_parameter("shard", flat)  # what an optimizer on .parameters() updates
            self.uses[m], self.paths[m] = [(k, *owner[p]) for k, p in mine], path  # [(attribute, shard, ...)]
            self.shards_of[m] = list(dict.fromkeys(owner[p][0] for _, p in mine))  # the flats it gathers
            for k, _ in mine:
                delattr(m, k)  # set again, to views of the gathered flat, by each forward
            m.register_forward_pre_hook(self._forward_pre)
            m.register_forward_hook(self._forward_post)  # also hooks the output for the backward
        self.names, self.sharded = list(first.values()), {first[p]: where for p, where in owner.items()}
        self.shards = list(dict.fromkeys(shard for shard, _, _ in owner.values()))
        self.replicated = {k: p for k, p in module.named_parameters() if all(p is not s for s in self.shards)}
        self.prefetch, self.order, self.last_order, self.live, self.ahead, self.buffers = False, [], [], {}, {}, []
        self.events, self.peak = [], 0  # in a step: (pass, what, module), and the most bytes gathered at once

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # [end: hand_fsdp]

    # [start: hooks]
    def _gather(self, m, when, buffers=None):
        """Start module m's all-gathers: into new buffers in forward, into its saved ones in backward."""
        buffers = buffers or [Gathered(s, self.dtype or torch.float32, self.paths[m]) for s in self.shards_of[m]]
        for b in buffers:
            b.gather()
        self.buffers += [b for b in buffers if b not in self.buffers]
        self.peak = max(self.peak, sum(b.full.untyped_storage().nbytes() for b in self.buffers))
        self.events.append((when, "gather", self.paths[m]))
        return buffers

    def _forward_pre(self, m, args):
        if not self.order:  # the first module of a step: events and peak are the step's
            self.events, self.peak = [], 0
        self.order.append(m)
        self.live[m] = self.ahead.pop(m, None) or self._gather(m, "forward")
        fulls = {b.shard: _Gather.apply(b.shard, self, b) for b in self.live[m]}  # waits for each
        for k, shard, start, shape in self.uses[m]:
            setattr(m, k, fulls[shard][start : start + shape.numel()].view(shape))
        if self.prefetch and len(self.order) < len(self.last_order):  # the module that ran next last time
            following = self.last_order[len(self.order)]
            self.ahead[following] = self._gather(following, "forward")
        self.events.append(("forward", "compute", self.paths[m]))
        return tuple(a.to(self.dtype) if self.dtype and a.is_floating_point() else a for a in args)  # its inputs

    def _forward_post(self, m, args, out):
        for b in self.live[m]:
            b.free()
        self.events.append(("forward", "free", self.paths[m]))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"HandFSDP shards modules that return one tensor; {self.paths[m]} returned {type(out)}")
        if out.requires_grad:  # runs when out's gradient is ready, before m's backward. A tensor hook, not a
            # full backward pre-hook: that one wraps out in a view, which an in-place ReLU after m cannot modify
            out.register_hook(lambda grad: self._backward_pre(m, grad))
        return out.float() if self.dtype else out  # the modules in between (LayerNorm) compute in float32

    def _backward_pre(self, m, grad_output):
        if self.ahead.pop(m, None) is None:
            self._gather(m, "backward", self.live[m])  # the same storage the saved views point into
        for b in self.live[m]:
            b.wait()
        i = self.order.index(m)
        if self.prefetch and i > 0:  # the module before this one in forward runs next in backward
            self.ahead[self.order[i - 1]] = self._gather(self.order[i - 1], "backward", self.live[self.order[i - 1]])
        self.events.append(("backward", "compute", self.paths[m]))
        return grad_output

    # [end: hooks]

    # [start: finish]
    def finish_gradient_synchronization(self):
        for b in self.buffers:  # a prefetch no module used, if any
            b.free()
        self.last_order, self.order, self.live, self.ahead, self.buffers = self.order, [], {}, {}, []
        for p in self.shards + [p for p in self.replicated.values() if p.requires_grad]:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad  # unused in this step: zero
            if all(p is not s for s in self.shards):  # replicated: all-reduced as DDP does
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()

    def gather_full_params(self):
        """Every parameter by its name in the model, whole, in float32 (a collective: call it on every rank)."""
        whole = {s: s.new_empty(s.numel() * dist.get_world_size()) for s in self.shards}
        for s, full in whole.items():
            all_gather_single(full, s.detach())
        out = {k: whole[s][i : i + shape.numel()].view(shape).clone() for k, (s, i, shape) in self.sharded.items()}
        out.update({k: p.detach().float().clone() for k, p in self.replicated.items()})
        return {k: out[k] for k in self.names}

    # [end: finish]


def train(model, steps, n, rank=None):
    """`steps` SGD steps on `rank`'s rows (every rank's when None); the last step's Traffic."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        ids, targets = batch(step, n, rank)
        with Traffic() as traffic:  # the collectives of each step, and the bytes sent
            opt.zero_grad()
            F.cross_entropy(model(ids), targets).backward()
            if isinstance(model, HandFSDP):
                model.finish_gradient_synchronization()
        opt.step()
    return traffic


def run(name, n, rank, steps):
    """HandFSDP trained as RUNS[name] says, its claims checked; its weights, and what it measured."""
    dtype, prefetch = RUNS[name], name == "prefetch"  # prefetch: each module's all-gather started early
    fsdp = HandFSDP(TinyLM(seed=rank), compute_dtype=dtype)  # each rank its own start: rank 0's wins
    fsdp.prefetch = prefetch
    traffic = train(fsdp, steps, n, rank)
    kept = {(p.dtype, p.grad.dtype, p.grad.shape == p.shape) for p in fsdp.parameters() if p.requires_grad}
    assert kept == {(torch.float32, torch.float32, True)}, f"rank {rank}: {name}: parameters and grads {kept}"
    # [start: peak]
    size = (dtype or torch.float32).itemsize  # bytes per gathered element
    need = {fsdp.paths[m]: n * size * sum(s.numel() for s in shards) for m, shards in fsdp.shards_of.items()}
    order = [fsdp.paths[m] for m in fsdp.last_order]  # the modules, as the last forward ran them
    peak = max(need[a] + need[b] for a, b in zip(order, order[1:])) if prefetch else max(need.values())
    assert fsdp.peak == peak, f"rank {rank}: {name}: {fsdp.peak} B gathered at the peak, want {peak}"
    for when, pairs in (("forward", zip(order, order[1:])), ("backward", zip(order[::-1], order[-2::-1]))):
        for a, b in pairs:  # b runs after a
            at = {w: [i for i, e in enumerate(fsdp.events) if e == (when, w, a)] for w in ("compute", "free")}
            gathered = fsdp.events.index((when, "gather", b))
            ok = gathered < at["compute"][0] if prefetch else gathered > at["free"][-1]
            assert ok, f"rank {rank}: {name}: {when}: {b} gathered at event {gathered}, {a}'s events {at}"
    # [end: peak]
    row = {"peak": fsdp.peak, "need": need, "calls": dict(traffic.calls), "payload": dict(traffic.payload)}
    return fsdp.gather_full_params(), {**row, "sent": traffic.sent, "events": fsdp.events}


def gap(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=3, choices=range(2, 21), metavar="2..20")
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    n, rank = ctx.world_size, ctx.rank
    alone = TinyLM(seed=0)
    train(alone, args.steps, n)
    theirs, mesh = TinyLM(seed=0), init_device_mesh("cpu", (n,))  # fully_shard cuts each rank's own tensors
    for module in [*(block[0] for block in theirs.blocks), theirs]:  # the root: embed, head (tied), norm, fixed
        fully_shard(module, mesh=mesh)
    train(theirs, args.steps, n, rank)
    got, rows = {}, {}
    for name in RUNS:
        got[name], rows[name] = run(name, n, rank, args.steps)
    gaps = {"one process": gap(got["float32"], {k: p.detach() for k, p in alone.named_parameters()})}
    gaps["fully_shard"] = gap(got["float32"], {k: p.full_tensor() for k, p in theirs.named_parameters()})
    for what, g in gaps.items():
        assert g < F32_TOL, f"rank {rank}: HandFSDP in float32 is {g:.1e} from {what}"
    assert all(map(torch.equal, got["prefetch"].values(), got["float32"].values())), f"rank {rank}: prefetch"
    same = all(rows["prefetch"][k] == rows["float32"][k] for k in ("calls", "payload"))
    assert same, f"rank {rank}: prefetch changed the collectives: {rows['prefetch']} {rows['float32']}"
    for name, tol in (("bfloat16", BF16_TOL), ("float16", F16_TOL)):
        gaps[name] = gap(got[name], got["float32"])
        # above 0: the low precision changed the arithmetic, so compute_dtype was not ignored
        assert 0 < gaps[name] < tol, f"rank {rank}: {name} is {gaps[name]:.1e} from float32 (tolerance {tol})"
        low, full = rows[name]["payload"], rows["float32"]["payload"]
        assert 2 * low["all_gather"] == full["all_gather"], f"rank {rank}: {name} sent {low}, float32 {full}"
        assert low["reduce_scatter"] == full["reduce_scatter"], f"rank {rank}: {name} sent {low}, float32 {full}"
    model_bytes = 4 * sum(t.numel() for t in got["float32"].values())
    for name, row in rows.items():
        lessonlib.report("run", {"rank": rank, "run": name, "model bytes": model_bytes, "gaps": gaps, **row})
        if ctx.is_main:
            print(f"{name}: at most {row['peak']} B gathered, of a {model_bytes} B model; {row['calls']}")
    if ctx.is_main:
        print(f"largest gaps: {', '.join(f'{k} {v:.1e}' for k, v in gaps.items())}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
