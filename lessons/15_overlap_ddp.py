"""torchrun --nproc_per_node=2 lessons/15_overlap_ddp.py

OverlappedDDP(module): each gradient's all-reduce starts inside backward(), the moment that gradient is ready.

Options: --layers 6, --width 128, --batch 1024 (the timed model), --steps 5 (timed steps), --pg-timeout S.

NaiveDDP (lessons/15_naive_ddp.py) waits for backward() to end, then sends every gradient. OverlappedDDP
registers a post-accumulate-grad hook on every trainable parameter: autograd calls it once that
parameter's .grad holds its final sum, and the hook starts an asynchronous all-reduce (async_op=True)
and keeps its handle; finish_gradient_synchronization() waits for every handle and divides by N.
Asserted, on every rank:
1. On TiedNet (float64, tied, frozen, buffers; each rank its own seed) OverlappedDDP's gradients at
   every step and its weights after 3 SGD steps equal one process on every rank's rows, NaiveDDP and
   torch's DDP within TOL; the tied weight gets one hook, so it is sent once (payload = trainable bytes).
2. A timeline, chapter 7's way, on a float32 stack of Linear + Tanh layers, NaiveDDP and OverlappedDDP
   alternating step by step (one warm-up step each): every all-reduce of OverlappedDDP is launched
   from a gradient hook, so inside backward() (the hooks see one launch per trainable tensor, none is
   left for finish), and the launches come in the same order on every rank. gloo pairs collectives by
   the order each rank issues them, so that order must match: the same model and graph make autograd
   run the hooks in the same order everywhere. A rank whose graph differs (a branch only it takes)
   would pair one parameter's all-reduce with another's: an error if the sizes differ, silently mixed
   gradients if they do not.
Measured, not asserted (a 2-core machine is noisy): the step (from the start of backward() to the
return of finish_gradient_synchronization()), median over the timed steps, split into backward() and
the communication exposed after it; and the share of a step's bytes this rank had sent when backward()
returned (Linux). The communication alone: NaiveDDP's finish_gradient_synchronization() again after
each round, every rank starting it at a barrier (no backward beside it, no slower rank to wait for).
The share hidden is hidden() below: (NaiveDDP's step - OverlappedDDP's step) / the communication
alone. It counts all that overlap changed: on gloo, an all-reduce waiting in gloo's queue while
backward runs, and backward's own slowdown when the two share the CPU cores, are both in it.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.sharding import Traffic, bytes_written
from lessonlib.training import gather, max_gap

naive = lessonlib.load_lesson("15_naive_ddp")  # NaiveDDP, TiedNet and the float64 training both lessons compare
NaiveDDP, TiedNet, train, grad_gap, TOL = naive.NaiveDDP, naive.TiedNet, naive.train, naive.grad_gap, naive.TOL
WARMUP = 1


# [start: overlapped]
class OverlappedDDP(NaiveDDP):  # NaiveDDP's __init__ broadcasts rank 0's parameters and buffers, and no_sync()
    """Each gradient's all-reduce starts in backward(), as soon as autograd has finished that gradient.
    To accumulate, run all backward()s but the last inside no_sync(); a second one outside it is refused."""

    def __init__(self, module):
        super().__init__(module)
        self.handles = []  # (parameter, work) for every all-reduce started this step
        self.names = {id(p): k for k, p in module.named_parameters()}
        for p in module.parameters():  # each tensor once: a tied weight gets one hook
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._launch)

    def _launch(self, p):  # autograd calls this once p.grad holds its sum over every use of p
        if not self.require_sync:
            return  # inside no_sync(): the gradient only adds up on this rank
        if any(q is p for q, _ in self.handles):  # its all-reduce may still be writing the .grad autograd just added to
            refuse_second_backward(self, self.names[id(p)])
        self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish_gradient_synchronization(self):
        n = dist.get_world_size()
        for p, work in self.handles:
            work.wait()  # bounded by the process group's timeout
            p.grad /= n
        self.handles.clear()


def refuse_second_backward(ddp, name):
    """Raised in backward(), once nothing is left in flight: a second gradient would be sent and divided again."""
    for *_, work in ddp.handles:
        work.wait()
    getattr(ddp, "on_train_batch_start", ddp.handles.clear)()  # BucketedDDP's counts start again too
    raise RuntimeError(
        f"rank {dist.get_rank()}: {name} got a second gradient before finish_gradient_synchronization(): to"
        " accumulate over K micro-batches, run the first K-1 backward()s inside `with ddp.no_sync():` (chapter 6)."
        " The gradients are now wrong: zero_grad() and start the step again"
    )


# [end: overlapped]


def stack(layers, width):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])


# [start: watch]
def watch(ddp):
    """A log of one step: when each gradient was ready, each all-reduce launched and done (perf_counter).
    Hooks added after the wrapper's run right after it: a new entry in ddp.handles is one it just launched."""
    log = {"ready": [], "comm": []}
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}

    def seen(p):
        now = time.perf_counter()
        log["ready"].append((index[id(p)], now))
        for handle in getattr(ddp, "handles", [])[len(log["comm"]) :]:  # NaiveDDP has none
            # What was sent (a parameter's index, or a bucket's), and when; the done time is stamped by
            # gloo's thread when the all-reduce completes.
            row = {"what": handle[0] if isinstance(handle[0], int) else index[id(handle[0])], "launch": now}
            row["stamped"] = handle[-1].get_future().then(lambda _, row=row: row.update(done=time.perf_counter()))
            log["comm"].append(row)

    for p in ddp.module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(seen)
    return log


