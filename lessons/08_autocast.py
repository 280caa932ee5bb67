"""torchrun --nproc_per_node=2 lessons/08_autocast.py

Which ops run in which dtype under torch.autocast, read from a real forward and backward.

One small network (linear, matmul, relu, exp, sum, softmax, log_softmax, layer norm, an addition with a
float32 tensor, two losses) runs with no autocast, with CPU autocast in bfloat16 and in float16, and with
CUDA autocast in float16 and bfloat16 where this rank has a GPU (else skipped, with the reason). The
dtype of every result, of the parameters and of their gradients is checked against the table the
chapter states: the two devices keep different lists of ops that stay in float32.
Traps that tutorials often fall into are run too: the torch.cuda.amp.autocast and torch.cuda.amp.GradScaler
spellings warn that they are deprecated, CUDA autocast leaves CPU tensors alone, and without a GPU both
disable themselves with a UserWarning: that GradScaler's scale() returns the loss and its step() just
steps. And autocast's state belongs to one thread, and a nested autocast(enabled=False) switches it off.
"""

import argparse
import threading
import warnings

import torch
import torch.nn.functional as F

import lessonlib

LOW, F32 = "low", "float32"  # "low": the autocast dtype of that run (bfloat16 or float16)
OPS = [
    "linear",
    "matmul",
    "relu",
    "exp",
    "sum",
    "softmax",
    "log_softmax",
    "layer_norm",
    "low + float32",
    "mse_loss",
    "cross_entropy",
    "parameters",
    "gradients",
]
# What each device's autocast does to these ops when their input is a low-precision activation.
# CPU: only the float32-list ops (the losses here) are lifted to float32; the rest keep the input's dtype.
# CUDA: exp, sum, softmax, log_softmax and layer norm are on its float32 list as well.
EXPECTED = {
    "cpu": dict.fromkeys(OPS, LOW)
    | dict.fromkeys(["low + float32", "mse_loss", "cross_entropy", "parameters", "gradients"], F32),
    "cuda": dict.fromkeys(OPS, F32) | dict.fromkeys(["linear", "matmul", "relu"], LOW),
}


# [start: probe]
def probe(device, dtype):
    """{op: dtype of its result} for one forward and backward; dtype=None means no autocast."""
    torch.manual_seed(0)
    linear, norm = torch.nn.Linear(16, 16).to(device), torch.nn.LayerNorm(16).to(device)
    x, labels = torch.randn(8, 16, device=device), torch.randint(0, 16, (8,), device=device)
    seen = {}
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        h = seen["linear"] = linear(x)
        seen["matmul"] = h @ h.T
        seen["relu"], seen["exp"], seen["sum"] = h.relu(), h.exp(), h.sum()
        seen["softmax"], seen["log_softmax"] = h.softmax(-1), F.log_softmax(h, -1)
        seen["layer_norm"] = norm(h)
        seen["low + float32"] = h + x  # type promotion: the wider dtype wins
        seen["mse_loss"] = F.mse_loss(h, x)
        loss = seen["cross_entropy"] = F.cross_entropy(h, labels)
    loss.backward()  # outside autocast: backward ops run in the dtype of their forward op anyway
    seen["parameters"], seen["gradients"] = linear.weight, linear.weight.grad
    return {op: str(t.dtype).removeprefix("torch.") for op, t in seen.items()}


# [end: probe]


def expected(device_type, dtype):
    low = str(dtype).removeprefix("torch.")
    return {op: low if v == LOW else v for op, v in EXPECTED[device_type].items()}


def other_thread(dtype):
    """dtype of a linear run in a new thread that starts inside an autocast region of this one."""
    linear, x, out = torch.nn.Linear(4, 4), torch.randn(2, 4), {}
    with torch.autocast("cpu", dtype=dtype):
        here = linear(x).dtype
        worker = threading.Thread(target=lambda: out.update(there=linear(x).dtype))
        worker.start()
        worker.join(timeout=30)
    return here, out["there"]


def nested_off(dtype):
    """dtype of a linear under autocast(enabled=False) inside an enabled region."""
    linear, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=dtype):
        with torch.autocast("cpu", enabled=False):  # switches it off, whatever the caller wanted
            return linear(x).dtype


