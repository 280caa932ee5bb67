"""torchrun --nproc_per_node=2 lessons/10_save.py

Writing a DDP checkpoint: which state dict, written how, and what torch.load accepts.

Options: --dir DIR (where to make the checkpoint folder; default: a temporary one).

1. Keys. ddp.state_dict() names every entry "module." + name. A file saved that way, as many tutorials
   do, does not load into the bare model of a one-process script (the real error, from the file);
   ddp.module.state_dict() does, and an old file can have its prefix stripped.
2. A crash in the middle of a save, for real, on rank 0, which holds the epoch-1 checkpoint and now
   writes epoch 2: a save that raises (a lambda in the state), and a process that the kernel kills once
   the file it writes passes 256 kB (RLIMIT_FSIZE, as a full quota would). Written straight onto the
   checkpoint's path, both leave a file that torch.load rejects: epoch 1 is lost. Written to a temporary
   file in the same folder and then os.replace'd onto the path, epoch 1 still loads (asserted).
3. weights_only=True, torch.load's default: an argparse.Namespace and numpy's RNG state in the file are
   refused (the real error); the same information as plain types and tensors loads, and
   torch.serialization.safe_globals allowlists a class you trust.
The folder is made by rank 0 (tempfile) and its path sent to every rank, or is made inside --dir
(needed with several nodes: /tmp is not shared); it is removed at the end. Linux or macOS (fork, resource).
"""

import argparse
import contextlib
import os
import re
import resource
import shutil
import signal
import tempfile
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib

LIMIT = 256 * 1024  # bytes the killed process may write; the checkpoint is about 1 MB


