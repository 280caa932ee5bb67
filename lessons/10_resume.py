"""torchrun --nproc_per_node=3 lessons/10_resume.py

Resume from a file: model, optimizer, GradScaler, sampler epoch, step counter and every rank's RNG states.

Options: --epochs 4, --stop-after 2 (the defaults), --dir DIR (where to make the checkpoint folder; default: a
temporary one).

Chapter 4's run (per-rank seeds, dropout, noise from torch, random and numpy, a shuffling sampler, a
loader generator, SGD with momentum), now in float16 autocast with a GradScaler (chapter 8). At this
size float16 gradients overflow now and then: the scaler skips that step and halves its scale, and
doubles it after 3 clean steps. The straight run trains --epochs epochs and, at the end of epoch
--stop-after, writes a checkpoint: rank 0 gathers every rank's RNG states and writes one file,
atomically, then a barrier. Then everything is rebuilt from another seed, chapter 4's warm_up runs,
every rank loads the file (its own RNG states, map_location) and trains to the end. Losses, weights,
scale and step counter equal the straight run's, bitwise (asserted at 1 to 4 ranks). Then one thing
at a time is left out of the resume: the optimizer state, the scaler state, the sampler epoch (a loop
counting epochs from 0 again); each makes the run differ (asserted).
"""

import argparse
import os
import random
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lessonlib
from lessonlib.exercises import load_function

HERE = os.path.dirname(os.path.abspath(__file__))
build, warm_up = (load_function(os.path.join(HERE, "04_resume.py"), n) for n in ("build", "warm_up"))
atomic_save, shared_folder = (
    load_function(os.path.join(HERE, "10_save.py"), n) for n in ("atomic_save", "shared_folder")
)
FORGET = ("nothing", "optimizer state", "scaler state", "sampler epoch", "autocast in warm_up")
INIT_SCALE = 2.0**16  # GradScaler's default


def new_run(seed, ctx):
    run = build(seed, ctx)  # chapter 4: model (DDP), SGD with momentum, loader with sampler and generator
    names, layout = {p: n for n, p in run["model"].module.named_parameters()}, {}

    def watch(state, bucket):  # a comm hook (chapter 7) that notes each bucket's parameter order
        layout[bucket.index()] = [names[p] for p in bucket.parameters()]
        return default_hooks.allreduce_hook(None, bucket)

    run["model"].register_comm_hook(None, watch)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3)
    return {**run, "scaler": scaler, "step": 0, "layout": layout}


def train(run, epochs, log):
    model, opt, loader, scaler = run["model"], run["opt"], run["loader"], run["scaler"]
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)  # the shuffle is a function of (seed, epoch)
        log["orders"].append(list(loader.sampler))
        for x, y in loader:
            noise = torch.randn_like(x) * random.uniform(0.02, 0.1) + np.random.normal(0, 0.02)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x + noise).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)  # skipped if a gradient is inf or nan
            scaler.update()
            run["step"] += 1
            t = loss.detach().clone()
            dist.all_reduce(t)
            log["losses"].append((t / dist.get_world_size()).item())
            log["scales"].append(scaler.get_scale())


# [start: save]
def save(run, epoch, path, ctx):
    name, key, pos, has_gauss, cached = np.random.get_state()
    rng = {
        "torch": torch.get_rng_state(),
        "random": random.getstate(),
        "loader": run["loader"].generator.get_state(),
        # numpy's key as an int64 tensor: weights_only refuses ndarrays, and a uint32 tensor fails to
        # unpickle after gather_object in this torch ("UntypedStorage has no attribute dtype")
        "numpy": (name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached),
    }
    every = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(rng, every, dst=0)  # each rank's own states, to the one writer
    if ctx.is_main:
        atomic_save(
            {
                "model": run["model"].module.state_dict(),
                "opt": run["opt"].state_dict(),
                "scaler": run["scaler"].state_dict(),
                "epoch": epoch,
                "step": run["step"],
                "sampler_seed": run["loader"].sampler.seed,
                "world_size": ctx.world_size,
                "rng": every,
            },
            path,
        )
    dist.barrier()  # the file is complete before anyone goes on (and, later, reads it)


# [end: save]


# [start: load]
def load(run, path, ctx, forget="nothing"):
    state = torch.load(path, map_location="cpu")  # every rank reads the file
    if state["world_size"] != ctx.world_size:
        raise ValueError(
            f"rank {ctx.rank}: {path} holds RNG states for {state['world_size']} ranks, "
            f"this run has {ctx.world_size}: resume at the same world size"
        )
    run["model"].module.load_state_dict(state["model"])
    if forget != "optimizer state":
        run["opt"].load_state_dict(state["opt"])  # momentum buffers
    if forget != "scaler state":
        run["scaler"].load_state_dict(state["scaler"])  # scale and growth tracker
    run["loader"].sampler.seed = state["sampler_seed"]  # its order is a function of (seed, epoch)
    rng = state["rng"][ctx.rank]  # this rank's own
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["random"])
    name, key, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    run["loader"].generator.set_state(rng["loader"])
    run["step"] = state["step"]
    return state["epoch"]  # the next epoch to run


