"""torchrun --nproc_per_node=2 lessons/14_compile.py

torch.compile with DDP: one graph per bucket, the same weights, what compiling costs, and what compiles nothing.

Options: --backend aot_eager (the default: traces and runs the same ATen ops, generates no code) or inductor
(generates and compiles C++, which its first step pays for); --steps 4; --pg-timeout S (default 120).

The model: 4 Linear(512, 512, bias=False) layers with tanh, float32, under DDP with bucket_cap_mb=1: each
weight is 1 MiB, so each bucket holds one layer. A counting backend notes every graph torch.compile hands
to the real backend. Asserted:
  1. torch.compile(ddp): DDPOptimizer (torch._dynamo.config.optimize_ddp) cuts the forward graph where DDP
     would close a bucket, so that each bucket's gradients are complete, and its all-reduce can start,
     while backward still runs: the backend is given one graph per bucket; torch's counters
     (aot_autograd "total") and its log line ("created N buckets") agree; DDP's reducer then runs that
     many buckets per step, as eager DDP does. After --steps SGD steps the weights equal eager DDP's:
     bitwise with aot_eager, within TOL with inductor (which fuses and reorders arithmetic).
  2. The pitfall: torch.compile(DDP(nn.Sequential(...))) compiles nothing. Dynamo breaks the graph inside
     DDP's forward, and the frames left to run (Sequential.forward, all of torch.nn) are on its skip list:
     the backend is never called (asserted), the model runs eagerly. model.compile() before DDP(model)
     compiles it, one graph per bucket, and keeps the state_dict keys ("module.0.weight", not
     "_orig_mod.module.0.weight" as torch.compile(ddp) names them).
     A Sequential of blocks whose forward is in your file: those frames are compiled (graphs of a linear
     and a tanh), the same weights. Layers with a forward hook that appends to a list: Dynamo guards on
     that list, which every step changes, so it compiles again every step (asserted by the graph count).
  3. bucket_cap_mb below 1 fails under torch.compile: DDPOptimizer asserts that DDP's first bucket
     (1 MiB) is no bigger than the others (the real AssertionError, at the first call).
The first compiled step's time (the compile) and later steps' are measured and reported; chapter 14 bounds
the comparisons its prose makes (a second compile of the same graphs in this process against the first; the
hooked model's later steps, which compile again, against the compiled Net's).
Compiler caches go to a temporary folder, removed at the end (TORCHINDUCTOR_CACHE_DIR, and TMPDIR for inductor's
precompiled headers, which go to the temporary folder whatever TORCHINDUCTOR_CACHE_DIR says).
"""

import argparse
import contextlib
import io
import logging
import os
import re
import shutil
import statistics
import tempfile
import time

# The compilers' caches (inductor's, and AOTAutograd's) go to a folder of this process's, removed at the end,
# set before torch is imported (inductor's compile workers read it when they start). Inductor's precompiled
# C++ headers ignore TORCHINDUCTOR_CACHE_DIR: they go to <temporary folder>/torchinductor_<user> (torch/_inductor/
# codecache.py), so this process's temporary folder is the same one.
CACHE = tempfile.mkdtemp(prefix="ch14-compile-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["TMPDIR"] = CACHE
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

import torch  # noqa: E402 - after the cache folder is chosen
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.backends.registry import lookup_backend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import lessonlib  # noqa: E402

WIDTH, DEPTH, ROWS = 512, 4, 8
TOL = 1e-5  # inductor, largest absolute weight gap to eager (measured: 7e-9 at 2 ranks)


# [start: model]
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH))

    def forward(self, x):  # in this file: Dynamo compiles this frame
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def sequential():  # the same layers; its forward is torch.nn's own
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[m for _ in range(DEPTH) for m in (torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Tanh())]
    )


class Block(torch.nn.Module):  # a block written in this file, for a Sequential of your own blocks
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):  # in this file: Dynamo compiles this frame, inside the Sequential
        return torch.tanh(self.linear(x))


def user_blocks():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(DEPTH)])


def hooked(calls):  # Net with a forward hook on each layer that counts its calls (a Python side effect)
    net = Net()
    for layer in net.layers:
        layer.register_forward_hook(lambda module, args, out: calls.append(1))
    return net


# [end: model]


