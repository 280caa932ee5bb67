"""torchrun --nproc_per_node=2 lessons/08_exercise_amp_step.py

Checker for the chapter 8 exercise: one mixed-precision training step under DDP, with clipping.

Options: --solution FILE checks your answer, the function named by --function NAME (default: amp_step) in
FILE.

A solution is a function `amp_step(ddp, opt, scaler, x, y, max_norm)`: `ddp` is a DistributedDataParallel
model, `opt` its SGD optimizer, `scaler` a GradScaler, (x, y) this rank's batch. It must run the forward
and the mean squared error under float16 autocast on x's device type, backward the scaled loss, clip the
true gradients to norm `max_norm`, step through the scaler and update the scale. Each rank runs six
steps next to a reference copy; at step 2 the last rank's batch overflows float16, so that step must be
skipped everywhere. After every step the parameters must match the reference to 1e-6 and the scale
must equal the reference's; the ranks agree on the verdict before anyone reports it.

Without --solution the checker tests itself: the reference solution (the `solution` region, which the
chapter shows) must pass, and so must a variant that calls backward inside the autocast block; four
plausible wrong answers must fail: clipping before unscale_, no scaler.update(), opt.step() instead of
scaler.step(opt) (it applies the inf step), and a backward of the unscaled loss.
"""

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lessonlib.exercises import run_checker
from lessonlib.training import flat_params

STEPS, BAD_STEP, MAX_NORM, TOL = 6, 2, 0.5, 1e-6


def setup_copy():
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    return (
        ddp,
        torch.optim.SGD(ddp.parameters(), lr=0.05),
        torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2),
    )


def batch(step, rank, bad):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    if bad:
        x[0] *= 3e4  # overflows float16 once scaled
    return x, x[:, :4] - x[:, 4:]


def verdict(fn, ctx):
    """None if fn follows the reference step for step on this rank; else the problem."""
    mine, ref = setup_copy(), setup_copy()
    for step in range(STEPS):
        x, y = batch(step, ctx.rank, bad=step == BAD_STEP and ctx.rank == ctx.world_size - 1)
        amp_step(*ref, x, y, MAX_NORM)
        try:
            fn(*mine, x.clone(), y.clone(), MAX_NORM)
        except Exception as e:  # a crash is a wrong answer too, with its message
            return f"step {step}: amp_step raised {type(e).__name__}: {e}"
        gap = (flat_params(mine[0].module) - flat_params(ref[0].module)).abs().max().item()
        if not gap <= TOL:  # also catches NaN
            skip = " (the step where one rank overflowed, which every rank must skip)" if step == BAD_STEP else ""
            what = "hold inf or NaN" if gap != gap else f"are {gap:.2e} from the reference"
            return f"step {step}{skip}: the parameters {what}"
        if mine[2].get_scale() != ref[2].get_scale():
            return f"step {step}: the scale is {mine[2].get_scale()}, expected {ref[2].get_scale()}"
    return None


# [start: solution]
def amp_step(ddp, opt, scaler, x, y, max_norm):
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):  # forward and loss, not backward
        loss = torch.nn.functional.mse_loss(ddp(x), y)
    scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients
    scaler.unscale_(opt)  # true gradients from here on, so that max_norm means what it says
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
    scaler.step(opt)  # skipped if any rank overflowed: the all-reduced gradients hold an inf or NaN
    scaler.update()


# [end: solution]


def backward_inside(ddp, opt, scaler, x, y, max_norm):
    """Right too: backward inside the autocast block gives the same gradients."""
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        scaler.scale(F.mse_loss(ddp(x), y)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()


def clip_before_unscale(ddp, opt, scaler, x, y, max_norm):
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.mse_loss(ddp(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)  # clips scale x the gradient
    scaler.step(opt)
    scaler.update()


def no_update(ddp, opt, scaler, x, y, max_norm):
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.mse_loss(ddp(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
    scaler.step(opt)  # and no scaler.update(): the scale never moves


def optimizer_step(ddp, opt, scaler, x, y, max_norm):
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.mse_loss(ddp(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
    opt.step()  # steps on inf and NaN too
    scaler.update()


def unscaled_backward(ddp, opt, scaler, x, y, max_norm):
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.mse_loss(ddp(x), y)
    loss.backward()  # unscale_ then divides gradients that were never multiplied
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()


def main():
    run_checker(
        __doc__,
        verdict,
        amp_step,
        also_right=[backward_inside],
        wrong=[clip_before_unscale, no_update, optimizer_step, unscaled_backward],
        passed="matches the reference at every step, the skipped one included",
    )


if __name__ == "__main__":
    main()