# [end: load]


def weights(run):
    return torch.nn.utils.parameters_to_vector(run["model"].parameters()).detach()


def resume(seed, ctx, path, forget, epochs, log):
    """Rebuild everything from another seed (a match cannot be luck), load `path`, train to the end."""
    run = new_run(seed + 1000, ctx)
    # [start: warm_up]
    with torch.autocast("cpu", dtype=torch.float16) if forget != "autocast in warm_up" else nullcontext():
        warm_up(run["model"])  # chapter 4: DDP's bucket rebuild, in the gradient order of a training step
    # [end: warm_up]
    start = load(run, path, ctx, forget)
    train(run, range(start, epochs) if forget != "sampler epoch" else range(epochs - start), log)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=4, choices=range(2, 21), metavar="2..20")
    parser.add_argument("--stop-after", type=int, default=2, choices=range(1, 20), metavar="1..19")
    parser.add_argument("--dir", help="where to make the checkpoint folder (a shared file system with several nodes)")
    args = parser.parse_args()
    if args.stop_after >= args.epochs:
        parser.error("--stop-after must be below --epochs, or there is nothing left to resume")
    ctx = lessonlib.setup(device="cpu")
    E, k, r = args.epochs, args.stop_after, ctx.rank
    with shared_folder(ctx, args.dir) as folder:
        path = os.path.join(folder, f"epoch{k}.pt")
        straight, run = {"losses": [], "scales": [], "orders": []}, new_run(args.seed, ctx)
        train(run, range(k), straight)
        save(run, k, path, ctx)  # a checkpoint along the way; it changes nothing in the run
        at = len(straight["losses"])
        train(run, range(k, E), straight)
        final, steps, saved, layout = weights(run), run["step"], torch.load(path)["scaler"], run["layout"]
        assert (saved["scale"], saved["_growth_tracker"]) != (INIT_SCALE, 0), f"rank {r}: a fresh scaler's state"
        rows = {}
        for forget in FORGET:
            log = {"losses": straight["losses"][:at], "scales": straight["scales"][:at], "orders": []}
            run = resume(args.seed, ctx, path, forget, E, log)
            rows[forget] = {
                "forgotten": forget,
                "losses": log["losses"],
                "scales": log["scales"],
                "steps": run["step"],
                "same curve": log["losses"] == straight["losses"],
                "same scales": log["scales"] == straight["scales"],
                "max weight difference": (weights(run) - final).abs().max().item(),
                "order of epoch": straight["orders"].index(log["orders"][0]),
                "bucket layout": run["layout"],
                "same bucket layout": run["layout"] == layout,
            }
        good, late = rows["nothing"], rows["autocast in warm_up"]
        assert good["same curve"] and good["max weight difference"] == 0, f"rank {r}: resume is not bitwise: {good}"
        assert good["same scales"] and good["steps"] == steps, f"rank {r}: the scaler or the step counter differ"
        for forget in FORGET[1:-1]:
            assert not rows[forget]["same curve"] and rows[forget]["max weight difference"] > 0, f"rank {r}: {forget}"
        assert rows["sampler epoch"]["order of epoch"] == 0 and good["order of epoch"] == k, f"rank {r}: sampler epoch"
        assert good["same bucket layout"] and not late["same bucket layout"], (
            f"rank {r}: {layout} {late['bucket layout']}"
        )
        if ctx.world_size <= 2:  # a + b == b + a: the layout changes no bit
            assert late["max weight difference"] == 0, f"rank {r}: {late}"
        lessonlib.report(
            "straight", {**straight, "resumed at step": at, "epochs": E, "stop after": k, "bucket layout": layout}
        )
        for row in rows.values():
            lessonlib.report("resumed", row)
        if ctx.is_main:
            print(
                f"straight run: {E} epochs, {steps} steps, final loss {straight['losses'][-1]:.6f}, "
                f"scale {straight['scales'][-1]:g}; checkpoint after epoch {k} (step {at})"
            )
            for row in rows.values():
                print(
                    f"resumed, forgot {row['forgotten']:19}: same curve {str(row['same curve']):5} max weight "
                    f"diff {row['max weight difference']:.1e}; first epoch ordered as epoch {row['order of epoch']}"
                )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