# [start: backend]
def counting(name, graphs):
    """A torch.compile backend: note each graph it is given (its op count), then let backend `name` compile it."""
    real = lookup_backend(name)

    def backend(gm, example_inputs):
        graphs.append(sum(node.op == "call_function" or node.op == "call_module" for node in gm.graph.nodes))
        return real(gm, example_inputs)

    return backend


# [end: backend]


def train(ctx, net, how, backend, steps, cap=1):
    """`steps` SGD steps of `net` under DDP, compiled `how`: the weights, each step's time and bucket count."""
    torch._dynamo.reset()  # nothing cached from an earlier model
    counters.clear()
    graphs, buckets = [], []
    if how == "model.compile()":
        net.compile(backend=counting(backend, graphs))
    ddp = DDP(net, bucket_cap_mb=cap)
    ddp.register_comm_hook(buckets, lambda state, bucket: state.append(bucket.index()) or allreduce_hook(None, bucket))
    model = torch.compile(ddp, backend=counting(backend, graphs)) if how == "torch.compile(ddp)" else ddp
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seconds, per_step = [], []
    for step in range(steps):
        x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 * ctx.rank + step))
        buckets.clear()
        start = time.perf_counter()
        opt.zero_grad()
        F.mse_loss(model(x), x).backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
        per_step.append(len(buckets))
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    keys = list(model.state_dict())[:1]
    return {"weights": weights, "seconds": seconds, "buckets": per_step, "graphs": graphs, "keys": keys}


@contextlib.contextmanager
def ddp_optimizer_log():
    """What DDPOptimizer logs at INFO ("created N buckets"), caught here instead of printed by torch."""
    log, text = logging.getLogger("torch._dynamo.backends.distributed"), io.StringIO()
    handlers, level = log.handlers, log.level
    log.handlers = [logging.StreamHandler(text)]
    log.setLevel(logging.INFO)  # setLevel, not .level =: it also clears logging's cache of enabled levels
    try:
        yield text
    finally:
        log.handlers = handlers
        log.setLevel(level)


def summary(run, eager):
    return {
        "graphs compiled (ops in each)": run["graphs"],
        "buckets per step": run["buckets"],
        "first step s": round(run["seconds"][0], 3),
        "later steps ms (median)": round(1e3 * statistics.median(run["seconds"][1:]), 2),
        "largest weight gap to eager": (run["weights"] - eager["weights"]).abs().max().item(),
        "bitwise equal to eager": bool(torch.equal(run["weights"], eager["weights"])),
        "state_dict's first key": run["keys"][0],
    }


def part_buckets(ctx, backend, steps):
    eager = train(ctx, Net(), "eager", backend, steps)
    with ddp_optimizer_log() as log:
        compiled = train(ctx, Net(), "torch.compile(ddp)", backend, steps)
    aot_graphs = counters["aot_autograd"]["total"]  # torch's own count of the graphs it compiled
    n = eager["buckets"][-1]
    assert n == DEPTH and compiled["buckets"][1:] == [n] * (steps - 1), f"rank {ctx.rank}: {eager} {compiled}"
    assert len(compiled["graphs"]) == aot_graphs == n, f"rank {ctx.rank}: {compiled['graphs']} {aot_graphs} {n}"
    assert f"created {n} buckets" in log.getvalue(), f"rank {ctx.rank}: {log.getvalue()}"
    row = summary(compiled, eager)
    if backend == "aot_eager":
        assert row["bitwise equal to eager"], f"rank {ctx.rank}: {row['largest weight gap to eager']:.1e} off"
    else:
        assert row["largest weight gap to eager"] < TOL, f"rank {ctx.rank}: {backend}: {row}"
    line = next(ln for ln in log.getvalue().splitlines() if "created" in ln)
    return {"eager": summary(eager, eager), "torch.compile(ddp)": row, "DDPOptimizer's log": line.split(". ")[0]}, eager


