"""torchrun --nproc_per_node=2 lessons/15_exercise_ddp.py

Checker for the chapter 15 exercise: a DDP wrapper with NaiveDDP's interface, overlapped or not.

Options: --solution FILE checks your answer, the function named by --function NAME (default: overlapped_ddp).

The answer is a function that returns the wrapper class (a notebook cannot send a class: Python 3.11
finds the source of a function defined in a cell, not of a class), or the class itself in a file.
Wrapper(module) must broadcast rank 0's parameters (frozen ones too) and buffers, expose .module, call
the model in forward(), and make finish_gradient_synchronization() leave in every trainable .grad the
mean over ranks. It runs on every rank, on TiedNet (lessons/15_naive_ddp.py: float64, dec.weight tied
to enc.weight, a frozen layer, BatchNorm buffers), each rank building it from its own seed. Checked:
1. wrapper.module is the model and wrapper.parameters() are the model's;
2. after construction every parameter and buffer equals rank 0's;
3. for STEPS steps, right after finish_gradient_synchronization(), every gradient equals one process's
   on all ranks' rows (TOL, float64), and the frozen weight has none. In the first step every rank
   but 0 starts its backward DELAY seconds late: an answer that does not wait for its all-reduces
   returns before they can have finished, and its gradients are not the mean yet;
4. a step gives all_reduce exactly the trainable parameters' bytes, each tensor once (counted by
   lessonlib.sharding.Traffic): a tied weight is one tensor.
Without --solution the checker tests itself: it accepts the reference (the `solution` region, which
the chapter shows) and a synchronous version, and rejects the wrong answers in WRONG (at world size 1
only those that one rank can get wrong: a missing broadcast or wait, a sum or a double division of N=1
change nothing there).
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessonlib.exercises import load_lesson, run_checker
from lessonlib.sharding import Traffic
from lessonlib.training import gather, global_batch, my_rows

naive = load_lesson("15_naive_ddp")  # TiedNet, its rows (ROWS per rank), LR, TOL, one process's reference()
STEPS = 2
DELAY = 0.5  # seconds the other ranks come late in step 0; rank 0 checks long before that
WANT = {}  # world size -> one process's gradients at each step


def gradient_problem(name, got, want, own, n):
    """None, or what is wrong with one gradient, with the likely cause."""
    if got is None:
        return f"{name} has no gradient after finish_gradient_synchronization()"
    if (got - want).abs().max() <= naive.TOL:
        return None
    times = (got.flatten() @ want.flatten() / want.square().sum()).item()
    if (got - own / n).abs().max() <= naive.TOL:
        hint = "it is still this rank's own gradient divided by N: wait for every all-reduce before dividing"
    elif abs(times - n) < 1e-6:
        hint = "it is N times the mean: the sum over ranks, divide it by the world size"
    elif abs(times - 1 / n) < 1e-6:
        hint = "it is the mean divided by N again: divided twice (a tied weight met twice? old handles?)"
    else:
        hint = f"{times:.4f} x the mean"
    return f"{name}'s gradient is not one process's: {hint}"


def check(answer, ctx):
    """The first problem this rank saw, or None. Every rank runs every step, whatever it saw, so that the
    ranks issue the same collectives and stay paired."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    if n not in WANT:
        WANT[n] = naive.reference(STEPS, n)[0]
    cls = answer if isinstance(answer, type) else answer()
    model = naive.TiedNet(seed=rank)  # each rank its own weights, frozen ones and buffers
    ddp = cls(model)
    if getattr(ddp, "module", None) is not model or list(map(id, ddp.parameters())) != list(
        map(id, model.parameters())
    ):
        problems.append("wrapper.module must be the model it wraps, and wrapper.parameters() the model's")
    names = [k for k, _ in [*model.named_parameters(), *model.named_buffers()]]
    sizes = [t.numel() for t in [*model.parameters(), *model.buffers()]]
    every = [s.split(sizes) for s in gather(naive.state(model))]  # each rank's tensors, seen by every rank
    for r, (i, name) in ((r, t) for r in range(1, n) for t in enumerate(names)):
        if not torch.equal(every[r][i], every[0][i]):
            problems.append(
                f"after construction rank {r}'s {name} is not rank 0's: broadcast every parameter and buffer"
            )
    trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
    size = naive.trainable_bytes(model)
    for step in range(STEPS):
        x, y = global_batch(step, naive.ROWS * n)
        x, y = x[my_rows([naive.ROWS] * n, rank)], y[my_rows([naive.ROWS] * n, rank)]
        model.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        # This rank's own gradient, for the hints (autograd.grad leaves .grad alone and runs no hook).
        own = dict(zip(trainable, torch.autograd.grad(loss, list(trainable.values()), retain_graph=True)))
        if step == 0 and rank != 0:
            time.sleep(DELAY)  # rank 0's all-reduces cannot finish before this rank has sent its gradients
        traffic = Traffic()
        try:
            with traffic:
                loss.backward()
                ddp.finish_gradient_synchronization()
        except RuntimeError as e:  # Traffic: gradients were given to all_reduce, yet no byte left this rank
            if "wchar did not move" not in str(e):
                raise
            problems.append(f"step {step}: finish_gradient_synchronization() returned before this rank sent a byte")
        grads = {k: p.grad for k, p in model.named_parameters()}
        if traffic.payload["all_reduce"] != size:
            problems.append(
                f"step {step}: all_reduce was given {traffic.payload['all_reduce']} bytes; the trainable parameters "
                f"are {size}: send each trainable tensor once (a tied weight is one tensor; a frozen one has none)"
            )
        if grads["fixed.weight"] is not None:
            problems.append("the frozen fixed.weight has a gradient")
        for k, w in WANT[n][step].items():
            problems.append(gradient_problem(f"step {step}: {k}", grads[k], w, own[k], n))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= naive.LR * p.grad
    return next((p for p in problems if p), None)


