"""python benchmarks/build_sharding.py [--world-sizes 2,4] [--vocab 1024] [--dim 256]

Chapter 15's ShardedOptimizer and HandFSDP as ratios: state bytes, gathered bytes, bytes sent.

One model, lessons/15_sharded_optimizer.py's TinyLM (float32, head.weight tied to embed.weight, a frozen
Linear, a buffer) at --vocab and --dim (0.53M parameters by default, half of them the embedding), 16 tokens
per rank and step, at every --world-sizes (one launch each, bounded). After a warm-up step, per rank:
  state   ShardedOptimizer(AdamW) under DDP: the bytes of AdamW state this rank holds (lessonlib.sharding.held),
          over the unsharded AdamW's; and ZeroRedundancyOptimizer's, whose ranks hold whole parameters
          (the largest rank's is shown: the embedding's whole state sits on one rank);
  sent    the bytes this rank sent in one training step (lessonlib.sharding.Traffic) over the ring model:
          ShardedOptimizer, DDP's all-reduce plus the all-gather of the updated slices, which is
          sent_per_step(P, N, "zero1", reduce_scatter="allreduce") on gloo; HandFSDP, per use of each
          flat (the tied one twice), an all-gather in forward and one in backward, a reduce-scatter (gloo:
          as costly as an all-reduce), and the replicated parameters' all-reduce; beside it, chapter 13's
          sent_per_step(P, N, "fsdp"), which does not know that a tied weight is gathered for each use;
  peak    HandFSDP's most gathered bytes at once (float32, float32 with prefetch, bfloat16) over the whole
          model's bytes in the same dtype.
Prints one table; each figure is a ratio, measured. No threshold: this reports, it does not pass or fail.
Under torchrun it runs as one rank of the benchmark.
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lessonlib, installed or not

import lessonlib  # noqa: E402

RUN_TIMEOUT = 300  # seconds per launch; the defaults take some 20 s at 4 ranks on 2 cores
ROWS = 16  # tokens per rank and step


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lessonlib.sharding import Traffic, held, optimizer_state, sent_per_step

    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=120)
    n, rank = ctx.world_size, ctx.rank
    sharded, fsdp_lesson = lessonlib.load_lesson("15_sharded_optimizer"), lessonlib.load_lesson("15_hand_fsdp")
    g = torch.Generator().manual_seed(rank)
    ids, targets = torch.randint(args.vocab, (2, ROWS), generator=g)

    def model():
        return sharded.TinyLM(seed=0, vocab=args.vocab, dim=args.dim)

    def step(net, opt, sync=None):
        opt.zero_grad()
        F.cross_entropy(net(ids), targets).backward()
        if sync:
            sync()
        opt.step()

    row = {"rank": rank}
    trainable = sum(p.numel() for p in model().parameters() if p.requires_grad)
    for kind in ("adamw", "sharded", "zero"):
        net = DDP(model())
        params = [p for p in net.parameters() if p.requires_grad]
        if kind == "adamw":
            opt = torch.optim.AdamW(params, lr=1e-3)
        elif kind == "sharded":
            opt = sharded.ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)
        else:
            opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)
        step(net, opt)  # the warm-up: DDP's buckets, the optimizer's state
        dist.barrier()
        with Traffic() as t:  # nothing may print in here: stdout's bytes would count as sent
            step(net, opt)
        local = {"sharded": getattr(opt, "local", None), "zero": getattr(opt, "optim", None)}.get(kind, opt)
        row[f"{kind} state"], row[f"{kind} sent"] = held(optimizer_state(local)), t.sent
    row["zero1 model"] = sent_per_step(trainable, n, "zero1", reduce_scatter="allreduce")

    for name, dtype, prefetch in (
        ("float32", None, False),
        ("prefetch", None, True),
        ("bfloat16", torch.bfloat16, False),
    ):
        fsdp = fsdp_lesson.HandFSDP(model(), compute_dtype=dtype)
        fsdp.prefetch = prefetch
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        step(fsdp, opt, fsdp.finish_gradient_synchronization)
        dist.barrier()
        with Traffic() as t:
            step(fsdp, opt, fsdp.finish_gradient_synchronization)
        size = (dtype or torch.float32).itemsize
        flats = [s.numel() * n for m in fsdp.last_order for s in fsdp.shards_of[m]]  # per use, padded
        replicated = sum(p.numel() for p in fsdp.replicated.values() if p.requires_grad)
        one = (n - 1) / n  # an all-gather or a ring reduce-scatter, per byte of the whole tensor
        model_sent = one * (2 * size * sum(flats) + 2 * 4 * sum(flats) + 2 * 4 * replicated)
        everything = sum(p.numel() for p in model().parameters())
        row[f"{name} peak"], row[f"{name} whole"] = fsdp.peak, everything * size
        row[f"{name} sent"], row[f"{name} model"] = t.sent, model_sent
    row["fsdp ch13 model"] = sent_per_step(trainable, n, "fsdp", reduce_scatter="allreduce")
    lessonlib.report("measured", row)
    print(f"rank {rank}: {row}")
    lessonlib.teardown()


def ratio(a, b):
    return None if a is None or not b else a / b


def summarize(run):
    """The ratios of one launch: state and peak of the rank that holds most, sent averaged over ranks."""
    rows = [row for _, row in run.reports("measured")]
    most = {k: max(r[k] for r in rows) for k in rows[0] if k != "rank"}
    sent = {k: None if None in (v := [r[k] for r in rows]) else statistics.mean(v) for k in rows[0] if "sent" in k}
    out = {
        "state: sharded / AdamW": ratio(most["sharded state"], most["adamw state"]),
        "state: ZeRO's largest rank / AdamW": ratio(most["zero state"], most["adamw state"]),
        "sent: sharded / ring model": ratio(sent["sharded sent"], most["zero1 model"]),
        "sent: ZeRO / ring model": ratio(sent["zero sent"], most["zero1 model"]),
    }
    for name in ("float32", "prefetch", "bfloat16"):
        out[f"peak: HandFSDP {name} / model"] = ratio(most[f"{name} peak"], most[f"{name} whole"])
    for name in ("float32", "bfloat16"):
        out[f"sent: HandFSDP {name} / ring model"] = ratio(sent[f"{name} sent"], most[f"{name} model"])
    out["sent: HandFSDP float32 / chapter 13's fsdp"] = ratio(sent["float32 sent"], most["fsdp ch13 model"])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--world-sizes",
        type=lessonlib.comma_list(int, low=2, high=lessonlib.MAX_NPROC),
        default="2,4",
        help=f"comma-separated, each within 2..{lessonlib.MAX_NPROC}",
    )
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()
    if args.vocab < 2 or args.dim < 1:
        parser.error("need --vocab >= 2 and --dim >= 1")
    if "RANK" in os.environ:  # one rank of the launches below (or of a torchrun by hand)
        return worker(args)
    numel = args.vocab * args.dim + 4 * (args.dim + 1) * args.dim + 2 * args.dim + args.vocab
    print(f"TinyLM(vocab={args.vocab}, dim={args.dim}): {numel:,} float32 parameters, {ROWS} tokens per rank")
    table = {}
    for n in args.world_sizes:
        given = ["--vocab", str(args.vocab), "--dim", str(args.dim)]
        run = lessonlib.launch(
            __file__, nproc=n, timeout=RUN_TIMEOUT, show="none", env={"OMP_NUM_THREADS": "1"}, args=given
        ).raise_for_status()
        table[n] = summarize(run)
    width = max(map(len, table[args.world_sizes[0]]))
    print(f"{'ratio':<{width}}" + "".join(f"{f'{n} ranks':>10}" for n in args.world_sizes))
    for key in table[args.world_sizes[0]]:
        cells = [table[n][key] for n in args.world_sizes]
        print(f"{key:<{width}}" + "".join(f"{'n/a':>10}" if c is None else f"{c:>10.3f}" for c in cells))
    print("(state: 1/N would be even; sent: 1.00 is the model exactly, gloo adds a small header to each message)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
