"""Chapter 15's ShardedOptimizer and HandFSDP beyond what their lessons assert (lessons/15_sharded_optimizer.py
and 15_hand_fsdp.py, which tests/test_lessons.py runs at 1 to 4 ranks: equality with one process and with
ZeroRedundancyOptimizer / fully_shard on TinyLM, whose head.weight is embed.weight, whose `fixed` is frozen
and whose `shift` is a buffer; state bytes, peak bytes, prefetch order, low precision).

Here, on the same model, what the lessons take for granted:
- ShardedOptimizer follows a learning-rate scheduler (it changes param_groups, which step() passes on), runs
  a closure, takes a group of frozen parameters alone (no slice, never changed), and refuses state_dict();
  with all of that it still equals AdamW after the steps.
- HandFSDP: gather_full_params() names every parameter as the model does (a tied one once), in its shape;
  frozen parameters and LayerNorm's stay registered, whole, where they were; every other Linear or Embedding
  holds one float32 shard of ceil(size / N) elements, so a rank holds exactly the shards and the replicated
  parameters (lessonlib.sharding.held); buffers are rank 0's after construction.
- HandFSDP with another `shard` predicate (Linear only): the tied weight is then held by a module that is not
  sharded (embed), so it stays replicated and is all-reduced, while head's bias is sharded; with SGD with
  momentum and weight decay the weights equal one process's and the shards' padding stays zero.
- On another device than the default: both classes built and stepped with torch.device("meta") as the default
  (a CPU-only machine's stand-in for CUDA parameters under a CPU default), HandFSDP with ReLU(inplace=True)
  after each sharded block, equal one process's: every tensor they make must live on the parameters' device,
  or gloo refuses the meta tensor (CPU and gloo here: the check needs no GPU).
Real ranks and real gloo: this file is also the script each rank runs (run_ranks starts it as __main__).
"""

import functools
import math
from pathlib import Path

import pytest

WORLD_SIZES = (1, 2, 3, 4)  # 1: plain python; 3 and 4 divide none of the sizes
STEPS, TOL64, TOL32 = 4, 1e-12, 1e-6  # float64 as the optimizer lesson; float32 as the FSDP lesson


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"np{n}")
def test_sharded_optimizer_and_hand_fsdp_keep_their_contracts(world_size, tmp_path):
    from rankfork import run_ranks

    run = run_ranks(Path(__file__), world_size, tmp_path, plain=world_size == 1)
    assert run.ok, run.describe_failure()
    assert all("contracts kept" in r.stdout for r in run.ranks), [r.stdout for r in run.ranks]


def closure(model, opt, ids, targets):
    import torch.nn.functional as F

    opt.zero_grad()
    loss = F.cross_entropy(model(ids), targets)
    loss.backward()
    return loss


def sharded_optimizer(ctx, lessons):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    opt_lesson = lessons["15_sharded_optimizer"]
    n, rank = ctx.world_size, ctx.rank
    runs = {}
    for kind in ("alone", "sharded"):
        model = opt_lesson.TinyLM(seed=0).double()
        model = model if kind == "alone" else DDP(model)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}, {"params": frozen}]
        if kind == "alone":
            opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
        else:
            opt = opt_lesson.ShardedOptimizer(groups[:1], torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
            opt.add_param_group(groups[1])  # frozen alone: no slice, nothing to update
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        start = [p.detach().clone() for p in frozen]
        for step in range(STEPS):
            ids, targets = opt_lesson.batch(step, n, None if kind == "alone" else rank)
            loss = opt.step(functools.partial(closure, model, opt, ids, targets))
            assert isinstance(loss, torch.Tensor), f"rank {rank}: {kind}: step(closure) returned {loss}"
            schedule.step()
        assert all(torch.equal(a, b) for a, b in zip(start, frozen)), f"rank {rank}: {kind} moved a frozen weight"
        runs[kind] = (model, opt)
    (alone, _), (model, opt) = runs["alone"], runs["sharded"]
    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), alone.parameters()))
    assert gap < TOL64, f"rank {rank}: with a scheduler and a closure, ShardedOptimizer is {gap:.1e} from AdamW"
    assert opt.slices[1][1].numel() == 0, f"rank {rank}: the frozen group got a slice of {opt.slices[1][1].numel()}"
    with pytest.raises(NotImplementedError, match="gather it first"):
        opt.state_dict()


