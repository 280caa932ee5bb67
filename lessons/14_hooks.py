"""torchrun --nproc_per_node=4 lessons/14_hooks.py

DDP communication hooks: count what a bucket sends, compress it, and measure what compression costs.

Options: --steps 6, --rank 1 (PowerSGD's matrix_approximation_rank), --repeats 10 (part 3), --pg-timeout S
(default 30).

DDP calls hook(state, bucket) once per bucket and waits for the Future it returns, whose value must be ONE
tensor of the bucket's shape: the averaged gradients. The model: a float32 MLP, 2 buckets from step 1 on.
  1. Each hook trains it --steps steps on the same rows; the bytes a rank sends per step (steps >= START)
     are measured by the kernel (lessonlib.sharding.Traffic). Asserted: a counting hook (then
     allreduce_hook) sees one call per bucket and every parameter's bytes, and sends what DDP sends alone;
     fp16_hook (the exercise's answer) sends half and ends bitwise equal to fp16_compress_hook;
     bf16_compress_hook halves the bytes too (a torch built without CUDA and NCCL, as on macOS, refuses to
     register it: reported); PowerSGD under a tenth at each step from START (bytes: TOL_BYTES). The weights, relative
     to how far plain DDP moved them: float16 within TOL_FP16, bfloat16 within TOL_BF16 and further than
     float16; PowerSGD with error feedback closer than without. At one rank nothing is sent (0 bytes).
  2. What goes wrong, for real, each caught: a hook that returns a tensor, all_reduce's own future (a
     list), a future of the wrong shape, one whose second parameter is not named `bucket` (errors); one
     that never communicates (no error: at N > 1 the replicas part, asserted); start_powerSGD_iter=1 with
     error feedback (ValueError); batched_powerSGD_hook (an AssertionError inside torch 2.14.1).
  3. Error feedback alone: the same batch --repeats times, no optimizer step. The mean of what PowerSGD
     delivered approaches the true gradient with error feedback and stalls without (asserted). What
     PowerSGD keeps between steps, measured (lessonlib.sharding.held): error feedback, one tensor per
     bucket, exactly the gradients' bytes; warm start, the factors P and Q of each matrix.
PowerSGD gets one bucket here: on gloo, two or more fail (lessons/14_powersgd_gloo.py).
"""

import argparse
import os
import traceback

# Tensors stay on the CPU here. With a GPU visible, torch 2.14.1's PowerSGD calls torch.cuda.synchronize on the
# CPU tensors' device, an error (tests/test_gpu_workarounds.py): hide the GPUs before torch starts CUDA.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.exercises import load_function
from lessonlib.sharding import Traffic, held
from lessonlib.training import flat_params, gather, my_rows

HERE = os.path.dirname(os.path.abspath(__file__))
fp16_hook = load_function(os.path.join(HERE, "14_exercise_hook.py"), "fp16_hook")  # the exercise's answer

ROWS, LR, CAP_MB = 16, 0.1, 0.05  # rows per rank and step; SGD's rate; DDP's bucket cap (2 buckets here)
ONE_BUCKET = 25  # MiB, passed: one bucket for this 87 kB model (chapter 7); PowerSGD needs it on gloo
START = 2  # PowerSGD's start_powerSGD_iter; bytes are compared from this step on
TOL_BYTES = 0.02  # relative: gloo frames every message with a small header
TOL_FP16, TOL_BF16 = 2e-3, 2e-2  # weight gap relative to plain DDP's distance travelled (measured: 3e-4, 2.5e-3)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)
    )


def batch(step, n, rank):
    g = torch.Generator().manual_seed(step)  # step's global batch, the same whatever the hook; this rank's rows
    x = torch.randn(ROWS * n, 32, generator=g)
    y = torch.sin(x[:, :8] * 2) + 0.1 * torch.randn(ROWS * n, 8, generator=g)
    mine = my_rows([ROWS] * n, rank)
    return x[mine], y[mine]


# [start: count]
def counting_hook(calls, bucket):
    """DDP's all-reduce (allreduce_hook), after noting which bucket came and how many bytes it holds."""
    buffer = bucket.buffer()  # the bucket's gradients, flat, in one float32 tensor
    calls.append((bucket.index(), buffer.numel() * buffer.element_size()))
    return allreduce_hook(None, bucket)  # None: the default process group


# [end: count]


# [start: powersgd]
def powersgd(rank, error_feedback, start=START):
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,  # an n x m gradient is sent as P (n x rank) and Q (m x rank)
        start_powerSGD_iter=start,  # plain all-reduce before; > 1 if error feedback or warm start is on
        use_error_feedback=error_feedback,  # add what compression lost last step to this step's gradient
        warm_start=True,  # start from last step's Q: one power iteration per step refines it
    )
    return powerSGD_hook.powerSGD_hook, state


# [end: powersgd]