# [end: watch]


def timed_step(ddp, log, x, y):
    """One forward/backward/finish, its events in ms from the start of backward()."""
    log["ready"].clear(), log["comm"].clear()
    if hasattr(ddp, "on_train_batch_start"):
        ddp.on_train_batch_start()
    ddp.zero_grad()
    loss = F.mse_loss(ddp(x), y)
    dist.barrier()  # every rank starts its backward together
    start, before = time.perf_counter(), bytes_written()
    loss.backward()
    end, by_end = time.perf_counter(), bytes_written()
    ddp.finish_gradient_synchronization()
    finish, after = time.perf_counter(), bytes_written()
    ms = lambda t: (t - start) * 1e3  # noqa: E731
    for row in log["comm"]:
        row.pop("stamped").wait()
    comm = [(ms(r["launch"]), ms(r["done"]), r["what"]) for r in log["comm"]] or [(ms(end), ms(finish), None)]
    return {
        "backward_ms": ms(end),
        "finish_ms": ms(finish),
        "ready": [(i, ms(t)) for i, t in log["ready"]],
        "comm": comm,
        # bytes this rank had written (gloo's sockets: nothing else writes meanwhile) when backward() returned,
        # and by the end of the step; None where /proc/self/io does not exist
        "sent": None if before is None else [by_end - before, after - before],
    }


def medians(runs):
    """A variant's median step, in ms, from the start of backward() to the return of
    finish_gradient_synchronization(), and that same step's parts: backward() and what was exposed after it."""
    step = statistics.median_low([s["finish_ms"] for s in runs])
    s = next(s for s in runs if s["finish_ms"] == step)
    return {"step": step, "backward": s["backward_ms"], "exposed": step - s["backward_ms"]}


def communication_alone(ddp):
    """ms of ddp.finish_gradient_synchronization() on the gradients it holds, started on every rank at once
    (a barrier): NaiveDDP's all-reduces with no backward() beside them and no slower rank to wait for."""
    dist.barrier()
    start = time.perf_counter()
    ddp.finish_gradient_synchronization()
    return (time.perf_counter() - start) * 1e3


def hidden(sequential, overlapped, alone):
    """The share of the communication that overlap took off the step: (NaiveDDP's step - the overlapped step)
    / the communication alone, in ms. 1: all of it hidden; 0: no shorter; below 0: slower; above 1: backward()
    ran faster, or NaiveDDP's step waited longer for the slower rank. It counts all that changed: on gloo,
    an all-reduce waiting in gloo's queue during backward(), and backward()'s own slowdown when gloo's
    threads take its CPU cores, are in it."""
    return (sequential - overlapped) / alone


