"""torchrun --nproc_per_node=2 lessons/12_elastic.py

Surviving a crash with torchrun --max-restarts: a checkpoint after every step, a resume on every start.

Options: --steps 8, --fail-at STEP with --fail-rank R (rank R raises at that step on the first attempt
only; add --fail-every-attempt for a bug that no restart fixes), --dir DIR, --pg-timeout 30.

A float64 DDP run (chapter 5's model and data: a global batch of 12 rows split across the ranks, SGD
with momentum) writes a checkpoint after every step: rank 0 writes a temporary file and renames it onto
the checkpoint (chapter 10), then a barrier. Every start of the script, the first or one after a
restart, looks for that checkpoint and goes on from the step it holds. The batch of a step is a
function of the step alone, so after a restart the data go on in the same order. Each rank prints its
attempt (TORCHELASTIC_RESTART_COUNT, which torchrun sets) and the step it starts from. At the end every
rank asserts that its weights equal those of one process that trained on the same batches without
interruption (within 1e-12: float64 sums in another order, as in chapter 5), failure injected or not.
The checkpoint folder is DIR (kept: a later torchrun resumes from it), or one named after
TORCHELASTIC_RUN_ID in the temporary folder, the same for every attempt of one torchrun, which rank 0
removes when the run ends well (a run that fails for good leaves it). A static rendezvous (--master-port
without --rdzv-id) names every run "none", so without --dir the script refuses to start rather than
resume another job's checkpoint. With several nodes, give a DIR that every node sees. Under plain
python, or without torchrun's variables: a temporary folder. The world size must divide the 12 rows.
"""

import argparse
import contextlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.exercises import load_function
from lessonlib.training import flat_params, global_batch, max_gap, mlp, my_rows

HERE = os.path.dirname(os.path.abspath(__file__))
atomic_save, shared_folder = (
    load_function(os.path.join(HERE, "10_save.py"), n) for n in ("atomic_save", "shared_folder")
)
ROWS = 12  # the global batch: the same training at 1, 2, 3 or 4 ranks
LR, MOMENTUM, TOL = 0.1, 0.9, 1e-12


@contextlib.contextmanager
def checkpoint_folder(ctx, given):
    """The folder every attempt of this run reads and writes; the same path on every rank."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not given and not run_id:  # plain python, or ranks started without torchrun: nothing to resume
        with shared_folder(ctx) as folder:
            yield folder
        return
    box = [given or os.path.join(tempfile.gettempdir(), f"ch12-elastic-{run_id}")]
    if ctx.is_main:
        os.makedirs(box[0], exist_ok=True)
    dist.broadcast_object_list(box, src=0)  # rank 0's path: other nodes may have another temp folder
    yield box[0]
    dist.barrier()  # nobody reads any more
    if ctx.is_main and not given:
        shutil.rmtree(box[0], ignore_errors=True)


# [start: resume]
def resume(ddp, opt, path, steps, ctx):
    """The step to start from: 0, or the one after the last checkpoint, whose state is then loaded."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu")  # every rank reads it (chapter 10)
    if state["step"] > steps:
        raise ValueError(f"rank {ctx.rank}: {path} is at step {state['step']}, past --steps {steps}: use another --dir")
    ddp.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])  # momentum: without it the resumed run takes other steps
    return state["step"]


# [end: resume]


# [start: train]
def train(ddp, opt, start, steps, folder, ctx, fail):
    path = os.path.join(folder, "checkpoint.pt")
    for step in range(start, steps):
        if step == fail.get("step") and ctx.rank == fail.get("rank"):
            raise RuntimeError(f"rank {ctx.rank}: injected failure at step {step}, attempt {fail['attempt']}")
        x, y = global_batch(step, ROWS)  # a function of the step alone: same data after a restart
        mine = my_rows([ROWS // ctx.world_size] * ctx.world_size, ctx.rank)
        opt.zero_grad()
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        if ctx.is_main:  # one writer; "step" is the next step to run
            atomic_save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, path)
        dist.barrier()  # the checkpoint is complete before anyone goes on


# [end: train]


def uninterrupted(steps):
    """One process, every row of every step's batch, no failure."""
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        x, y = global_batch(step, ROWS)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return flat_params(model)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, default=8, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--fail-at", type=int, help="the step at which --fail-rank raises (first attempt only)")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-every-attempt", action="store_true", help="raise on every attempt: a real bug")
    parser.add_argument("--dir", help="the checkpoint folder (kept; on a file system every node sees)")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="seconds a collective may wait")
    args = parser.parse_args()
    if args.fail_at is not None and not 0 <= args.fail_at < args.steps:
        parser.error(f"--fail-at must be a step from 0 to {args.steps - 1}")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if ROWS % world_size:
        sizes = ", ".join(str(n) for n in range(1, ROWS + 1) if ROWS % n == 0)
        parser.error(f"{world_size} ranks cannot split the global batch of {ROWS} rows evenly: run at {sizes} ranks")
    # A static rendezvous (--master-port, no --rdzv-id) names every run "none": a folder named after it
    # would hand one job's checkpoint to the next, unrelated, job.
    if not args.dir and os.environ.get("TORCHELASTIC_RUN_ID") == "none":
        parser.error("TORCHELASTIC_RUN_ID is 'none' (torchrun with --master-port): give --dir, or torchrun --rdzv-id")
    # [start: attempt]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # 0, then 1 after the first restart, ...
    # [end: attempt]
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    fail = {}
    if args.fail_at is not None and (attempt == 0 or args.fail_every_attempt):
        fail = {"step": args.fail_at, "rank": args.fail_rank, "attempt": attempt}
    with checkpoint_folder(ctx, args.dir) as folder:
        ddp = DDP(mlp(seed=0))
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        start = resume(ddp, opt, os.path.join(folder, "checkpoint.pt"), args.steps, ctx)
        print(f"rank {ctx.rank}: attempt {attempt}, starting at step {start}")
        lessonlib.report("start", {"attempt": attempt, "step": start})
        train(ddp, opt, start, args.steps, folder, ctx, fail)
        got, expected = flat_params(ddp.module), uninterrupted(args.steps)
        gap = max_gap(got, expected)
        assert gap <= TOL, (
            f"rank {ctx.rank}: after {args.steps} steps the weights differ by {gap:.1e} from one process's"
        )
        lessonlib.report("final", {"attempt": attempt, "weights": got.tolist(), "gap": gap})
        if ctx.is_main:
            print(f"{args.steps} steps, attempt {attempt}: weights equal one uninterrupted process's (gap {gap:.1e})")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
