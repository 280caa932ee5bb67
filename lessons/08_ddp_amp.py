"""torchrun --nproc_per_node=2 lessons/08_ddp_amp.py

AMP under DDP: one rank's overflow makes every rank skip the step; where autocast goes; the scaler's state.

Options: --steps 6, --bad-step 3 (the defaults).

Each rank trains the same DDP model in float16 autocast on the CPU with its own GradScaler. At
--bad-step the last rank's batch holds an outlier row that overflows float16 (in the forward, or in
the scaled backward). DDP all-reduces the gradients during backward, before any scaler looks at them:
every rank then sees non-finite gradients, skips the step (parameters unchanged) and halves its scale
(asserted on every rank, including those whose own batch was ordinary). Parameters and scaler states
stay equal across ranks at every step (asserted), so the scaler in rank 0's checkpoint is everyone's:
its state_dict round trip keeps the scale and growth tracker (asserted). A step clipped after unscale_
clips the all-reduced gradients: every rank sees the same norm and the replicas stay equal (asserted).
Autocast inside the model's forward gives the same gradients as autocast around forward and loss
(asserted, bit for bit) if forward returns float32; if it returns float16 logits, a cross-entropy
computed outside autocast runs in float16 (asserted).
"""

import argparse
import io

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import flat_params, gather


# [start: inside_forward]
class Net(torch.nn.Module):
    """A small MLP; autocast_inside=True puts autocast in forward, as many examples do."""

    def __init__(self, autocast_inside=False, upcast=True):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.autocast_inside, self.upcast = autocast_inside, upcast

    def forward(self, x):
        if not self.autocast_inside:  # not autocast(enabled=False): that would switch off the caller's
            return self.layers(x)
        with torch.autocast("cpu", dtype=torch.float16):
            out = self.layers(x)
        return out.float() if self.upcast else out  # float16 out would make the caller's loss float16


# [end: inside_forward]