# [start: folder]
@contextlib.contextmanager
def shared_folder(ctx, parent=None):
    """A new folder that every rank knows: made by rank 0, its path broadcast to the others.

    On leaving the block, rank 0 removes it: after a barrier when the block ended normally (nobody
    is still reading), at once when it raised (a peer may be gone, and a barrier would only wait).
    """
    box = [tempfile.mkdtemp(prefix="ch10-", dir=parent) if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    try:
        yield box[0]
        dist.barrier()
    finally:
        if ctx.is_main:
            shutil.rmtree(box[0], ignore_errors=True)


# [end: folder]


# [start: atomic_save]
def atomic_save(obj, path):
    """torch.save to a temporary file next to `path`, then rename it onto `path` in one step."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)  # atomic within one file system: readers see the old file or the new one
    except BaseException:
        os.remove(tmp)
        raise


# [end: atomic_save]


def naive_save(obj, path):
    torch.save(obj, path)  # opens (and empties) the checkpoint first, then writes into it


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 2))


def keys(ddp, folder):
    path = os.path.join(folder, "ddp_state_dict.pt")
    # [start: keys]
    torch.save({"model": ddp.state_dict()}, path)  # as many tutorials save it: keys "module.0.weight", ...
    plain = model()  # later, an evaluation script in one process, no DDP
    try:
        plain.load_state_dict(torch.load(path)["model"])
    except RuntimeError as e:
        error = str(e)
    plain.load_state_dict(ddp.module.state_dict())  # keys "0.weight", ...: what to save
    # [end: keys]
    assert "Missing key(s)" in error and "Unexpected key(s)" in error, error
    # every key the bare model expects is missing, and its "module." twin in the file unexpected
    assert all(f'"{k}"' in error and f'"module.{k}"' in error for k in plain.state_dict()), error
    old = torch.load(path)["model"]
    consume_prefix_in_state_dict_if_present(old, "module.")  # repairs a file already saved with the prefix
    plain.load_state_dict(old)
    return {
        "ddp.state_dict()": list(ddp.state_dict()),
        "ddp.module.state_dict()": list(ddp.module.state_dict()),
        "error": error,
    }


# [start: crash]
def crash_during_save(save, state, path, how):
    """Save `state` over `path` and fail half-way: the save raises, or the process is killed."""
    if how == "raises":
        try:
            save({**state, "lr_schedule": lambda step: 0.9**step}, path)  # pickle cannot save a lambda
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    with warnings.catch_warnings():  # Python 3.12+ warns about fork in a threaded process; the child
        warnings.simplefilter("ignore", DeprecationWarning)  # only writes one file and dies
        pid = os.fork()
    if pid == 0:  # a child process, so that the lesson survives its death
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core dump
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))  # the kernel kills it past LIMIT bytes
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores that signal; dying is the default
        save(state, path)
        os._exit(0)  # not reached
    _, status = os.waitpid(pid, 0)
    return f"killed by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else "finished"


# [end: crash]


def crashes(ddp, folder):
    rows = []
    for save in (naive_save, atomic_save):
        for how in ("raises", "killed"):
            sub = tempfile.mkdtemp(dir=folder)
            path = os.path.join(sub, "checkpoint.pt")
            atomic_save({"model": ddp.module.state_dict(), "epoch": 1}, path)
            assert 4 * LIMIT < os.path.getsize(path) < 1.1e6, os.path.getsize(path)  # about 1 MB, past the limit
            said = crash_during_save(save, {"model": ddp.module.state_dict(), "epoch": 2}, path, how)
            try:
                found, error = torch.load(path)["epoch"], ""
            except Exception as e:
                found, error = None, f"{type(e).__name__}: {e}".split(". This is an internal")[0]
            others = sorted(set(os.listdir(sub)) - {"checkpoint.pt"})
            if save is naive_save:
                assert found is None and "PytorchStreamReader failed" in error, (
                    f"{how}: naive save left {found} {error}"
                )
            else:
                assert found == 1, f"{how}: after a failed atomic save, the checkpoint holds {found} {error}"
                assert others == [] if how == "raises" else len(others) == 1, others  # a killed writer leaves its tmp
            assert ("pickle" in said) if how == "raises" else said == "killed by SIGXFSZ", said
            rows.append(
                {
                    "write": save.__name__,
                    "failure": how,
                    "the save": said.split(" at 0x")[0],
                    "file size": os.path.getsize(path),
                    "torch.load": error or f"epoch {found}",
                    "other files": ", ".join(f"{o} ({os.path.getsize(os.path.join(sub, o))} B)" for o in others),
                }
            )
    return rows


def weights_only(folder):
    path = os.path.join(folder, "extras.pt")
    args = argparse.Namespace(lr=0.1, epochs=4)
    # [start: weights_only]
    torch.save({"args": args, "numpy_rng": np.random.get_state()}, path)
    needs = torch.serialization.get_unsafe_globals_in_checkpoint(path)  # what the file asks to import
    try:
        torch.load(path)  # weights_only=True: tensors, dicts, lists, numbers, strings, and little else
    except Exception as e:
        refused = f"{type(e).__name__}: {e}"
    name, key, *rest = np.random.get_state()
    torch.save({"args": vars(args), "numpy_rng": (name, torch.from_numpy(key), *rest)}, path)  # plain types
    plain = torch.load(path)
    torch.save({"args": args}, path)
    with torch.serialization.safe_globals([argparse.Namespace]):  # a class you trust, allowlisted
        allowed = torch.load(path)
    # [end: weights_only]
    assert "Weights only load failed" in refused and "argparse.Namespace" in refused, refused
    assert {"argparse.Namespace", "numpy.ndarray"} <= set(needs), needs  # the arguments, numpy's RNG key
    assert plain["args"] == vars(args) and torch.equal(plain["numpy_rng"][1], torch.from_numpy(key))
    assert allowed["args"] == args
    why = re.sub(r"\x1b\[[0-9;]*m", "", refused.split("WeightsUnpickler error: ")[-1]).split("\n")[0]
    return {"globals the file needs": sorted(needs), "error": refused.split(".")[0] + ". ... " + why}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--dir", help="where to make the checkpoint folder (a shared file system with several nodes)")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    with shared_folder(ctx, args.dir) as folder:
        ddp = DDP(model())
        if ctx.is_main:  # one writer: the replicas are equal (chapter 7)
            lessonlib.report("keys", keys(ddp, folder))
            for row in lessonlib.report("crashes", crashes(ddp, folder)):
                print(f"{row['write']:11} {row['failure']:6}: torch.load then says {row['torch.load'][:70]}")
            refused = lessonlib.report("weights_only", weights_only(folder))["globals the file needs"]
            print(f"weights_only=True refuses {refused}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
