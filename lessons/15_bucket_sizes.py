"""torchrun --nproc_per_node=2 lessons/15_bucket_sizes.py

What a bucket costs: buckets x per-message latency + bytes / bandwidth, measured on gloo, and what overlap buys.

Options: --layers 6, --width 128, --batch 1024, --steps 5 (the timed model and steps, as in
lessons/15_overlap_ddp.py), --reps 7 (timings per message size and per bucket count), --pg-timeout S.

The model. S bytes of gradients sent as b all-reduces cost, alone,
    comm(b) = b * alpha + S / beta
alpha: the fixed cost of one all-reduce whatever its size; beta: the bytes per second the all-reduces
move (their payload, not the bytes on the wire). Sent after backward() (NaiveDDP), all of it is exposed.
Overlapped, with backward() taking T and b equal buckets ready at T/b, 2T/b, ..., T, sent one after the
other, each taking c = alpha + S / (b * beta):
    step(b) = max(T + c, T / b + b * c)
the first term when communication keeps pace with backward (only the last bucket is left after it), the
second when it does not (b messages in a chain from the moment the first bucket is ready). More buckets
make the last one smaller and the first one start sooner; each one adds alpha.
Measured on every rank, each communication timing the best of --reps (the least disturbed by the
machine's other work), the cases taking turns:
1. one all-reduce of each of SIZES bytes, nothing else running, and alpha and beta from them: the
   least-squares line t = alpha + bytes / beta;
2. comm(b) alone, beside the model's: the stack's gradients in the buckets BucketedDDP makes at caps that
   give one bucket per tensor, per layer, per 2 and 3 layers, and one (12, 6, 3, 2 and 1 at 6 layers),
   launched together and waited for, with no backward;
3. step(b): NaiveDDP and BucketedDDP at those caps, alternating step by step (lessons/15_overlap_ddp.py's
   timed_step), the median step, beside the model's with T = NaiveDDP's backward().
Asserted, on every rank: each bucket is launched from the hook of its last gradient (the launch carries
that gradient's timestamp: earlier would be a bucket sent before it was full; later, or in finish, one
that waited); at N > 1, comm(a bucket per tensor) > comm(one bucket): each message has a fixed cost.
Not asserted: how close the model comes. On 2 shared CPU cores backward() and gloo's threads slow each
other down and the ranks' backward()s end at different times, which the model leaves out.
"""

import argparse
import time

import torch
import torch.distributed as dist

import lessonlib

bucketed = lessonlib.load_lesson("15_bucketed_ddp")  # BucketedDDP, assign_buckets, and through it
overlap, naive = bucketed.overlap, bucketed.naive  # the timed stack, watch(), timed_step(), medians()
SIZES = [4 * 2**10, 32 * 2**10, 128 * 2**10, 512 * 2**10, 2 * 2**20]  # bytes, float32 all-reduces


def time_allreduces(cases, reps):
    """{name: [numel, ...]}: the best ms over `reps` of all-reducing float32 tensors of those sizes, launched
    together, then waited for, nothing else running; the cases take turns, so that load hits them alike."""
    tensors = {name: [torch.ones(n) for n in numels] for name, numels in cases.items()}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(reps):
        for name, ts in tensors.items():
            dist.barrier()  # every rank starts together
            start = time.perf_counter()
            for work in [dist.all_reduce(t, async_op=True) for t in ts]:
                work.wait()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


# [start: model]
def fit(sizes, ms):
    """alpha (ms) and 1 / beta (ms per byte): the least-squares line ms = alpha + bytes / beta."""
    a = torch.tensor([[1.0, b] for b in sizes], dtype=torch.float64)
    alpha, per_byte = torch.linalg.lstsq(a, torch.tensor(ms, dtype=torch.float64)[:, None]).solution.flatten()
    return alpha.item(), per_byte.item()


def comm_model(b, total, alpha, per_byte):
    """b all-reduces of `total` bytes in all, alone: b fixed costs, and the bytes."""
    return b * alpha + total * per_byte


def step_model(b, total, alpha, per_byte, backward):
    """Overlapped: b equal buckets, ready evenly through backward(), sent one after the other."""
    c = alpha + total / b * per_byte  # one bucket
    return max(backward + c, backward / b + b * c)  # the last bucket left over, or the chain of b


# [end: model]