# [start: ddp_step]
def amp_step(ddp, opt, scaler, x, y):
    """One float16 AMP step; returns (local loss, gradients finite after DDP's all-reduce)."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):  # forward and loss only, not backward
        loss = F.mse_loss(ddp(x), y)
    scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients during this call
    scaler.unscale_(opt)
    finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
    scaler.step(opt)  # skipped when any gradient is inf or NaN: the same decision on every rank
    scaler.update()
    return loss, finite


# [end: ddp_step]


def batch(step, rank, bad):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 8, generator=g)
    if bad:
        x[0] *= 3e4  # one outlier row: scaled, its gradients pass float16's largest value, 65504
    return x, x[:, :4] + x[:, 4:]


def placement(rank):
    """Gradients with autocast in forward vs around the call; and the loss dtype without the upcast."""
    x, y = batch(0, rank, bad=False)
    grads = []
    for inside in (True, False):
        ddp = DDP(Net(autocast_inside=inside))
        with torch.autocast("cpu", dtype=torch.float16, enabled=not inside):
            loss = F.mse_loss(ddp(x), y)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]))
    assert torch.equal(*grads), f"rank {rank}: autocast inside forward changed the gradients"
    labels = y.argmax(1)  # the four outputs read as class logits, as in a typical classifier
    loss_dtype = F.cross_entropy(Net(autocast_inside=True, upcast=False)(x), labels).dtype
    assert loss_dtype == torch.float16, f"rank {rank}: cross-entropy on float16 logits ran in {loss_dtype}"
    return loss_dtype


def clipped_step(ddp, opt, scaler, x, y, rank, max_norm=0.1):
    """One more AMP step, clipped between unscale_ and step: every rank clips with the same norm."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(ddp(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)  # of the all-reduced gradients
    scaler.step(opt)
    scaler.update()
    norms, replicas = gather(norm.reshape(1)), gather(flat_params(ddp.module))
    assert norm > max_norm, f"rank {rank}: the norm {norm.item()} is below {max_norm}: nothing was clipped"
    assert all(torch.equal(n, norms[0]) for n in norms), f"rank {rank}: ranks clipped with norms {norms}"
    assert all(torch.equal(r, replicas[0]) for r in replicas), f"rank {rank}: replicas differ after clipping"
    return norm.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=6, choices=range(1, 51), metavar="1..50")
    parser.add_argument("--bad-step", type=int, default=3, help="step at which the last rank overflows")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    rank, last = ctx.rank, ctx.world_size - 1

    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for step in range(args.steps):
        before, scale = flat_params(ddp.module), scaler.get_scale()
        loss, finite = amp_step(ddp, opt, scaler, *batch(step, rank, bad=step == args.bad_step and rank == last))
        moved = not torch.equal(before, flat_params(ddp.module))
        print(
            f"step {step}: local loss {loss.item():9.4g}   gradients finite: {finite!s:5}   "
            f"step taken: {moved!s:5}   scale {scale:g} -> {scaler.get_scale():g}"
        )
        lessonlib.report(
            "steps",
            {
                "step": step,
                "local loss": loss.item(),
                "gradients finite": finite,
                "step taken": moved,
                "scale": scale,
                "scale after": scaler.get_scale(),
            },
        )
        if step == args.bad_step:
            assert rank == last or loss < 1e3, f"rank {rank}: an ordinary batch gave loss {loss.item()}"
            assert not finite and not moved, f"rank {rank}: step {step}: finite {finite}, stepped {moved}"
            assert scaler.get_scale() == scale / 2, f"rank {rank}: scale {scale} -> {scaler.get_scale()}"
        else:
            assert finite and moved, f"rank {rank}: step {step}: finite {finite}, stepped {moved}"
        replicas = gather(flat_params(ddp.module))
        assert all(torch.equal(r, replicas[0]) for r in replicas), f"rank {rank}: replicas differ at step {step}"
        states = [None] * ctx.world_size
        dist.all_gather_object(states, scaler.state_dict())
        assert all(s == states[0] for s in states), f"rank {rank}: scaler states differ: {states}"

    # [start: checkpoint]
    blob = [None]
    if ctx.is_main:  # every rank's scaler is the same: rank 0's copy is enough
        buffer = io.BytesIO()
        torch.save({"model": ddp.module.state_dict(), "scaler": scaler.state_dict()}, buffer)
        blob[0] = buffer.getvalue()
    dist.broadcast_object_list(blob, src=0)  # stands in for a file every rank reads
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(torch.load(io.BytesIO(blob[0]))["scaler"])
    # [end: checkpoint]
    for key in ("scale", "_growth_tracker"):
        assert restored.state_dict()[key] == scaler.state_dict()[key], f"rank {rank}: {key} lost in the round trip"
    fresh = torch.amp.GradScaler("cpu").get_scale()
    assert fresh != scaler.get_scale(), f"rank {rank}: a fresh scaler happens to have the same scale"
    lessonlib.report("checkpoint", {"saved": scaler.state_dict(), "restored": restored.state_dict(), "fresh": fresh})

    clipped = clipped_step(ddp, opt, scaler, *batch(args.steps, rank, bad=False), rank)
    loss_dtype = placement(rank)
    if ctx.is_main:
        print(
            f"every rank ({ctx.world_size}) skipped step {args.bad_step} (an overflow on rank {last} only); "
            f"parameters and scalers equal on every rank at every step"
        )
        print(
            f"checkpoint: scale {restored.get_scale():g} and growth tracker "
            f"{restored.state_dict()['_growth_tracker']} restored (a fresh scaler starts at {fresh:g})"
        )
        print(f"autocast inside forward: same gradients as around the call; without .float() the loss is {loss_dtype}")
        print(f"a step clipped after unscale_: every rank saw norm {clipped:.4g}, and the replicas stayed equal")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
