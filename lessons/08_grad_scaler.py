"""torchrun --nproc_per_node=2 lessons/08_grad_scaler.py

Why float16 needs a GradScaler, and what scale, unscale_, step and update do, step by step.

Options: --steps 14, --init-scale 1048576 (the defaults).

float16 flushes values below 2**-24 to zero. A small loss (here the mean squared error times 1e-7) under
float16 autocast gives all-zero gradients; multiplied by 2**16 before backward and divided after, they
come back within 1e-3 of float32's (asserted, on CUDA too when this rank has a GPU). bfloat16 keeps
float32's range and needs no scaler (asserted on the same number). Then a training run starts with a
scale too large: every step whose scaled gradients overflow to inf is skipped (parameters bit for bit
unchanged) and the scale is halved; growth_interval finite steps in a row double it (all asserted).
Clipping before unscale_ clips the scaled gradients, with no error and no warning: the norm it sees is
scale times the true one (asserted, exactly) and the update is scale times too small. A second unscale_
before update() raises (asserted).
"""

import argparse
import warnings

import torch
import torch.nn.functional as F

import lessonlib

TINY = 1e-7  # weight of the small loss in the underflow demo


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# [start: underflow]
def tiny_gradients(device, weight=TINY):
    """Gradients of weight * loss: float32, float16 autocast, float16 autocast with a GradScaler."""
    model, (x, y) = mlp().to(device), (t.to(device) for t in batch(0))
    F.mse_loss(model(x), y).mul(weight).backward()
    result = {"float32": grads(model).clone()}
    for use_scaler in (False, True):
        model.zero_grad()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16, enabled=use_scaler)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.mse_loss(model(x), y).mul(weight)
        scaler.scale(loss).backward()  # loss x 65536 (x 1 when disabled)
        scaler.unscale_(opt)  # grads / 65536, in float32
        result["float16 + GradScaler" if use_scaler else "float16"] = grads(model).clone()
    return result


# [end: underflow]


# [start: dynamics]
def train_step(model, opt, scaler, step, clip=None, clip_first=False):
    """One AMP step in float16. clip_first=True is the mistake: clip the still-scaled gradients."""
    x, y = batch(step)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip and clip_first else None
    scaler.unscale_(opt)  # from here on .grad holds the true gradients
    finite = bool(torch.isfinite(grads(model)).all())
    if clip and not clip_first:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)  # skipped if any gradient is inf or NaN
    scaler.update()  # halve the scale after a skip; double it after growth_interval good steps
    return finite, norm


# [end: dynamics]


def dynamics(rank, steps, init_scale, interval=3):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=interval
    )
    good_in_a_row, rows = 0, []
    for step in range(steps):
        before, scale = [p.detach().clone() for p in model.parameters()], scaler.get_scale()
        finite, _ = train_step(model, opt, scaler, step)
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        good_in_a_row = good_in_a_row + 1 if finite else 0
        want = scale * 2 if good_in_a_row == interval else scale if finite else scale / 2
        good_in_a_row %= interval
        assert moved == finite, f"rank {rank}: step {step}: finite gradients {finite}, parameters moved {moved}"
        assert scaler.get_scale() == want, f"rank {rank}: step {step}: scale {scaler.get_scale()}, expected {want}"
        assert scaler.state_dict()["_growth_tracker"] == good_in_a_row, f"rank {rank}: step {step}: tracker"
        rows.append(
            lessonlib.report(
                "dynamics",
                {
                    "step": step,
                    "scale": scale,
                    "gradients finite": finite,
                    "step taken": moved,
                    "scale after update": scaler.get_scale(),
                    "growth tracker": good_in_a_row,
                },
            )
        )
    return rows


def clipping(rank, scale=2.0**10, clip=0.5):
    """(true norm, norm seen when clipping first, update size right, update size wrong)."""
    updates, norms = [], []
    for clip_first in (False, True):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        start = torch.cat([p.detach().flatten() for p in model.parameters()])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, norm = train_step(model, opt, torch.amp.GradScaler("cpu", init_scale=scale), 0, clip, clip_first)
        assert not caught, f"rank {rank}: clip_first={clip_first} warned: {[str(w.message) for w in caught]}"
        updates.append((torch.cat([p.detach().flatten() for p in model.parameters()]) - start).norm().item())
        norms.append(norm.item())
    assert norms[0] > clip, f"rank {rank}: the true norm {norms[0]} must exceed {clip} for clipping to act"
    assert norms[1] == scale * norms[0], f"rank {rank}: clipping first saw {norms[1]}, not {scale} x {norms[0]}"
    assert abs(updates[1] * scale / updates[0] - 1) < 1e-2, f"rank {rank}: updates {updates}"
    return {
        "true norm": norms[0],
        "norm seen when clipping first": norms[1],
        "update, unscale_ then clip": updates[0],
        "update, clip then unscale_": updates[1],
    }


def unscale_twice():
    """The error a second unscale_ before update() raises (None if it raised none)."""
    model, scaler, (x, y) = mlp(), torch.amp.GradScaler("cpu"), batch(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    try:
        scaler.unscale_(opt)
    except RuntimeError as e:
        return str(e)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=14, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--init-scale", type=float, default=2.0**20)
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    rank = ctx.rank

    assert torch.tensor(1e-8).half() == 0 and torch.tensor(1e-8).bfloat16() != 0, f"rank {rank}: 1e-8"
    back = (torch.tensor(1e-8) * 2**16).half().float() / 2**16
    assert abs(back / 1e-8 - 1) < 1e-3, f"rank {rank}: 1e-8 scaled through float16 came back as {back}"
    devices = [torch.device("cpu")]
    if ctx.local_rank < torch.cuda.device_count():
        devices.append(torch.device("cuda", ctx.local_rank))
    else:
        lessonlib.report("cuda", f"skipped: no GPU {'here' if not torch.cuda.is_available() else 'for this rank'}")
    for device in devices:
        g = tiny_gradients(device)
        ref = g["float32"]
        zeros = {k: (v == 0).float().mean().item() for k, v in g.items()}
        error = {k: ((v - ref).norm() / ref.norm()).item() for k, v in g.items()}
        assert zeros["float32"] == 0 and zeros["float16"] == 1, f"rank {rank}: {device}: zero fractions {zeros}"
        assert zeros["float16 + GradScaler"] == 0 and error["float16 + GradScaler"] < 1e-3, f"rank {rank}: {error}"
        lessonlib.report("underflow", {"device": device.type, "zero": zeros, "error": error})

    rows = dynamics(rank, args.steps, args.init_scale)
    clip = lessonlib.report("clipping", clipping(rank))
    twice = lessonlib.report("unscale twice", unscale_twice())
    assert twice is not None, f"rank {rank}: a second unscale_ before update() raised nothing"
    skipped = [r["step"] for r in rows if not r["step taken"]]
    print(
        f"rank {rank}: float16 gradients of the small loss: all zero unscaled, back with a GradScaler on "
        f"{', '.join(d.type for d in devices)}"
    )
    print(f"rank {rank}: scale {rows[0]['scale']:g} -> {rows[-1]['scale after update']:g}, steps skipped: {skipped}")
    print(
        f"rank {rank}: clip before unscale_ sees norm {clip['norm seen when clipping first']:.4g} "
        f"(true {clip['true norm']:.4g}); a second unscale_ raises RuntimeError"
    )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