def train(ctx, hook, state, steps):
    one = hook in (powerSGD_hook.powerSGD_hook, powerSGD_hook.batched_powerSGD_hook)  # see the docstring
    ddp = DDP(model(), bucket_cap_mb=ONE_BUCKET if one else CAP_MB)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    sent, calls, seen = [], [], []
    for step in range(steps):
        x, y = batch(step, ctx.world_size, ctx.rank)
        state.clear() if isinstance(state, list) else None
        with Traffic() as t:  # what this rank writes; nothing may print in here (stdout's bytes would count)
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
        sent.append(t.sent)
        calls.append(t.calls["all_reduce"])
        seen.append(list(state) if isinstance(state, list) else None)
    return {"weights": flat_params(ddp.module), "sent": sent, "calls": calls, "seen": seen}


def part_hooks(ctx, steps, rank):
    hooks = {
        "none (DDP's own)": (None, None),
        "counting_hook": (counting_hook, []),
        "fp16_hook (ours)": (fp16_hook, None),
        "fp16_compress_hook": (default_hooks.fp16_compress_hook, None),
        "bf16_compress_hook": (default_hooks.bf16_compress_hook, None),
        "powerSGD_hook": powersgd(rank, True),
        "powerSGD_hook, no error feedback": powersgd(rank, False),
    }
    runs, rows = {}, []
    for name, (hook, state) in hooks.items():
        try:
            runs[name] = train(ctx, hook, state, steps)
        except TypeError as e:  # bf16_compress_hook, on a torch built without CUDA and NCCL (macOS's)
            rows.append({"hook": name, "refused": str(e)})
    assert [r["hook"] for r in rows] in ([], ["bf16_compress_hook"]), f"rank {ctx.rank}: {rows}"
    start, plain = flat_params(model()), runs["none (DDP's own)"]
    travelled = (plain["weights"] - start).norm().item()
    base = sum(plain["sent"][START:]) / (steps - START) if plain["sent"][0] is not None else None
    for name, run in runs.items():
        mean_sent = sum(run["sent"][START:]) / (steps - START) if base is not None else None
        gap = (run["weights"] - plain["weights"]).norm().item() / travelled  # relative to the distance moved
        ratio = round(mean_sent / base, 4) if base else None
        row = {"hook": name, "bytes sent per step": mean_sent, "vs no hook": ratio}
        row.update({"all_reduce calls seen": run["calls"][-1], "weight gap (relative)": gap})
        rows.append({**row, "bytes per step, step by step": run["sent"]})
    by = {r["hook"]: r for r in rows if "refused" not in r}
    seen = runs["counting_hook"]["seen"]
    assert [len(s) for s in seen[1:]] == [2] * (steps - 1) and len(seen[0]) == 1, f"rank {ctx.rank}: {seen}"
    param_bytes = sum(p.numel() * p.element_size() for p in model().parameters())  # every bucket together:
    assert all(sum(b for _, b in s) == param_bytes for s in seen), f"rank {ctx.rank}: buckets {seen}"
    assert runs["counting_hook"]["calls"][1:] == [2] * (steps - 1), f"rank {ctx.rank}: {runs['counting_hook']}"
    assert torch.equal(runs["fp16_hook (ours)"]["weights"], runs["fp16_compress_hook"]["weights"]), ctx.rank
    g = {k: r["weight gap (relative)"] for k, r in by.items()}
    assert g["counting_hook"] < 1e-6 and g["fp16_compress_hook"] < TOL_FP16, f"rank {ctx.rank}: {g}"
    bf16 = g.get("bf16_compress_hook", (g["fp16_compress_hook"] + TOL_BF16) / 2)  # refused: nothing to check
    assert g["fp16_compress_hook"] < bf16 < TOL_BF16, f"rank {ctx.rank}: {g}"
    assert g["powerSGD_hook"] < g["powerSGD_hook, no error feedback"], f"rank {ctx.rank}: {g}"
    if plain["sent"][0] is None:
        print(f"rank {ctx.rank}: /proc/self/io is missing (not Linux): byte assertions skipped")
    elif ctx.world_size == 1:
        # From START, as below: a first step may write once to a file or a pipe (23 bytes, torch 2.11 on a GPU machine)
        assert all(s == 0 for r in runs.values() for s in r["sent"][START:]), f"rank 0: one rank sent {runs}"
    else:
        ratio = {k: r["vs no hook"] for k, r in by.items()}
        assert abs(ratio["counting_hook"] - 1) < TOL_BYTES, f"rank {ctx.rank}: {ratio}"
        for name in {"fp16_hook (ours)", "fp16_compress_hook", "bf16_compress_hook"} & set(runs):
            assert abs(ratio[name] - 0.5) < TOL_BYTES, f"rank {ctx.rank}: {name} sent {ratio[name]} of DDP's"
        psgd = runs["powerSGD_hook"]["sent"]
        assert all(abs(s / base - 1) < 2 * TOL_BYTES for s in psgd[1:START]), f"rank {ctx.rank}: {psgd}"
        assert all(s < 0.1 * base for s in psgd[START:]), f"rank {ctx.rank}: PowerSGD sent {psgd}, DDP {base}"
    return rows


# [start: failures]
def tensor_hook(state, bucket):
    return bucket.buffer()  # a tensor, not a Future


