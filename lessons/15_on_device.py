"""torchrun --nproc_per_node=2 lessons/15_on_device.py

Chapter 15's five classes on the device this machine has, each checked against one process on that device.

Options: --steps 3 (the default), --pg-timeout S (default 30).

The other chapter 15 lessons stay on the CPU by design (exact float64 timelines, bytes counted through
gloo), so none of them runs the classes on a GPU. This one calls lessonlib.setup() without a device: NCCL
and one GPU per rank where there is a GPU for every local rank, gloo on the CPU otherwise. It loads the
classes from their lessons (never a copy) and trains each for --steps steps on ctx.device, every rank
starting from its own seed, two ways: one backward() per step, and 2 micro-batches accumulated per step.
Asserted on every rank, for each class and each way: the weights after the last step, and that step's
averaged gradients where the class keeps them whole, equal one process training on every rank's rows of
the same global batches on the same device; every parameter, gradient and optimizer moment it keeps is on
ctx.device (on a CPU-only machine that holds by construction: tests/test_build_*.py catch a tensor made
without device= there, with another default device).
- NaiveDDP, OverlappedDDP, BucketedDDP (a few buckets): TiedNet (lessons/15_naive_ddp.py: float64, a tied
  weight, a frozen layer, buffers), SGD; accumulation runs the first backward() inside no_sync().
- ShardedOptimizer: AdamW with weight decay on TinyLM (lessons/15_sharded_optimizer.py) in float64, the
  gradients averaged by NaiveDDP; accumulation inside NaiveDDP's no_sync().
- HandFSDP: TinyLM in float32 (its shards are float32), SGD. It has no no_sync(): each backward()
  reduce-scatters its micro-batch's mean gradient into the shard, where autograd adds the two up.
Tolerances: TOL = 1e-12 in float64, which NCCL and gloo both reduce: one process and N ranks add the same
numbers in another order (measured on gloo at 1 to 4 ranks: up to 1.1e-16 with SGD, 1.3e-15 with AdamW,
which divides each step by the gradient's own scale, so a near-zero gradient's rounding grows). F32_TOL =
1e-6 for HandFSDP in float32 (weights up to 3, where float32's spacing is 2.4e-7; measured on gloo: 0 to
2.4e-7). float32 matrix products on a GPU are IEEE float32 unless TF32 is switched on
(torch.backends.cuda.matmul.allow_tf32, off by default), which this lesson refuses: TF32 keeps 10 of
float32's 23 mantissa bits, too few for F32_TOL.
Reported (lessonlib.report "on_device"): backend, device, torch, and each class's largest gap over the ranks.
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lessonlib
from lessonlib.training import global_batch, max_gap, my_rows

naive = lessonlib.load_lesson("15_naive_ddp")  # NaiveDDP, TiedNet, state(), grad_gap(), TOL
overlap = lessonlib.load_lesson("15_overlap_ddp")  # OverlappedDDP
bucketed = lessonlib.load_lesson("15_bucketed_ddp")  # BucketedDDP
sharded = lessonlib.load_lesson("15_sharded_optimizer")  # ShardedOptimizer, TinyLM, batch(), LR, DECAY
hand = lessonlib.load_lesson("15_hand_fsdp")  # HandFSDP, its LR and F32_TOL
TOL, F32_TOL = naive.TOL, hand.F32_TOL
WAYS = {"one backward": 1, "2 micro-batches": 2}  # micro-batches per optimizer step


def tied_rows(index, n, rank, device):
    """TiedNet's data: micro-batch `index` of the global batches, every rank's rows (rank None) or rank's."""
    x, y = global_batch(index, naive.ROWS * n)
    if rank is not None:
        x, y = x[my_rows([naive.ROWS] * n, rank)], y[my_rows([naive.ROWS] * n, rank)]
    return x.to(device), y.to(device), F.mse_loss


def token_rows(index, n, rank, device):
    """TinyLM's data, the same way: tokens and the next tokens."""
    ids, targets = sharded.batch(index, n, rank)
    return ids.to(device), targets.to(device), F.cross_entropy


def train(model, opt, data, steps, micro, n, rank=None, device="cpu"):
    """`steps` optimizer steps on `rank`'s rows (every rank's when None), each over `micro` micro-batches;
    all but the last backward() inside no_sync() where the model has it. The last step's whole gradients."""
    whole = getattr(model, "module", model)  # the model's own names, without a wrapper's "module."
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y, loss_fn = data(step * micro + m, n, rank, device)
            quiet = m < micro - 1 and hasattr(model, "no_sync")
            with model.no_sync() if quiet else contextlib.nullcontext():
                loss_fn(model(x), y).backward()  # each micro-batch's mean: the gradients add up
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
        grads = {k: p.grad.clone() for k, p in whole.named_parameters() if p.grad is not None}
        opt.step()
    return grads