def cuda_on_cpu_tensors():
    """The common torch.cuda.amp.autocast(), applied to CPU tensors: (dtype, warning categories)."""
    linear, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.amp.autocast():
            dtype = linear(x).dtype
    return dtype, {w.category.__name__ for w in caught}


def old_scaler():
    """The common torch.cuda.amp.GradScaler(): (enabled, warning categories, what scale and step then do)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = torch.cuda.amp.GradScaler()
    weight = torch.nn.Parameter(torch.ones(1))
    weight.grad, loss = torch.ones(1), torch.tensor(3.0)
    scaled = scaler.scale(loss)
    scaler.step(torch.optim.SGD([weight], lr=1.0))  # disabled: a plain opt.step(), 1 - 1 * 1 = 0
    does = {"scale(loss) is the loss": scaled is loss, "step stepped": weight.item() == 0.0}
    return scaler.is_enabled(), {w.category.__name__ for w in caught}, does


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    rank = ctx.rank

    modes = [
        ("cpu", None),
        ("cpu", torch.bfloat16),
        ("cpu", torch.float16),
        ("cuda", torch.float16),
        ("cuda", torch.bfloat16),
    ]
    checked, skipped = [], []
    for device_type, dtype in modes:
        name = f"{device_type} {str(dtype).removeprefix('torch.')}" if dtype else "no autocast"
        if device_type == "cuda" and ctx.local_rank >= torch.cuda.device_count():
            why = "no GPU on this machine" if not torch.cuda.is_available() else "no GPU for this local rank"
            skipped.append(name)
            lessonlib.report("table", {"mode": name, "skipped": why})
            continue
        device = torch.device(device_type, ctx.local_rank) if device_type == "cuda" else torch.device("cpu")
        got = probe(device, dtype)
        want = expected(device_type, dtype) if dtype else dict.fromkeys(OPS, F32)
        wrong = {op: (got[op], want[op]) for op in OPS if got[op] != want[op]}
        assert not wrong, f"rank {rank}: {name}: (got, expected) dtypes differ: {wrong}"
        checked.append(name)
        lessonlib.report("table", {"mode": name, **got})

    here, there = other_thread(torch.bfloat16)
    assert (here, there) == (torch.bfloat16, torch.float32), f"rank {rank}: autocast in another thread: {there}"
    off = nested_off(torch.bfloat16)
    assert off == torch.float32, f"rank {rank}: autocast(enabled=False) inside a bfloat16 region ran {off}"
    old_dtype, categories = cuda_on_cpu_tensors()
    assert old_dtype == torch.float32, f"rank {rank}: torch.cuda.amp.autocast lowered a CPU op to {old_dtype}"
    assert "FutureWarning" in categories, f"rank {rank}: torch.cuda.amp.autocast did not warn: {categories}"
    enabled, scaler_warnings, does = old_scaler()  # disabled, without an error, where there is no GPU
    assert "FutureWarning" in scaler_warnings and enabled == torch.cuda.is_available(), f"rank {rank}: {enabled}"
    if not torch.cuda.is_available():  # both disable themselves, and say so; the scaler then scales nothing
        assert "UserWarning" in categories and "UserWarning" in scaler_warnings, f"rank {rank}: {scaler_warnings}"
        assert all(does.values()), f"rank {rank}: the disabled torch.cuda.amp.GradScaler: {does}"
    lessonlib.report(
        "traps",
        {
            "this thread": str(here),
            "new thread": str(there),
            "nested enabled=False": str(off),
            "torch.cuda.amp.autocast on CPU tensors": str(old_dtype),
            "warnings": sorted(categories),
            "torch.cuda.amp.GradScaler() enabled": enabled,
            "GradScaler warnings": sorted(scaler_warnings),
        },
    )
    print(
        f"rank {rank}: dtype table as stated for {', '.join(checked)}"
        + (f"; skipped {', '.join(skipped)} (no GPU for this rank)" if skipped else "")
    )
    print(
        f"rank {rank}: autocast is per thread (a new thread runs {there}); torch.cuda.amp.autocast on CPU "
        f"tensors: {old_dtype}; torch.cuda.amp.GradScaler() enabled: {enabled}"
    )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