def verdict(answer, ctx):
    try:
        return check(answer, ctx)
    except Exception as e:  # a crash is a wrong answer too, with its message
        return f"{getattr(answer, '__name__', answer)} raised {type(e).__name__}: {str(e)[:300]}"


# [start: solution]
def overlapped_ddp():
    class OverlappedDDP(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
            for t in [*module.parameters(), *module.buffers()]:  # frozen parameters and buffers too
                dist.broadcast(t.detach(), src=0)
            self.handles = []
            for p in module.parameters():  # each tensor once: a tied weight gets one hook
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._launch)

        def _launch(self, p):
            self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        def finish_gradient_synchronization(self):
            for p, work in self.handles:
                work.wait()
                p.grad /= dist.get_world_size()
            self.handles.clear()

    return OverlappedDDP


# [end: solution]


def answer(name, walk_hooks=False, walk_divide=False, frozen=True, buffers=True, wait=True, mean=True, clear=True):
    """A wrapper class (returned by a function, as a reader sends it) with the mistakes that are switched on."""

    def make():
        def walk(module):  # every module's own parameters: the tied weight comes up twice
            return [p for m in module.modules() for p in m.parameters(recurse=False) if p.requires_grad]

        class Answer(torch.nn.Module):
            def __init__(self, module):
                super().__init__()
                self.module, self.handles = module, []
                for t in [*module.parameters(), *module.buffers()]:
                    if (frozen or t.requires_grad) and (buffers or isinstance(t, torch.nn.Parameter)):
                        dist.broadcast(t.detach(), src=0)
                for p in walk(module) if walk_hooks else [p for p in module.parameters() if p.requires_grad]:
                    p.register_post_accumulate_grad_hook(self.launch)

            def launch(self, p):
                self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))

            def forward(self, *args, **kwargs):
                return self.module(*args, **kwargs)

            def finish_gradient_synchronization(self):
                for p, work in self.handles:
                    if wait:
                        work.wait()
                    if not walk_divide:
                        p.grad /= dist.get_world_size() if mean else 1
                for p in walk(self.module) if walk_divide else []:  # the mean taken once per module holding p
                    p.grad /= dist.get_world_size()
                if clear:
                    self.handles.clear()

        return Answer

    make.__name__ = name
    return make


def naive_ddp():  # right too: all-reduce after backward, no hooks
    class NaiveDDP(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.detach(), src=0)

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        def finish_gradient_synchronization(self):
            for p in self.module.parameters():
                if p.requires_grad:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()

    return NaiveDDP


WRONG = {
    "tied weight divided twice": answer("walk_divide", walk_divide=True),
    "tied weight all-reduced twice": answer("walk_hooks", walk_hooks=True),
    "frozen parameter not broadcast": answer("no_frozen", frozen=False),
    "buffers not broadcast": answer("no_buffers", buffers=False),
    "waits on no handle": answer("no_wait", wait=False),
    "the sum, not the mean": answer("sum", mean=False),
    "handles kept from step to step": answer("no_clear", clear=False),
}
# One rank: dividing by N = 1 changes nothing, there is nothing to broadcast or to wait for.
ONE_RANK_CANNOT = set(WRONG) - {"tied weight all-reduced twice"}


def main():
    run_checker(
        __doc__,
        verdict,
        [overlapped_ddp],
        WRONG,
        right_alone=ONE_RANK_CANNOT,
        also_right=[naive_ddp],
        passed="keeps every rank's model equal to one process's",
    )


if __name__ == "__main__":
    main()