def raw_future_hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()  # its value is [tensor], a list


def short_hook(state, bucket):
    part = bucket.buffer()[:3].clone()  # a future of the wrong shape
    return dist.all_reduce(part, async_op=True).get_future().then(lambda fut: fut.value()[0])


def local_hook(state, bucket):
    fut = torch.futures.Future()  # well formed, but nothing is sent: each rank keeps its own gradient
    fut.set_result(bucket.buffer())
    return fut


def renamed_hook(state, grads):  # DDP reads the hook's signature: the second parameter must be `bucket`
    return allreduce_hook(state, grads)


# [end: failures]


def failures(ctx, rank):
    simple = (tensor_hook, raw_future_hook, short_hook, local_hook, renamed_hook)
    cases = {
        **{hook.__name__: lambda hook=hook: (hook, None) for hook in simple},
        "start_powerSGD_iter=1": lambda: powersgd(rank, True, start=1),
        "batched_powerSGD_hook": lambda: (powerSGD_hook.batched_powerSGD_hook, powersgd(rank, True)[1]),
    }
    rows = []
    for name, make in cases.items():
        try:
            hook, state = make()
            run = train(ctx, hook, state, START + 1)
            every = gather(run["weights"])
            error, where = f"no error; replicas equal: {all(torch.equal(w, every[0]) for w in every)}", ""
        except Exception as e:  # the message's first line, and the function that raised it
            error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            where = traceback.extract_tb(e.__traceback__)[-1].name
        rows.append({"hook": name, "what happens": error, "raised in": where})
    got = {r["hook"]: r["what happens"] for r in rows}
    assert "must return a torch.futures.Future object, but got torch.Tensor" in got["tensor_hook"], got
    assert "expected the hook result is a PyObject" in got["raw_future_hook"], got
    assert "out of bounds for storage of size 12" in got["short_hook"], got
    assert got["local_hook"] == f"no error; replicas equal: {ctx.world_size == 1}", got
    assert got["renamed_hook"] == "KeyError: 'bucket'" and rows[4]["raised in"] == "_check_comm_hook", rows
    assert got["start_powerSGD_iter=1"].startswith("ValueError: Expect `start_powerSGD_iter` > 1"), got
    assert got["batched_powerSGD_hook"] == "AssertionError: " and rows[-1]["raised in"] == "_orthogonalize", rows
    return rows


# [start: error_feedback]
def feedback(ctx, rank, error_feedback, repeats, cap=ONE_BUCKET):
    """The same batch, no optimizer step: how far the mean of what PowerSGD delivered is from the gradient."""
    hook, state = powersgd(rank, error_feedback)
    ddp = DDP(model(), bucket_cap_mb=cap)
    ddp.register_comm_hook(state, hook)
    x, y = batch(0, ctx.world_size, ctx.rank)
    total, gaps = 0, []
    for i in range(START + repeats):
        ddp.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        grad = torch.cat([p.grad.flatten() for p in ddp.parameters()])
        if i < START:  # plain all-reduce: the true averaged gradient
            true = grad
            continue
        total = total + grad
        gaps.append(((total / (i - START + 1) - true).norm() / true.norm()).item())
    kept = {  # what PowerSGD holds between steps, each storage counted once
        "error feedback": held(list(state.error_dict.values())),
        "warm start (P and Q)": held([*state.p_memory_dict.values(), *state.q_memory_dict.values()]),
        "gradients": sum(p.numel() * p.element_size() for p in ddp.parameters()),
    }
    return gaps, kept


# [end: error_feedback]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=6, choices=range(START + 2, 101), metavar=f"{START + 2}..100")
    parser.add_argument("--rank", type=int, default=1, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--repeats", type=int, default=10, choices=range(4, 101), metavar="4..100")
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as torchrun arranges when it starts several
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    rows = part_hooks(ctx, args.steps, args.rank)
    broken = failures(ctx, args.rank)
    (with_ef, kept), (without, kept_without) = (feedback(ctx, args.rank, ef, args.repeats) for ef in (True, False))
    assert with_ef[-1] < 0.75 * without[-1] and with_ef[-1] < with_ef[0] / 1.5, f"rank {ctx.rank}: {with_ef} {without}"
    assert kept["error feedback"] == kept["gradients"] and kept_without["error feedback"] == 0, f"{kept} {kept_without}"
    if ctx.is_main:
        lessonlib.report("hooks", rows)
        lessonlib.report("failures", broken)
        lessonlib.report("feedback", {"with": with_ef, "without": without, "rank": args.rank, "kept": kept})
        for r in rows:
            gap = r.get("weight gap (relative)", float("nan"))
            print(f"{r['hook']:33} {r.get('vs no hook', 'refused')!s:>7} of DDP's bytes, weights {gap:.1e} off")
        print(f"PowerSGD's mean gradient after {args.repeats} repeats: {with_ef[-1]:.2f} off with error feedback,")
        print(f"  {without[-1]:.2f} without (relative to the gradient's norm)")
    print(f"rank {ctx.rank}: every assertion held at world size {ctx.world_size}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
