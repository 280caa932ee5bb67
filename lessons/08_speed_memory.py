"""torchrun --nproc_per_node=2 lessons/08_speed_memory.py

Does autocast make this machine faster, and how much memory do the saved activations take?

Options: --sizes 128x32,256x512, --runs 3, --cuda-size 4096x16384, --dtype both (the defaults; --dtype
bfloat16 or float16 measures that autocast dtype alone against float32).

Memory: the tensors autograd saves for backward are recorded with saved_tensors_hooks during one
forward of a 4-layer MLP (WIDTH x WIDTH linears with ReLU, BATCH rows), and sorted into activations,
low-precision copies of the weights that autocast made, and the parameters themselves (no extra
memory). Every activation autocast lowered takes exactly half its float32 bytes, and the loss saves
a float32 copy of the model's output besides its target (asserted, tensor by tensor: this does not
depend on the machine). Time: forward and backward in float32, bfloat16 and float16 autocast, the
modes interleaved, median per mode, timed on rank 0 alone while the other ranks wait. Times are
reported, never asserted: they depend on the CPU (its flags are reported too) and on the load. With a
GPU on rank 0, the same on CUDA with the memory held after forward and the peak; without, skipped
with the reason.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lessonlib

MODES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLAGS = ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"]


def size(text):
    width, batch = (int(v) for v in text.lower().split("x"))
    return width, batch


def mlp(width, device="cpu", depth=4):
    torch.manual_seed(0)
    blocks = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    return torch.nn.Sequential(*blocks).to(device)


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            present = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "not readable here (no /proc/cpuinfo)"
    return {flag: flag in present for flag in FLAGS}


# [start: saved]
def saved_tensors(model, x, y, dtype):
    """[(kind, dtype, bytes)] of what autograd saves for backward, each storage counted once."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found = {}

    def pack(t):
        base = t._base if t._is_view() else t
        fn = base.grad_fn
        if t.untyped_storage().data_ptr() in param_storages:
            kind = "parameter"  # the weight itself: memory it takes anyway
        elif type(fn).__name__ == "ToCopyBackward0" and type(fn.next_functions[0][0]).__name__ == "AccumulateGrad":
            kind = "weight copy"  # autocast's low-precision cast of a parameter
        else:
            kind = "activation"
        found.setdefault(t.untyped_storage().data_ptr(), (kind, t.dtype, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.mse_loss(model(x), y)
    loss.backward()
    return list(found.values())


# [end: saved]


# [start: timing]
def step_time(model, x, y, dtype, sync=lambda: None):
    """Seconds for one forward and backward."""
    start = time.perf_counter()
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        loss = F.mse_loss(model(x), y)
    loss.backward()
    sync()
    return time.perf_counter() - start


def median_times(width, batch, runs, device="cpu", sync=lambda: None, modes=MODES):
    """{mode: median ms per step}, the modes interleaved so that a change in load hits them all alike."""
    model = mlp(width, device)
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    # One warm-up step per mode, which also sets how many steps make one sample of at least 20 ms.
    reps = {mode: max(1, round(0.02 / step_time(model, x, y, dtype, sync))) for mode, dtype in modes.items()}
    times = {mode: [] for mode in modes}
    for _ in range(runs):
        for mode, dtype in modes.items():
            took = sum(step_time(model, x, y, dtype, sync) for _ in range(reps[mode]))
            times[mode].append(1e3 * took / reps[mode])
    return {mode: statistics.median(t) for mode, t in times.items()}


# [end: timing]


def memory(ctx, width, batch, device="cpu", modes=MODES):
    model = mlp(width, device)
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    saved = {mode: saved_tensors(model, x, y, dtype) for mode, dtype in modes.items()}
    full = [b for k, _, b in saved["float32"] if k == "activation"]
    for mode in [m for m in modes if m != "float32"]:
        low = [b for k, dt, b in saved[mode] if k == "activation" and dt == MODES[mode]]
        wide = [b for k, dt, b in saved[mode] if k == "activation" and dt == torch.float32]
        # The layers' activations, in order, at half the bytes; then the loss's float32 input and target.
        assert low == [b // 2 for b in full[: len(low)]], f"rank {ctx.rank}: {mode} activations {low} vs {full}"
        assert wide == [batch * width * 4] * 2, f"rank {ctx.rank}: {mode}: float32 activations {wide}"
    return {
        mode: {kind: sum(b for k, _, b in s if k == kind) for kind in ("activation", "weight copy", "parameter")}
        for mode, s in saved.items()
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--sizes", type=lessonlib.comma_list(size), default="128x32,256x512", help="WIDTHxBATCH,...")
    parser.add_argument("--runs", type=int, default=3, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--cuda-size", type=size, default="4096x16384", help="WIDTHxBATCH on the GPU")
    parser.add_argument(
        "--dtype",
        default="both",
        choices=["both", "bfloat16", "float16"],
        help="the autocast dtype(s) measured against float32 (default: both)",
    )
    args = parser.parse_args()
    modes = {m: d for m, d in MODES.items() if m == "float32" or args.dtype in (m, "both")}
    ctx = lessonlib.setup(device="cpu")

    for width, batch in args.sizes:
        mem = memory(ctx, width, batch, modes=modes)
        lessonlib.report("memory", {"device": "cpu", "width": width, "batch": batch, "bytes": mem})
    if ctx.is_main:
        lessonlib.report(
            "cpu",
            {
                "flags": cpu_flags(),
                "capability": torch.backends.cpu.get_cpu_capability(),
                "threads": torch.get_num_threads(),
            },
        )
        for width, batch in args.sizes:
            ms = median_times(width, batch, args.runs, modes=modes)
            lessonlib.report("time", {"device": "cpu", "width": width, "batch": batch, "ms": ms})
            print(f"cpu {width}x{batch}: " + ", ".join(f"{m} {t:.2f} ms" for m, t in ms.items()))
        if torch.cuda.is_available():
            device, (width, batch) = torch.device("cuda", ctx.local_rank), args.cuda_size
            ms = median_times(width, batch, max(args.runs, 5), device, torch.cuda.synchronize, modes)
            held, peak = {}, {}
            for mode, dtype in modes.items():  # bytes above the model and the batch
                model, x = mlp(width, device), torch.randn(batch, width, device=device)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                    loss = F.mse_loss(model(x), x)
                held[mode] = torch.cuda.memory_allocated(device) - base  # what forward keeps for backward
                loss.backward()
                peak[mode] = torch.cuda.max_memory_allocated(device) - base
                del model, x, loss
            lessonlib.report(
                "time",
                {
                    "device": "cuda",
                    "width": width,
                    "batch": batch,
                    "ms": ms,
                    "peak": peak,
                    "held after forward": held,
                    "gpu": torch.cuda.get_device_name(device),
                },
            )
            print(
                f"cuda {width}x{batch}: "
                + ", ".join(
                    f"{m} {ms[m]:.2f} ms, {held[m] / 2**20:.0f} MiB held after forward, peak {peak[m] / 2**20:.0f} MiB"
                    for m in modes
                )
            )
        else:
            lessonlib.report("time", {"device": "cuda", "skipped": "no GPU on this machine"})
            print("cuda: skipped (no GPU on this machine)")
    dist.barrier()  # the other ranks wait here, idle, while rank 0 times
    print(f"rank {ctx.rank}: saved activations under autocast take half their float32 bytes, tensor by tensor")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