def hand_fsdp(ctx, lessons):
    import torch

    from lessonlib.sharding import held

    fsdp_lesson, TinyLM = lessons["15_hand_fsdp"], lessons["15_sharded_optimizer"].TinyLM
    n, rank = ctx.world_size, ctx.rank
    original = TinyLM(seed=0)
    shapes = {k: p.shape for k, p in original.named_parameters()}
    fsdp = fsdp_lesson.HandFSDP(TinyLM(seed=rank))
    assert torch.equal(fsdp.module.shift, original.shift), f"rank {rank}: the buffer is not rank 0's"
    full = fsdp.gather_full_params()
    assert list(full) == list(shapes) and "head.weight" not in full, f"rank {rank}: names {list(full)}"
    assert {k: t.shape for k, t in full.items()} == shapes, f"rank {rank}: shapes {full}"
    assert all(torch.equal(full[k], p) for k, p in original.named_parameters()), f"rank {rank}: not rank 0's start"
    names = dict(fsdp.module.named_parameters())
    replicated = {"fixed.weight", "fixed.bias", "norm.weight", "norm.bias"}
    sharded = {"embed.shard", "head.shard", *(f"blocks.{i}.0.shard" for i in range(3))}
    assert set(names) == replicated | sharded, f"rank {rank}: the model's parameters are now {sorted(names)}"
    assert not any(names[k].requires_grad for k in ("fixed.weight", "fixed.bias")), f"rank {rank}: fixed thawed"
    sizes = {"embed.shard": shapes["embed.weight"].numel(), "head.shard": shapes["head.bias"].numel()}
    sizes.update({f"blocks.{i}.0.shard": 16 * 16 + 16 for i in range(3)})
    for k, size in sizes.items():
        want = (math.ceil(size / n),)
        assert names[k].shape == want and names[k].dtype == torch.float32, f"rank {rank}: {k} {names[k].shape}"
    whole = sum(4 * shapes[k].numel() for k in replicated)
    assert held(fsdp.parameters()) == whole + sum(4 * math.ceil(s / n) for s in sizes.values()), "held bytes"

    # Linear only: embed is not sharded, so the weight it shares with head stays whole and replicated.
    linear = fsdp_lesson.HandFSDP(TinyLM(seed=rank), shard=lambda m: isinstance(m, torch.nn.Linear))
    names = dict(linear.module.named_parameters())
    assert "embed.weight" in names and "embed.shard" not in names and "head.shard" in names, sorted(names)
    assert linear.module.head.weight is linear.module.embed.weight, f"rank {rank}: the tie is broken"
    alone = TinyLM(seed=0)
    for model in (alone, linear):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        for step in range(STEPS):
            ids, targets = lessons["15_sharded_optimizer"].batch(step, n, None if model is alone else rank)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(ids), targets).backward()
            if model is linear:
                model.finish_gradient_synchronization()
            opt.step()
    got, want = linear.gather_full_params(), dict(alone.named_parameters())
    gap = max((got[k] - want[k]).abs().max().item() for k in want)
    assert gap < TOL32, f"rank {rank}: Linear-only HandFSDP is {gap:.1e} from one process"
    for k, shard in linear.module.named_parameters():
        if k.endswith(".shard"):  # the padding is the end of the last rank's piece: never any gradient
            pad = max(0, (rank + 1) * shard.numel() - sizes[k])
            assert not shard[shard.numel() - pad :].any(), f"rank {rank}: {k}'s padding moved"


def elsewhere(ctx, lessons):
    """Both classes with meta as the default device, the parameters elsewhere; HandFSDP with in-place ReLUs."""
    import torch
    import torch.nn.functional as F

    opt_lesson, fsdp_lesson = lessons["15_sharded_optimizer"], lessons["15_hand_fsdp"]
    n, rank, device = ctx.world_size, ctx.rank, ctx.device

    def model(seed):
        m = opt_lesson.TinyLM(seed=seed).to(device)
        for block in m.blocks:  # in place on a sharded Linear's output: fully_shard allows it, so must HandFSDP
            block[1] = torch.nn.ReLU(inplace=True)
        return m

    batches = [[t.to(device) for t in opt_lesson.batch(step, n)] for step in range(STEPS)]  # every rank's rows
    mine = [[t.to(device) for t in opt_lesson.batch(step, n, rank)] for step in range(STEPS)]
    runs = {}
    for kind in ("alone", "sharded", "fsdp"):
        net = model(0 if kind != "fsdp" else rank)
        with torch.device("meta"):  # what the classes make without device= lands here, and gloo refuses it
            if kind == "fsdp":
                net = fsdp_lesson.HandFSDP(net)
            options = dict(lr=0.1, momentum=0.9)
            if kind == "sharded":  # every rank on every row: the gradients are the mean already
                opt = opt_lesson.ShardedOptimizer(net.parameters(), torch.optim.SGD, **options)
            else:
                opt = torch.optim.SGD(net.parameters(), **options)
            for step in range(STEPS):
                ids, targets = (mine if kind == "fsdp" else batches)[step]
                opt.zero_grad()
                F.cross_entropy(net(ids), targets).backward()
                if kind == "fsdp":
                    net.finish_gradient_synchronization()
                opt.step()
            runs[kind] = net.gather_full_params() if kind == "fsdp" else dict(net.named_parameters())
    for kind in ("sharded", "fsdp"):
        gap = max((runs[kind][k] - p).abs().max().item() for k, p in runs["alone"].items())
        assert gap < TOL32, f"rank {rank}: {kind} on {device} under a meta default is {gap:.1e} from one process"


def rank_main():

    import lessonlib

    ctx = lessonlib.setup(device="cpu", timeout=30)
    lessons = {stem: lessonlib.load_lesson(stem) for stem in ("15_sharded_optimizer", "15_hand_fsdp")}
    sharded_optimizer(ctx, lessons)
    hand_fsdp(ctx, lessons)
    elsewhere(ctx, lessons)
    print(f"rank {ctx.rank}: contracts kept")
    lessonlib.teardown()


if __name__ == "__main__":
    rank_main()