def check_tied(ctx, want):
    """OverlappedDDP on TiedNet against one process, NaiveDDP and torch's DDP: the largest gap."""
    n, rank = ctx.world_size, ctx.rank
    ddp = OverlappedDDP(TiedNet(seed=rank))
    with Traffic() as traffic:
        grads, weights = train(ddp, 3, n, rank, ddp.finish_gradient_synchronization)
    plain = NaiveDDP(TiedNet(seed=rank))
    others = {"one process": want, "NaiveDDP": train(plain, 3, n, rank, plain.finish_gradient_synchronization)}
    others["torch DDP"] = train(DDP(TiedNet(seed=rank)), 3, n, rank)
    gaps = {k: max(max_gap(weights, w), *map(grad_gap, grads, g)) for k, (g, w) in others.items()}
    assert all(gap < TOL for gap in gaps.values()), f"rank {rank}: OverlappedDDP's gradients or weights: {gaps}"
    trainable = naive.trainable_bytes(ddp)
    assert traffic.payload["all_reduce"] == 3 * trainable, f"rank {rank}: {traffic.payload} for {trainable} B"
    return gaps


def alternate(variants, args, rank):
    """Each variant's timed steps after WARMUP, on the same rows (args.batch x args.width), the variants taking
    turns step by step so that the machine's load hits them alike; and after each round, NaiveDDP's
    communication alone (ms), where it is one of them."""
    logs = {name: watch(ddp) for name, ddp in variants.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    steps, alone = {name: [] for name in variants}, []
    for i in range(WARMUP + args.steps):
        for name, ddp in variants.items():
            step = timed_step(ddp, logs[name], x, y)
            if i >= WARMUP:
                steps[name].append(step)
        if i >= WARMUP and "NaiveDDP" in variants:
            alone.append(communication_alone(variants["NaiveDDP"]))
    return steps, alone


def timing_options(parser):
    """The timed stack's options, shared with lessons/15_bucketed_ddp.py so that both time the same model."""
    parser.add_argument("--layers", type=int, default=6, choices=range(2, 33), metavar="2..32")
    parser.add_argument("--width", type=int, default=128, choices=range(8, 1025), metavar="8..1024")
    parser.add_argument("--batch", type=int, default=1024, choices=range(1, 4097), metavar="1..4096")
    parser.add_argument("--steps", type=int, default=5, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    timing_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    rank = ctx.rank
    gaps = check_tied(ctx, naive.reference(3, ctx.world_size))

    variants = {"NaiveDDP": NaiveDDP(stack(args.layers, args.width))}
    variants["OverlappedDDP"] = OverlappedDDP(stack(args.layers, args.width))
    steps, alone = alternate(variants, args, rank)
    tensors = 2 * args.layers
    for step in steps["OverlappedDDP"]:
        # watch() sees launches from the gradient hooks, which run inside backward(): all of them there
        assert len(step["comm"]) == tensors, f"rank {rank}: {len(step['comm'])} launched in backward, not {tensors}"
    order = torch.tensor([i for _, _, i in steps["OverlappedDDP"][-1]["comm"]])  # parameters, as launched
    assert all(torch.equal(o, order) for o in gather(order)), f"rank {rank}: hooks ran in another order: {order}"
    summary = {name: medians(runs) for name, runs in steps.items()}
    comm = statistics.median(alone)
    share = hidden(summary["NaiveDDP"]["step"], summary["OverlappedDDP"]["step"], comm)
    sent = [s["sent"] for s in steps["OverlappedDDP"]]  # [by the end of backward(), in the whole step]
    early = statistics.median(a / b for a, b in sent) if sent[0] and sent[0][1] else None  # None: no /proc, or 1 rank
    lessonlib.report(
        "overlap",
        {"ms (medians)": summary, "communication alone": comm, "hidden": share, "sent by the end of backward": early},
    )
    if ctx.is_main:
        lessonlib.report("tied", {k: f"{v:.1e}" for k, v in gaps.items()})
        lessonlib.report("timeline", {name: runs[-1] for name, runs in steps.items()} | {"order": order.tolist()})
        print("OverlappedDDP on TiedNet, largest gap to " + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))
        for name, s in summary.items():
            print(
                f"{name:14} step {s['step']:6.2f} ms: backward {s['backward']:6.2f} ms, "
                f"then {s['exposed']:6.2f} ms exposed"
            )
        print(f"NaiveDDP's all-reduces alone, after a barrier: {comm:6.2f} ms")
        print(
            f"OverlappedDDP's step is {summary['OverlappedDDP']['step'] / summary['NaiveDDP']['step']:.2f} x "
            f"NaiveDDP's: {share:.0%} of the communication time hidden"
        )
        if early is not None:
            print(f"OverlappedDDP: {early:.0%} of a step's bytes had left this rank when backward() returned")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