def build(name, seed, device):
    """Class `name` on its model (each rank's own seed), with its optimizer; `seed` None: one process's."""
    if name == "HandFSDP":
        model = sharded.TinyLM(seed=seed or 0).to(device)  # float32: HandFSDP's shards are
        model = model if seed is None else hand.HandFSDP(model)
        return model, torch.optim.SGD(model.parameters(), lr=hand.LR), token_rows
    if name == "ShardedOptimizer":
        model = sharded.TinyLM(seed=seed or 0).double().to(device)
        options = {"lr": sharded.LR, "weight_decay": sharded.DECAY}
        if seed is None:
            return model, torch.optim.AdamW(model.parameters(), **options), token_rows
        model = naive.NaiveDDP(model)  # averages the gradients, as ShardedOptimizer expects
        return model, sharded.ShardedOptimizer(model.parameters(), torch.optim.AdamW, **options), token_rows
    model = naive.TiedNet(seed=seed or 0).to(device)
    if seed is not None:
        few = naive.trainable_bytes(model) / 4 / bucketed.MIB  # a cap that makes a few buckets
        wrap = {"NaiveDDP": naive.NaiveDDP, "OverlappedDDP": overlap.OverlappedDDP}
        model = wrap[name](model) if name in wrap else bucketed.BucketedDDP(model, few)
    return model, torch.optim.SGD(model.parameters(), lr=naive.LR), tied_rows


def where(model, opt):
    """The devices of every parameter, gradient and optimizer moment the class keeps (AdamW's `step`
    count is a CPU scalar by torch's design, unless capturable: left out)."""
    inner = getattr(opt, "local", opt)  # ShardedOptimizer's own AdamW, on this rank's slices
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    kept = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *state]
    return {t.device for t in kept}


# [start: check]
def check(name, ctx, steps):
    """Class `name` against one process on ctx.device, each way: {way: this rank's largest gap}."""
    n, rank, device = ctx.world_size, ctx.rank, ctx.device
    gaps = {}
    for way, micro in WAYS.items():
        alone, alone_opt, data = build(name, None, device)
        want = train(alone, alone_opt, data, steps, micro, n, device=device)
        model, opt, data = build(name, rank, device)
        got = train(model, opt, data, steps, micro, n, rank, device)
        if name == "HandFSDP":  # its gradients are in its shards: the weights are compared, gathered whole
            gaps[way] = hand.gap(model.gather_full_params(), {k: p.detach() for k, p in alone.named_parameters()})
        else:
            gaps[way] = max(max_gap(naive.state(model), naive.state(alone)), naive.grad_gap(got, want))
        tol = F32_TOL if name == "HandFSDP" else TOL
        assert gaps[way] < tol, f"rank {rank}: {name}, {way}: {gaps[way]:.1e} from one process on {device}"
        devices = where(model, opt)
        assert devices == {device}, f"rank {rank}: {name}, {way}: tensors on {devices}, not only {device}"
    return gaps


# [end: check]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 21), metavar="1..20")
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    ctx = lessonlib.setup(timeout=args.pg_timeout)  # no device= : NCCL on GPUs where each rank has one
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    elif torch.backends.cuda.matmul.allow_tf32:
        raise RuntimeError(
            "TF32 matmuls are on (torch.backends.cuda.matmul.allow_tf32 is True): HandFSDP's check compares IEEE"
            " float32 within 1e-6; unset it (torch.set_float32_matmul_precision('highest')) and run again"
        )
    names = ("NaiveDDP", "OverlappedDDP", "BucketedDDP", "ShardedOptimizer", "HandFSDP")
    gaps = {name: check(name, ctx, args.steps) for name in names}
    # The largest gap of any rank, so that the table speaks for all of them.
    every = torch.tensor([g for name in names for g in gaps[name].values()], device=ctx.device)
    dist.all_reduce(every, op=dist.ReduceOp.MAX)
    largest = iter(every.tolist())
    rows = [
        {
            "class": name,
            "dtype": "float32" if name == "HandFSDP" else "float64",
            **{f"gap, {way}": next(largest) for way in WAYS},
            "tolerance": F32_TOL if name == "HandFSDP" else TOL,
        }
        for name in names
    ]
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None
    facts = {"backend": ctx.backend, "device": str(ctx.device), "gpu": gpu, "torch": torch.__version__}
    if ctx.is_main:
        lessonlib.report("on_device", {**facts, "world_size": ctx.world_size, "rows": rows})
        on = f"{gpu} per rank" if gpu else "CPU"
        print(f"{ctx.backend}, {ctx.world_size} rank(s), {on}, torch {torch.__version__}: largest gap over the ranks")
        print(f"{'class':17} {'dtype':8} {'one backward':>13} {'2 micro-batches':>16} {'tolerance':>10}")
        for r in rows:
            gap1, gap2 = r["gap, one backward"], r["gap, 2 micro-batches"]
            print(f"{r['class']:17} {r['dtype']:8} {gap1:13.1e} {gap2:16.1e} {r['tolerance']:10.0e}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