def part_sequential(ctx, backend, steps, eager):
    # [start: sequential]
    outside = train(ctx, sequential(), "torch.compile(ddp)", backend, steps)  # torch.compile(DDP(Sequential))
    breaks = [reason.splitlines()[0:2] for reason in counters["graph_break"]]  # why Dynamo stopped tracing
    inside = train(ctx, sequential(), "model.compile()", backend, steps)  # compile first, then DDP(model)
    blocks = train(ctx, user_blocks(), "torch.compile(ddp)", backend, steps)  # a Sequential of your own blocks
    calls = []
    hooks = train(ctx, hooked(calls), "torch.compile(ddp)", backend, steps)  # forward hooks on the layers
    # [end: sequential]
    skipped = torch._dynamo.trace_rules.check_verbose(torch.nn.Sequential.forward.__code__)
    assert outside["graphs"] == [] and torch.equal(outside["weights"], eager["weights"]), f"rank {ctx.rank}"
    assert skipped.skipped and "torch/nn" in skipped.reason.replace(os.sep, "/"), skipped
    assert len(inside["graphs"]) == DEPTH and inside["buckets"][1:] == [DEPTH] * (steps - 1), f"{inside}"
    assert outside["keys"] == ["_orig_mod.module.0.weight"] and inside["keys"] == ["module.0.weight"], ctx.rank
    short = lambda text: re.sub(r"/[^\s`(]*site-packages/", "", " ".join(text.split()))  # noqa: E731
    # Your own blocks: their forward frames compiled (a linear layer and its tanh each), as eager DDP trains.
    gap = (blocks["weights"] - eager["weights"]).abs().max().item()  # 0 with aot_eager, below TOL with inductor
    assert blocks["graphs"] and set(blocks["graphs"]) == {2} and gap <= (0 if backend == "aot_eager" else TOL), gap
    # A hook appending to a list: Dynamo guards on the list, which every step changes: it compiles again.
    assert len(calls) == DEPTH * steps and len(hooks["graphs"]) >= DEPTH * (steps - 1), f"{hooks['graphs']}"
    return {
        "torch.compile(DDP(Sequential))": summary(outside, eager),
        "Sequential.compile(), then DDP": summary(inside, eager),
        "torch.compile(DDP(Sequential of Blocks))": summary(blocks, eager),
        "torch.compile(DDP(Net with forward hooks))": {**summary(hooks, eager), "hook calls": len(calls)},
        "graph breaks": [short(" ".join(b)) for b in breaks],
        "why Sequential.forward is skipped": short(skipped.reason),
    }


def part_small_cap(ctx, backend):
    # [start: small_cap]
    try:
        train(ctx, Net(), "torch.compile(ddp)", backend, steps=1, cap=0.5)  # 0.5 MiB buckets, compiled
    except Exception as e:  # Dynamo wraps what the compiler raised
        error = f"{type(e).__name__}: {e}"
    # [end: small_cap]
    assert "First bucket should be smaller/equal to other buckets" in error, f"rank {ctx.rank}: {error}"
    return error.split("\n")[0][:300]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--backend", choices=["aot_eager", "inductor"], default="aot_eager")
    parser.add_argument("--steps", type=int, default=4, choices=range(3, 51), metavar="3..50")
    parser.add_argument("--pg-timeout", type=float, default=120, help="seconds a collective waits (compiling)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    torch._logging.set_logs(dynamo=logging.ERROR)  # Dynamo's warnings about DDP's profiler calls, not ours
    try:
        buckets, eager = part_buckets(ctx, args.backend, args.steps)
        pitfall = part_sequential(ctx, args.backend, args.steps, eager)
        small_cap = part_small_cap(ctx, args.backend)
    finally:
        shutil.rmtree(CACHE, ignore_errors=True)
    if ctx.is_main:
        lessonlib.report("buckets", {"backend": args.backend, **buckets})
        lessonlib.report("sequential", pitfall)
        lessonlib.report("small_cap", small_cap)
        runs = {k: v for k, v in [*buckets.items(), *pitfall.items()] if isinstance(v, dict)}
        for name, row in runs.items():
            graphs, first, later = (
                row["graphs compiled (ops in each)"],
                row["first step s"],
                row["later steps ms (median)"],
            )
            print(f"{name:31} graphs {graphs}, first step {first} s, later steps {later} ms")
        print(buckets["DDPOptimizer's log"])
        print(small_cap[:120])
    print(f"rank {ctx.rank}: every assertion held at world size {ctx.world_size}")
    lessonlib.teardown()


if __name__ == "__main__":
    try:
        main()
    finally:  # on every way out, bad arguments included
        shutil.rmtree(CACHE, ignore_errors=True)
