"""Process-group setup and teardown for lessons (chapter 1).

    ctx = lessonlib.setup()          # or: with lessonlib.setup() as ctx: ...
    ctx = lessonlib.setup(device="cpu")  # a lesson whose tensors stay on the CPU, GPUs or not
    ctx.rank, ctx.local_rank, ctx.world_size, ctx.is_main, ctx.device, ctx.timeout
    lessonlib.teardown()

Reads what torchrun put in the environment, picks the backend from what this machine really has
(gloo on CPU; nccl only when CUDA is available with a GPU for every local rank), and always passes a
short `timeout` to `init_process_group`, so a collective that one rank never joins becomes an error
instead of a hang. Under plain `python lesson.py` it sets up a real process group of one rank (an
in-memory store), so the same collective calls run unchanged at world size 1. Under Slurm's `srun` with
one task per rank and no torchrun, it first fills torchrun's variables from Slurm's (`from_slurm`,
chapter 17), so every lesson also runs as `srun --ntasks-per-node=N python lessons/X.py`.
"""

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .launcher import runfolder

DEFAULT_TIMEOUT = 30.0  # seconds; setup(timeout=...) overrides it


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """Where this process sits in the job. `group_rank` is the node's index (torchrun's GROUP_RANK)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    backend: str
    device: torch.device
    launched: bool  # True under torchrun, False under plain python
    # The bound given to init_process_group. Groups made later with new_group do not inherit it
    # (their default is 30 minutes, chapter 2): pass timeout=ctx.timeout to new_group too.
    timeout: datetime.timedelta = datetime.timedelta(seconds=DEFAULT_TIMEOUT)

    @property
    def is_main(self):
        return self.rank == 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        teardown()
        return False


def pick_backend(local_world_size):
    """'nccl' when CUDA really works here with a GPU per local rank, else 'gloo'.

    torch.cuda.is_available(), not torch.accelerator.current_accelerator(): the latter names 'cuda'
    on a CUDA build of torch even when the machine has no GPU. It reads no environment variable: a
    backend forced by launch(backend=...) is setup's to honour.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def from_slurm(env=os.environ):
    """Under `srun` with one task per rank (no torchrun), set torchrun's variables from Slurm's; return the
    names set ([] when torchrun has set them already, or this is no srun step of several tasks).

    Slurm's batch script itself has SLURM_PROCID=0 and SLURM_NTASKS set too, though it is one process: only
    a job step (SLURM_STEP_ID, which srun sets) has one task per rank. MASTER_ADDR and MASTER_PORT say where
    rank 0's store listens; Slurm has no such variables, so the job script exports them (chapter 17).
    """
    if "RANK" in env or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return []
    world = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    if int(world) == 1:
        return []
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in env]
    if missing:
        raise RuntimeError(
            f"srun started this rank without torchrun, and {' and '.join(missing)} is not set: export both in the "
            'job script, e.g. MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) and '
            "MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))"
        )
    node = int(env.get("SLURM_NODEID", "0"))
    values = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": world,
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), node)),
        "GROUP_RANK": str(node),
    }
    env.update(values)
    return list(values)


def _tasks_on_node(spec, node):
    """Node `node`'s task count from Slurm's compressed per-node list: "2(x3),1" is 2, 2, 2, 1."""
    counts = []
    for part in filter(None, spec.split(",")):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts[node] if node < len(counts) else 1


def _env_int(name, default):
    value = os.environ.get(name)
    return default if value is None else int(value)


def setup(backend=None, timeout=None, device=None):
    """Join the process group torchrun described (or a one-rank group under plain python).

    device="cpu" is for lessons whose tensors stay on the CPU by design (chapters 5 to 7 compare
    float64 CPU arithmetic exactly): the backend is then the one that serves CPU tensors, gloo, even
    on a machine with GPUs, where nccl would refuse them. device=None picks from the machine.
    """
    if device not in (None, "cpu"):
        raise ValueError(f"device must be None (pick from this machine) or 'cpu'; got {device!r}")
    from_slurm()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world_size = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    group_rank = _env_int("GROUP_RANK", 0)
    if device == "cpu":
        backend = backend or os.environ.get(runfolder.BACKEND_VAR) or "gloo"
        if backend == "nccl":
            raise ValueError("device='cpu' needs a backend that reduces CPU tensors (gloo); nccl was asked for")
    backend = backend or os.environ.get(runfolder.BACKEND_VAR) or pick_backend(local_world_size)
    timeout = float(timeout if timeout is not None else DEFAULT_TIMEOUT)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    bound = datetime.timedelta(seconds=timeout)
    if not dist.is_initialized():
        kwargs = dict(backend=backend, timeout=bound)
        if backend == "nccl":  # bind the group to this rank's GPU: barrier() and friends then use it
            kwargs["device_id"] = device
        if launched:
            dist.init_process_group(init_method="env://", **kwargs)
        else:
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return DistContext(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        group_rank=group_rank,
        backend=backend,
        device=device,
        launched=launched,
        timeout=bound,
    )


def teardown():
    """Leave the process group: a barrier, then destroy_process_group (safe twice, or without setup).

    The barrier keeps a rank from closing its connections while a peer still needs them. Without it,
    a rank that has finished (say, a lesson with no collective after setup) can exit while a slower
    peer is still connecting gloo's mesh, and that peer's init_process_group fails with "Connection
    closed by peer", which a loaded machine makes likely. A barrier that fails
    (a peer is gone) still leaves the group, then raises.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            if dist.get_world_size() > 1:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def report(tag, value):
    """Hand `value` (anything JSON can hold) to the notebook that launched this rank; returns it.

    The launcher collects reports into `run.reports(tag)`, so a notebook can build a table or a plot
    from what each rank really computed, without parsing printed text. Run directly under torchrun,
    reports go nowhere: print what a reader should see.
    """
    run_dir = os.environ.get(runfolder.RUN_DIR_VAR)
    if run_dir:
        runfolder.add_report(run_dir, os.environ.get("RANK", "0"), tag, value)
    return value
