"""torchrun --nproc_per_node=2 lessons/03_prepare.py

Preparing data once: a slow download into a folder the ranks share, and who may do it.

Options: --folder DIR (default: a temporary folder, removed at the end), --case all|stalled (default all),
--download-timeout S (stalled only: the longest wait for the next chunk; default none), --pg-timeout S
(default 30).

"Downloading" writes a small saved tensor in chunks, with a pause between them, as a slow network does.
Asserted, by the default case, on every rank:
  half_file: every rank runs `if not exists: download` then loads. The lesson holds rank 0's download
    halfway until the others have looked (a real download stays half-written for minutes): they see the
    file, load it, and torch.load fails on the half. (A lone rank has nobody to race: it downloads, then loads.)
  atomic: the same with the download written to a temporary name and renamed when whole: nobody reads a
    half file, but every rank finds no file and downloads it itself (the work done world-size times).
  once: which rank prepares, for a folder each node has of its own (node-local disk) and for one folder
    every node shares: global rank 0 leaves the other nodes' disks empty (their loads fail); local rank 0
    on a shared folder prepares it once per node. On one node both are the same rank: chapter 3 runs the
    lesson as two torchrun agents of two ranks (chapter 1's two nodes on one machine) to tell them apart.
  --case stalled: rank 0's download stalls halfway for a minute and the others wait at the barrier until
    the process group's timeout (a run that fails, by design). With --download-timeout S, rank 0 gives up
    after S seconds without data, and the outcome is broadcast, so every rank raises rank 0's reason at once.
"""

import argparse
import io
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import lessonlib

CHUNKS, PAUSE = 8, 0.05  # a download: 8 chunks, 50 ms apart


def payload():
    buffer = io.BytesIO()
    torch.save({"x": torch.arange(4096, dtype=torch.float32)}, buffer)
    return buffer.getvalue()


# [start: download]
def download(path, halfway=None, stall=0.0, timeout=None):
    """Write the data to `path` chunk by chunk, as a slow download does: the file exists, half-written.

    `halfway` is called in the middle; `stall` seconds pass there (a connection that stops delivering);
    `timeout` bounds each wait for the next chunk, as urlopen(url, timeout=...) does.
    """
    data = payload()
    step = -(-len(data) // CHUNKS)
    with open(path, "wb") as f:
        for i in range(CHUNKS):
            f.write(data[i * step : (i + 1) * step])
            f.flush()
            wait = PAUSE
            if i == CHUNKS // 2 - 1:
                wait += stall
                if halfway:
                    halfway()
            if timeout is not None and wait > timeout:
                time.sleep(timeout)
                raise TimeoutError(f"no data for {timeout} s")
            time.sleep(wait)


def download_atomic(path, **kwargs):
    """The same download into a temporary name in the same folder, renamed when whole: os.replace is atomic."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        download(tmp, **kwargs)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# [end: download]


# [start: naive]
def naive(path, fetch):
    """What people often write: every rank checks, and downloads when the file is not there yet."""
    if not path.exists():
        fetch(path)
    return torch.load(path)


# [end: naive]


def attempt(fn):
    """fn()'s result and None, or None and the error's first line: the half file's load fails, reported."""
    try:
        return fn(), None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"


def race(folder, ctx, fetch):
    """Every rank runs naive(); rank 0's download is held halfway until the others have looked."""
    path, calls = folder / "data.pt", []

    def noted(p, **kwargs):
        calls.append(p)
        fetch(p, **kwargs)

    if ctx.rank == 0:  # two barriers: the others look at the half file between them
        _, error = attempt(lambda: naive(path, lambda p: noted(p, halfway=lambda: (dist.barrier(), dist.barrier()))))
    else:
        dist.barrier()
        _, error = attempt(lambda: naive(path, noted))
        dist.barrier()
    return {"prepared": bool(calls), "error": error}


# [start: once]
def prepare_once(folder, ctx, node_local):
    """The rule: one rank per copy of the folder prepares it (atomically), the others wait, then all load."""
    path = Path(folder) / "data.pt"
    preparer = ctx.local_rank == 0 if node_local else ctx.rank == 0
    if preparer:
        download_atomic(path)
    dist.barrier()  # nobody loads before the preparer is done
    return torch.load(path), preparer


# [end: once]


# [start: bounded]
def prepare_or_fail_together(folder, ctx, **download_options):
    """Rank 0 prepares with a bounded wait, then tells every rank how it went: a failure ends them all at once."""
    path, error = Path(folder) / "data.pt", None
    if ctx.rank == 0:
        try:
            download_atomic(path, **download_options)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)  # where the others would wait at a bare barrier
    if outcome[0]:
        raise RuntimeError(f"rank {ctx.rank}: rank 0 could not prepare the data ({outcome[0]})")
    return torch.load(path)


