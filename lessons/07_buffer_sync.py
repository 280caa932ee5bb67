"""torchrun --nproc_per_node=2 lessons/07_buffer_sync.py

When DDP copies rank 0's buffers to the other ranks, and why evaluating on rank 0 alone goes through model.module.

Options: --eval-on-main module (the default) or wrapper (the pitfall), best with --pg-timeout 5.

1. A probe: a module with one buffer, `tag`. Before each forward every rank writes its own rank + 1
   into it; after the forward, if every rank holds 1, DDP broadcast rank 0's buffers during that
   forward. Eight forwards in a row, each asserted against the rule torch 2.14.1 follows: a forward
   broadcasts the buffers (forward_sync_buffers=True, the default, and the module has buffers) if it
   is the first one, or if the forward before it ran with gradients enabled and outside no_sync().
   So the broadcast is decided by the previous forward, not by this one's mode: the first forward
   under torch.no_grad() after a training step still broadcasts, model.eval() changes nothing, and
   the training forward right after an evaluation or a no_sync() step does not broadcast.
2. Evaluating on rank 0 alone (`if rank == 0:` around an evaluation loop) is a collective in disguise
   when it goes through the DDP wrapper: its first forward broadcasts the buffers, a call the other
   ranks never make. Their next collective pairs with it instead (collectives match by order), and the
   run fails or, worse, computes with the wrong data. `--eval-on-main module` evaluates `ddp.module`,
   the bare model, which talks to no one: the training that follows is the same on every rank
   (asserted). `--eval-on-main wrapper` shows the failure, bounded by the process-group timeout.
"""

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import flat_params, gather


class Tagged(torch.nn.Module):
    """A linear layer with one buffer, `tag`, that no forward changes: only DDP's broadcast can."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.register_buffer("tag", torch.zeros(1))

    def forward(self, x):
        return self.linear(x)


# (what the forward is, how it runs, expected broadcast). The order matters: each answer depends on
# the forward before it.
PROBES = [
    ("first forward (training)", "train", True),
    ("training forward after a training step", "train", True),
    ("eval forward under no_grad, after a training step", "no_grad", True),
    ("second eval forward under no_grad", "no_grad", False),
    ("training forward right after evaluation", "train", False),
    ("forward under no_sync(), after a training step", "no_sync", True),
    ("training forward after the no_sync() step", "train", False),
    ("forward in model.eval() with gradients on, after a training step", "eval_mode", True),
]


def probe(ctx):
    """Each case of PROBES, run in order: did this forward broadcast rank 0's buffers?"""
    torch.manual_seed(0)
    model = Tagged()
    ddp = DDP(model)
    x = torch.ones(4, 2)
    rows = []
    for name, how, expected in PROBES:
        model.tag.fill_(ctx.rank + 1)  # every rank writes its own value
        # [start: probe]
        if how == "no_grad":  # an evaluation loop
            with torch.no_grad():
                ddp(x)
        elif how == "no_sync":  # accumulation steps (chapter 6)
            with ddp.no_sync():
                ddp(x).sum().backward()
        elif how == "eval_mode":  # model.eval() alone does not turn gradients off
            ddp.eval()
            ddp(x).sum().backward()
            ddp.train()
        else:  # a training step
            ddp(x).sum().backward()
        # [end: probe]
        tags = gather(model.tag)
        broadcast = all(t.item() == 1 for t in tags) if ctx.world_size > 1 else None  # one rank: no way to tell
        assert broadcast in (None, expected), f"{name}: broadcast={broadcast}, expected {expected}"
        rows.append({"forward": name, "buffers broadcast": broadcast, "expected": expected})
    return rows


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))


def train_with_eval_on_main(ctx, target, steps=3):
    """Train `steps` steps on every rank; after the first, rank 0 alone evaluates `target`."""
    ddp = DDP(build())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(ctx.rank)
    for step in range(steps):
        x = torch.randn(16, 4, generator=g)
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        # [start: eval_on_main]
        if step == 0 and ctx.is_main:  # rank 0 alone evaluates
            model = ddp.module if target == "module" else ddp  # the bare model talks to no one
            model.eval()
            with torch.no_grad():
                loss = model(torch.randn(64, 4, generator=torch.Generator().manual_seed(99))).square().mean()
            model.train()
            print(
                f"rank 0 evaluated through {'ddp.module' if target == 'module' else 'the DDP wrapper'}: "
                f"loss {loss.item():.4f}",
                flush=True,
            )
        # [end: eval_on_main]
    copies = gather(flat_params(ddp.module))
    same = all(torch.equal(c, copies[0]) for c in copies)
    assert same, f"rank {ctx.rank}: the ranks' weights differ after training"
    return {"steps": steps, "weights equal on every rank": same}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--eval-on-main",
        choices=["module", "wrapper"],
        default="module",
        help="what rank 0 evaluates alone: ddp.module (right) or the DDP wrapper (the pitfall)",
    )
    parser.add_argument("--pg-timeout", type=float, default=None, help="process-group timeout in seconds")
    args = parser.parse_args()
    ctx = lessonlib.setup(timeout=args.pg_timeout, device="cpu")

    rows = lessonlib.report("probe", probe(ctx))
    if ctx.is_main:
        for row in rows:
            print(f"{row['forward']:<66} broadcast: {row['buffers broadcast']}")
    result = lessonlib.report("eval_on_main", train_with_eval_on_main(ctx, args.eval_on_main))
    print(
        f"rank {ctx.rank}: after {result['steps']} steps, weights equal on every rank: "
        f"{result['weights equal on every rank']}"
    )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
