"""torchrun --nproc_per_node=2 lessons/10_exercise_checkpoint.py

Checker for the chapter 10 exercise: save_checkpoint(path, ddp, opt, epoch) and load_checkpoint(path, ddp, opt).

Options: --solution FILE checks your answer, the function named by --function NAME (default: save_checkpoint;
a load_... name checks loading) in FILE; --dir DIR (where to make the checkpoint folder; default: a temporary
one).

Both run on every rank; --function's name (save_... or load_...) says which one is checked. The file
holds {"model": the bare model's state dict, "opt": the optimizer's, "epoch": epoch}.
save_checkpoint writes epoch 1, then epoch 2 over it. The file must load with weights_only=True into
the bare model. A probe in the optimizer's state, called by torch.save while it serializes, notes which
ranks write and what `path` holds meanwhile (the complete epoch-1 file, or the write is not atomic),
and makes rank 0 slow for 1 s: every rank must find the new epoch in the file when save_checkpoint
returns (a barrier). Afterwards `path` is a new file, with nothing else left in the folder.
load_checkpoint must return the epoch and leave every rank's parameters and momentum equal to the
file's, on the CPU. The file says its tensors were saved on cuda:0, so without map_location torch.load
fails (no GPU) or initializes CUDA and fills GPU 0.
Without --solution the checker tests itself: it accepts the reference solution (the `solution` region,
which the chapter shows) and rejects ddp.state_dict(), a direct torch.save, every rank writing, no
barrier, rank 0 alone loading, and no map_location (at world size 1, only the mistakes one rank can
make).
"""

import collections
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lessonlib.exercises import checker_options, load_function, run_checker
from lessonlib.training import flat_params, global_batch, mlp, my_rows

HERE = os.path.dirname(os.path.abspath(__file__))
shared_folder = load_function(os.path.join(HERE, "10_save.py"), "shared_folder")
save_as_if_from_gpu = load_function(os.path.join(HERE, "10_load.py"), "save_as_if_from_gpu")


class Probe:
    """Sits in the optimizer's param group; torch.save calls __reduce__ while it serializes the state."""

    def __init__(self, path):
        self.path, self.calls = path, []

    def __reduce__(self):
        try:
            held = torch.load(self.path)["epoch"] if os.path.exists(self.path) else None
        except Exception:
            held = "a broken file"
        self.calls.append(held)
        if dist.get_rank() == 0 and held == 1:
            time.sleep(1.0)  # rank 0 is slow now: the others must wait for it
        return (collections.OrderedDict, ())  # loads back as an empty OrderedDict, weights_only or not


def trained(ctx, seed):
    ddp = DDP(mlp(seed=seed))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        x, y = global_batch(step, 4 * ctx.world_size)
        mine = my_rows([4] * ctx.world_size, ctx.rank)
        opt.zero_grad()
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
    return ddp, opt


def momentum(opt):
    return torch.cat([opt.state[p]["momentum_buffer"].flatten() for p in opt.param_groups[0]["params"]])


def matches(state, ddp, opt, rank):
    """None if `state` (a loaded file) holds this model and optimizer, else what is wrong."""
    bare, fresh = mlp(seed=99), None
    try:
        bare.load_state_dict(state["model"])
        fresh = torch.optim.SGD(bare.parameters(), lr=0.05, momentum=0.9)
        fresh.load_state_dict(state["opt"])
    except Exception as e:
        keys = list(state["model"])[:2] if isinstance(state.get("model"), dict) else state.keys()
        return f"rank {rank}: the file does not load into the bare model and its optimizer ({keys}...): {e}"[:400]
    if not torch.equal(flat_params(bare), flat_params(ddp.module)) or not torch.equal(momentum(fresh), momentum(opt)):
        return f"rank {rank}: the file's weights or momentum are not the model's"
    return None


def first_problem(problem, ctx):
    """The first problem any rank found, the same on every rank (so all ranks stop together)."""
    every = [None] * ctx.world_size
    dist.all_gather_object(every, problem)
    return next((p for p in every if p), None)


def read_back(path, epoch, ddp, opt, rank):
    """None if `path` holds epoch `epoch` of this model and optimizer, right after save_checkpoint returned."""
    if not os.path.exists(path):
        return f"rank {rank}: save_checkpoint returned before the file existed: add dist.barrier() after rank 0's save"
    try:
        state = torch.load(path)  # weights_only=True
    except Exception as e:
        return f"rank {rank}: after save_checkpoint returned, torch.load failed: {str(e)[:300]}"
    if state.get("epoch") != epoch:
        return (
            f"rank {rank}: save_checkpoint(epoch={epoch}) returned while the file held epoch "
            f"{state.get('epoch')}: rank 0 had not finished; add dist.barrier() after its save"
        )
    return matches(state, ddp, opt, rank)


