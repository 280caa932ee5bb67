"""torchrun --nproc_per_node=3 lessons/07_construction.py

What DistributedDataParallel does before any gradient moves: broadcasts, buffers, and model.module.

Options: --steps 3 (the default).

1. Construction broadcasts rank 0's parameters and buffers into every rank's module, in place: ranks
   that built different models (seed + rank) hold rank 0's after DDP(model). `init_sync=False` skips
   it, and the models stay different (both asserted).
2. Buffers, such as BatchNorm's running mean, are not gradients: nothing averages them. By default DDP
   copies rank 0's buffers to every rank at the start of each forward(), and every rank then updates
   them from its own batch. So the running statistics that survive are rank 0's: an average over rank
   0's batches alone (asserted, against a BatchNorm fed rank 0's batches in one process), while a
   checkpoint saved by rank 0 and a forward in eval mode use exactly those. After training the ranks'
   running means differ (asserted). forward_sync_buffers=False turns the per-forward copy off but
   still copies at construction; the older broadcast_buffers=False warns (FutureWarning) and skips
   that copy too (both asserted).
3. `ddp.module` is the model that was wrapped. DDP's state_dict names every entry `module.` + name,
   so a checkpoint of `ddp.state_dict()` does not load into the bare model (the real error is shown);
   save `ddp.module.state_dict()` instead, or strip the prefix from an old checkpoint.
"""

import argparse
import hashlib
import warnings

import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import flat_params, gather

ALONE = "BatchNorm fed rank 0's batches alone"


def build(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def fingerprint(model):
    return hashlib.sha1(flat_params(model).numpy().tobytes()).hexdigest()[:8]


def construction(ctx, seed):
    rows = {}
    for init_sync in (True, False):
        model = build(seed + ctx.rank)  # every rank builds a different model
        model[1].running_mean.fill_(float(ctx.rank))  # and holds different buffers
        before = fingerprint(model)
        # [start: construct]
        ddp = DDP(model, init_sync=init_sync)  # True (the default): rank 0's weights, copied in place
        # [end: construct]
        assert ddp.module is model
        copies = gather(torch.cat([flat_params(model), model[1].running_mean]))  # parameters and buffers
        equal = all(torch.equal(c, copies[0]) for c in copies)
        assert equal == (init_sync or ctx.world_size == 1), f"rank {ctx.rank}: init_sync={init_sync}: equal={equal}"
        rows[f"init_sync={init_sync}"] = {"before": before, "after": fingerprint(model)}
    return rows


def batch(rank, step):
    """Rank r's batch: its rows are shifted by 3 r, so the ranks' statistics really differ."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 4, generator=g) + 3.0 * rank


def buffers(ctx, steps):
    """Running means after training, gathered from every rank; and what rank 0's batches alone give."""
    ddp = DDP(build(0))
    for step in range(steps):
        ddp(batch(ctx.rank, step)).sum().backward()
    after_training = gather(ddp.module[1].running_mean.clone())
    ddp.eval()
    with torch.no_grad():
        ddp(batch(ctx.rank, steps))  # eval: the buffers are copied from rank 0, and not updated
    after_eval = gather(ddp.module[1].running_mean.clone())
    alone = build(0)  # one process, rank 0's batches only
    for step in range(steps):
        alone(batch(0, step))
    expected = alone[1].running_mean
    assert torch.allclose(after_training[0], expected, atol=1e-6), "rank 0's running mean is not rank 0's data alone"
    distinct = len({c.numpy().tobytes() for c in after_training}) == ctx.world_size
    assert distinct, f"rank {ctx.rank}: after training, some ranks hold the same running mean"
    assert all(torch.equal(c, after_eval[0]) for c in after_eval), f"rank {ctx.rank}: eval did not sync the buffers"
    return {
        "running mean[0] after training, by rank": [c[0].item() for c in after_training],
        "after an eval forward": [c[0].item() for c in after_eval],
        ALONE: expected[0].item(),
    }


def buffer_flags(ctx):
    """At construction: forward_sync_buffers=False still copies rank 0's buffers; broadcast_buffers=False does not."""
    equal = {}
    for flag in ("forward_sync_buffers", "broadcast_buffers"):
        model = build(0)  # the same parameters everywhere; the buffers differ
        model[1].running_mean.fill_(float(ctx.rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DDP(model, **{flag: False})
        deprecated = any(issubclass(w.category, FutureWarning) and flag in str(w.message) for w in caught)
        assert deprecated == (flag == "broadcast_buffers"), (
            f"rank {ctx.rank}: {flag}=False, FutureWarning: {deprecated}"
        )
        copies = gather(model[1].running_mean.clone())
        equal[flag] = all(torch.equal(c, copies[0]) for c in copies)
        assert equal[flag] == (flag == "forward_sync_buffers" or ctx.world_size == 1), f"{flag}=False: {equal}"
    return equal


def module_and_checkpoints(ctx):
    ddp = DDP(build(0))
    keys = list(ddp.state_dict())
    plain = build(1)
    # [start: load_error]
    try:
        plain.load_state_dict(ddp.state_dict())  # the keys start with "module."
    except RuntimeError as e:
        error = str(e)
    plain.load_state_dict(ddp.module.state_dict())  # what to save instead
    # [end: load_error]
    assert "Missing key(s)" in error and "Unexpected key(s)" in error, error
    old = ddp.state_dict()
    consume_prefix_in_state_dict_if_present(old, "module.")  # for a checkpoint already saved that way
    plain.load_state_dict(old)
    assert torch.equal(flat_params(plain), flat_params(ddp.module))
    return {"ddp keys": keys, "module keys": list(ddp.module.state_dict()), "error": error}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=3, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")

    built = lessonlib.report("construction", construction(ctx, args.seed))
    stats = lessonlib.report("buffers", buffers(ctx, args.steps))
    flags = lessonlib.report("buffer_flags", buffer_flags(ctx))
    ckpt = lessonlib.report("checkpoint", module_and_checkpoints(ctx))
    dist.barrier()
    print(
        f"rank {ctx.rank}: fingerprint before -> after DDP(model): "
        + ", ".join(f"{k}: {v['before']} -> {v['after']}" for k, v in built.items())
    )
    if ctx.is_main:
        print(
            f"running_mean[0] after {args.steps} training steps, by rank: "
            f"{[round(v, 4) for v in stats['running mean[0] after training, by rank']]}; after an eval forward: "
            f"{[round(v, 4) for v in stats['after an eval forward']]}; rank 0's batches alone: "
            f"{stats[ALONE]:.4f}"
        )
        print(f"buffers equal on every rank after DDP(model, flag=False): {flags}")
        print(f"ddp.state_dict() keys {ckpt['ddp keys'][:2]}...; loading them into the bare model:")
        for line in ckpt["error"].splitlines()[:3]:
            print("  " + line.strip()[:150])
    lessonlib.teardown()


if __name__ == "__main__":
    main()