# [end: bounded]


def stalled(folder, ctx, timeout):
    """Rank 0's download stalls for a minute halfway (a connection that stops delivering)."""
    start = time.monotonic()
    try:
        if timeout is not None:
            prepare_or_fail_together(folder, ctx, stall=60, timeout=timeout)
        else:
            if ctx.rank == 0:
                download_atomic(Path(folder) / "data.pt", stall=60)
            dist.barrier()
    finally:
        print(f"rank {ctx.rank}: ended after {time.monotonic() - start:.1f} s", flush=True)


def gathered(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def cases(base, ctx):
    nodes = ctx.world_size // ctx.local_world_size
    expected = payload()
    rows = {}
    for name, fetch in (("half_file", download), ("atomic", download_atomic)):
        folder = base / name
        if ctx.rank == 0:
            folder.mkdir()
        dist.barrier()
        rows[name] = gathered(race(folder, ctx, fetch))
    half, atomic = rows["half_file"], rows["atomic"]
    assert all(r["error"] for r in half[1:]), f"half_file: a rank loaded the half file {half}"
    assert half[0]["error"] is None and sum(r["prepared"] for r in half) == 1, f"half_file: {half}"
    assert all(r["error"] is None and r["prepared"] for r in atomic), f"atomic: every rank downloads, no error {atomic}"
    for node_local in (True, False):  # a disk per node, or one folder every node sees
        for who in ("local rank 0", "rank 0"):
            where = f"node{ctx.group_rank}" if node_local else "shared"
            folder = base / f"{who.replace(' ', '_')}-{'local' if node_local else 'shared'}" / where
            if ctx.local_rank == 0:
                folder.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            loaded, error = attempt(lambda f=folder, w=who: prepare_once(f, ctx, node_local=(w == "local rank 0")))
            ok = error is None and torch.equal(loaded[0]["x"], torch.load(io.BytesIO(expected))["x"])
            error = error and error.replace(str(base), "<folder>")
            row = gathered({"node": ctx.group_rank, "prepared": bool(loaded and loaded[1]), "ok": ok, "error": error})
            rows[f"{who} prepares, {'a disk per node' if node_local else 'one shared folder'}"] = row
    for key, row in rows.items():
        if key in ("half_file", "atomic"):
            continue
        preparers, failed = sum(r["prepared"] for r in row), [r for r in row if not r["ok"]]
        if key.startswith("rank 0") and "disk per node" in key:  # only node 0's disk gets the data
            assert preparers == 1 and len(failed) == ctx.world_size - ctx.local_world_size, f"{key}: {row}"
            assert all(r["node"] > 0 and "No such file" in r["error"] for r in failed), f"{key}: {row}"
        else:
            assert not failed, f"{key}: {row}"
            assert preparers == (nodes if key.startswith("local") else 1), f"{key}: {preparers} preparers"
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--folder", help="the folder the ranks share (default: a temporary one, removed)")
    parser.add_argument("--case", choices=("all", "stalled"), default="all")
    parser.add_argument("--download-timeout", type=float, help="stalled: the longest wait for the next chunk")
    parser.add_argument("--pg-timeout", type=float, default=30, help="seconds a collective waits")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    # torchrun stops the others with SIGTERM when one fails: exit through `finally`, which removes the folder
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    box = [args.folder or (tempfile.mkdtemp(prefix="ch03-prepare-") if ctx.rank == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    base = Path(box[0])
    try:
        if args.case == "stalled":
            stalled(base, ctx, args.download_timeout)
        else:
            rows = cases(base, ctx)
            lessonlib.report("prepare", rows)
            if ctx.is_main:
                for key, row in rows.items():
                    print(
                        f"{key}: prepared by {[i for i, r in enumerate(row) if r['prepared']]}, "
                        f"errors {[i for i, r in enumerate(row) if r['error']]}"
                    )
        lessonlib.teardown()
    finally:
        if args.folder is None and ctx.rank == 0:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
