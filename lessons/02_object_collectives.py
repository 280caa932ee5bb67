"""torchrun --nproc_per_node=2 lessons/02_object_collectives.py

Collectives on Python objects (dicts, lists, strings), and what they cost next to tensor collectives.

The four object collectives run on small dicts and their results are checked. Then the same bytes
travel both ways, as a uint8 tensor and as a Python object, for several payload sizes; the lesson
reports the median time of each and their ratio. An object collective pickles the object, first
exchanges the sizes (one extra collective), copies the bytes into a tensor, runs the tensor
collective, then copies and unpickles on the other side.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import lessonlib


# [start: object_collectives]
def object_collectives(ctx):
    n, r = ctx.world_size, ctx.rank
    mine = {"rank": r, "name": f"worker-{r}", "loss": [0.5 * r] * (r + 1)}  # sizes differ per rank

    box = [{"lr": 0.1, "schedule": "cosine"} if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)  # fills the list in place on every rank
    assert box[0] == {"lr": 0.1, "schedule": "cosine"}, f"rank {r}: broadcast_object_list gave {box}"

    everyone = [None] * n
    dist.all_gather_object(everyone, mine)
    assert [e["rank"] for e in everyone] == list(range(n)), f"rank {r}: all_gather_object gave {everyone}"

    at_root = [None] * n if ctx.is_main else None  # only dst passes a list
    dist.gather_object(mine, at_root, dst=0)
    if ctx.is_main:
        assert at_root == everyone, "gather_object and all_gather_object disagree"

    got = [None]
    work_items = [{"shard": k, "files": [f"part-{k}-{i}" for i in range(k + 1)]} for k in range(n)]
    dist.scatter_object_list(got, work_items if ctx.is_main else None, src=0)
    assert got[0]["shard"] == r and len(got[0]["files"]) == r + 1, f"rank {r}: scatter_object_list gave {got}"
    return {"broadcast_object_list": box[0], "all_gather_object": everyone, "scatter_object_list": got[0]}


# [end: object_collectives]


def median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# [start: cost]
def cost(ctx, nbytes, repeats):
    """Same payload as a tensor and as an object: broadcast and all_gather, median seconds each."""
    n = ctx.world_size
    tensor = torch.full((nbytes,), ctx.rank, dtype=torch.uint8, device=ctx.device)
    obj = bytes(tensor.cpu().numpy())  # the same bytes, as a Python object
    out = [torch.empty_like(tensor) for _ in range(n)]
    objs = [None] * n
    floats = [float(ctx.rank)] * (nbytes // 8)  # a list of Python floats, e.g. per-sample losses
    times = {
        "broadcast": median_seconds(lambda: dist.broadcast(tensor, src=0), repeats),
        "broadcast_object_list": median_seconds(lambda: dist.broadcast_object_list([obj], src=0), repeats),
        "all_gather": median_seconds(lambda: dist.all_gather(out, tensor), repeats),
        "all_gather_object (bytes)": median_seconds(lambda: dist.all_gather_object(objs, obj), repeats),
        "all_gather_object (list of floats)": median_seconds(lambda: dist.all_gather_object(objs, floats), repeats),
    }
    assert objs[-1] == [float(n - 1)] * (nbytes // 8), f"rank {ctx.rank}: all_gather_object lost data"
    return {
        "payload bytes": nbytes,
        **{k + " (ms)": v * 1e3 for k, v in times.items()},
        "broadcast: object / tensor": times["broadcast_object_list"] / times["broadcast"],
        "all_gather: object / tensor": times["all_gather_object (bytes)"] / times["all_gather"],
    }


# [end: cost]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--sizes",
        type=lessonlib.comma_list(int, low=8),
        default="64,65536,4194304",
        help="payload sizes in bytes, comma-separated, each at least 8",
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    ctx = lessonlib.setup()
    got = lessonlib.report("objects", object_collectives(ctx))
    print(f"scatter_object_list gave this rank {got['scatter_object_list']}")
    for nbytes in args.sizes:
        row = lessonlib.report("cost", cost(ctx, nbytes, args.repeats))
        if ctx.is_main:
            print(
                f"{nbytes:>9} B: broadcast object/tensor {row['broadcast: object / tensor']:.1f}x, "
                f"all_gather object/tensor {row['all_gather: object / tensor']:.1f}x"
            )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