def check_launches(name, ddp, steps, rank):
    """Each bucket launched from its last gradient's hook: watch() stamps a launch with the time of the hook
    that first sees it, the same number as that gradient's ready time."""
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    for step in steps:
        ready = dict(step["ready"])  # parameter index -> ms
        assert len(step["comm"]) == len(ddp.buckets), f"rank {rank}: {name}: launched in backward {step['comm']}"
        for launch, _, i in step["comm"]:
            last = max(ready[index[id(p)]] for p in ddp.buckets[i])
            assert launch == last, f"rank {rank}: {name}: bucket {i} launched at {launch:.3f} ms, full at {last:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    overlap.timing_options(parser)
    parser.add_argument("--reps", type=int, default=7, choices=range(3, 31), metavar="3..30")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    n, rank = ctx.world_size, ctx.rank

    sizes = time_allreduces({s: [s // 4] for s in SIZES}, args.reps)
    alpha, per_byte = fit(SIZES, [sizes[s] for s in SIZES])  # one message at a time: the link and gloo
    # Caps that cut the stack into a bucket per tensor, per k layers (k dividing --layers), one bucket
    params = list(overlap.stack(args.layers, args.width).parameters())
    total, layer = sum(map(bucketed.nbytes, params)), sum(map(bucketed.nbytes, params[:2]))
    caps = [1e-6] + [k * layer / bucketed.MIB for k in range(1, args.layers + 1) if args.layers % k == 0]
    cuts = {
        cap: [sum(p.numel() for p in b) for b in bucketed.assign_buckets(params, cap * bucketed.MIB)] for cap in caps
    }
    alone = time_allreduces({len(c): c for c in cuts.values()}, args.reps)  # buckets -> ms
    if n > 1:
        most, one = alone[max(alone)], alone[1]
        assert most > one, f"rank {rank}: {max(alone)} all-reduces took {most:.2f} ms, one of the same bytes {one:.2f}"

    variants = {"NaiveDDP": naive.NaiveDDP(overlap.stack(args.layers, args.width))}
    variants |= {len(c): bucketed.BucketedDDP(overlap.stack(args.layers, args.width), cap) for cap, c in cuts.items()}
    steps, _ = overlap.alternate(variants, args, rank)
    for b, ddp in variants.items():
        if b != "NaiveDDP":
            check_launches(f"{b} buckets", ddp, steps[b], rank)
    times = {b: overlap.medians(runs)["step"] for b, runs in steps.items()}
    backward = overlap.medians(steps["NaiveDDP"])["backward"]
    rows = [
        {
            "buckets": b,
            "alone": alone[b],
            "alone, model": comm_model(b, total, alpha, per_byte),
            "step": times[b],
            "step, model": step_model(b, total, alpha, per_byte, backward),
        }
        for b in sorted(alone, reverse=True)
    ]
    # the model's best count among those buckets of whole tensors can reach: 1 to a bucket per tensor
    best = min(range(1, len(params) + 1), key=lambda b: step_model(b, total, alpha, per_byte, backward))
    lessonlib.report(
        "buckets",
        {
            "alpha ms": alpha,
            "ms per byte": per_byte,
            "sizes": [[s, ms, comm_model(1, s, alpha, per_byte)] for s, ms in sizes.items()],
            "rows": rows,
            "NaiveDDP": {"step": times["NaiveDDP"], "backward": backward},
            "NaiveDDP, model": backward + comm_model(len(params), total, alpha, per_byte),
            "bytes": total,
            "model's best": best,
            "model's best step": step_model(best, total, alpha, per_byte, backward),
        },
    )
    if ctx.is_main:
        beta = f"{1e-3 / per_byte:.0f} MB/s" if per_byte > 0 else "(no slope)"
        print(f"one all-reduce: alpha {alpha * 1e3:.0f} us, beta {beta}; {total} B of gradients, N = {n}")
        print(f"NaiveDDP: step {times['NaiveDDP']:.1f} ms, backward {backward:.1f} ms")
        print(f"{'buckets':>7} {'alone ms':>9} {'model':>7} {'step ms':>8} {'model':>7}")
        for r in rows:
            print(
                f"{r['buckets']:7} {r['alone']:9.2f} {r['alone, model']:7.2f} {r['step']:8.2f} {r['step, model']:7.2f}"
            )
        print(f"the model's best bucket count here (1 to {len(params)}): {best}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