def check_save(fn, ctx, folder):
    path, rank = os.path.join(folder, "checkpoint.pt"), ctx.rank
    ddp, opt = trained(ctx, seed=3)
    opt.param_groups[0]["probe"] = probe = Probe(path)
    for epoch in (1, 2):
        inode = os.stat(path).st_ino if os.path.exists(path) else None
        fn(path, ddp, opt, epoch)
        if problem := first_problem(read_back(path, epoch, ddp, opt, rank), ctx):  # before rank 0 writes again
            return problem
    if rank != 0 and probe.calls:
        return f"rank {rank} wrote a checkpoint too: save on rank 0 only, the replicas are equal"
    if rank == 0 and probe.calls[-1:] != [1]:
        held = probe.calls[-1] if probe.calls else "nothing saved through torch.save"
        return (
            f"while rank 0 wrote epoch 2, the checkpoint's path held {held}, not epoch 1: write a "
            "temporary file in the same folder, then os.replace it onto the path"
        )
    if rank == 0 and os.stat(path).st_ino == inode:
        return "the checkpoint was rewritten in place: write a temporary file, then os.replace it onto the path"
    if rank == 0 and sorted(os.listdir(folder)) != ["checkpoint.pt"]:
        return f"files left in the folder: {sorted(set(os.listdir(folder)) - {'checkpoint.pt'})}"
    return None


def check_load(fn, ctx, folder):
    path, rank = os.path.join(folder, "checkpoint.pt"), ctx.rank
    ddp, opt = trained(ctx, seed=4)  # every rank holds the same: DDP keeps the replicas equal
    if ctx.is_main:
        save_as_if_from_gpu({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "epoch": 7}, path)
    dist.barrier()
    fresh = DDP(mlp(seed=5))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    cuda_before = torch.cuda.is_available() and torch.cuda.is_initialized()
    try:
        epoch = fn(path, fresh, fresh_opt)
    except Exception as e:
        return f"rank {rank}: load_checkpoint raised {type(e).__name__}: {str(e)[:300]}"
    if torch.cuda.is_available() and torch.cuda.is_initialized() and not cuda_before:
        return f"rank {rank}: loading put tensors on GPU 0 (the file was saved there): pass map_location"
    if epoch != 7:
        return f"rank {rank}: load_checkpoint returned {epoch!r}, the file says epoch 7"
    if not torch.equal(flat_params(fresh.module), flat_params(ddp.module)):
        return f"rank {rank}: the parameters are not the file's: every rank must load"
    if not fresh_opt.state or not torch.equal(momentum(fresh_opt), momentum(opt)):
        return f"rank {rank}: the optimizer's momentum is not the file's: load the optimizer's state too"
    return None


def verdict(fn, ctx, parent=None):
    """The first problem any rank found (the same string on every rank), or None."""
    with shared_folder(ctx, parent) as folder:
        check = check_save if fn.__name__.startswith("save") else check_load
        try:
            problem = check(fn, ctx, folder)
        except Exception as e:  # a crash is a wrong answer too, with its message
            problem = f"rank {ctx.rank}: {fn.__name__} raised {type(e).__name__}: {str(e)[:300]}"
        return first_problem(problem, ctx)


# [start: solution]
def save_checkpoint(path, ddp, opt, epoch):
    import os  # self-contained: a solution is sent to the checker alone
    import tempfile

    if dist.get_rank() == 0:  # one writer: the replicas are equal
        state = {"model": ddp.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))  # same file system
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)  # the old file or the new one, never half of one
    dist.barrier()  # nobody goes on (and reads) before the file is complete


def load_checkpoint(path, ddp, opt):
    state = torch.load(path, map_location="cpu")  # every rank; the file may name cuda:0
    ddp.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])  # DDP broadcasts none of this
    return state["epoch"]


# [end: solution]


def saver(prefix=False, in_place=False, every_rank=False, barrier=True):
    """A save_checkpoint with the mistakes that are switched on."""

    def save(path, ddp, opt, epoch):
        if every_rank or dist.get_rank() == 0:
            state = {"model": (ddp if prefix else ddp.module).state_dict(), "opt": opt.state_dict(), "epoch": epoch}
            tmp = path if in_place else f"{path}.{dist.get_rank()}.tmp"
            torch.save(state, tmp)
            if tmp != path:
                os.replace(tmp, path)
        if barrier:
            dist.barrier()

    return save


def loader(rank0_only=False, map_location="cpu"):
    """A load_checkpoint with the mistakes that are switched on."""

    def load(path, ddp, opt):
        state = torch.load(path, map_location=map_location)
        if not rank0_only or dist.get_rank() == 0:
            ddp.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        return state["epoch"]

    return load


WRONG = {
    "ddp.state_dict()": saver(prefix=True),
    "torch.save onto the path": saver(in_place=True),
    "every rank writes": saver(every_rank=True),
    "no barrier": saver(barrier=False),
    "rank 0 alone loads": loader(rank0_only=True),
    "no map_location": loader(map_location=None),
}
ONE_RANK_CANNOT = {"every rank writes", "no barrier", "rank 0 alone loads"}  # mistakes only with others


def main():
    parser = checker_options(__doc__, "save_checkpoint")  # --function load_checkpoint checks loading
    parser.add_argument("--dir", help="where to make the checkpoint folder (a shared file system with several nodes)")
    args = parser.parse_args()
    run_checker(
        __doc__,
        lambda fn, ctx: verdict(fn, ctx, args.dir),
        [save_checkpoint, load_checkpoint],
        WRONG,
        right_alone=ONE_RANK_CANNOT,
        passed="passes every check",
        args=args,
    )


if __name__ == "__main__":
    main()
