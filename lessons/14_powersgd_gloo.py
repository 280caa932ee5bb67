"""torchrun --nproc_per_node=2 lessons/14_powersgd_gloo.py

PowerSGD on gloo: one bucket trains; with more, the ranks hang, train apart or abort, whatever the threads.

Options: --buckets 1 (1, 2 or 4: DDP's bucket_cap_mb is the bytes of 4/N layers, so each bucket holds 4/N);
--uneven (with --buckets 2: a bucket of 3 layers and one of 1); --gloo-threads 2 (the worker threads of the
gloo group DDP and PowerSGD use; gloo's default is 2); --steps 40; --pg-timeout 5 (seconds: the group's
timeout, and the watchdog's).

The model: 4 Linear(64, 64) layers, float32, under DDP with powerSGD_hook (matrix_approximation_rank 1,
start_powerSGD_iter 2, error feedback and warm start on, the defaults), in --buckets buckets of the same
size, or of 3 layers and 1 (--uneven); their bytes are asserted at step 1, before compression starts.
PowerSGD makes three all-reduces per bucket and starts the second and the third from callbacks on the
future of the one before; each callback then waits for the all-reduce it started (`.wait()`, torch
2.14.1's powerSGD_hook.py). gloo runs a future's callbacks on the worker thread that finished the work, so:
  - every bucket in flight can hold one worker thread, waiting. With no more threads than buckets, every
    thread can wait for an all-reduce that only a free thread could run: the process hangs (one bucket
    with one thread too, and at one rank too). The group's timeout does not end that wait, so a
    faulthandler watchdog of --pg-timeout seconds, armed once compression starts, ends it with every
    thread's stack (the waiting threads are in powerSGD_hook's callbacks).
  - with more threads than buckets nothing hangs, but the buckets' callbacks start their all-reduces in
    an order that differs from rank to rank, and gloo pairs a rank's collectives with the others' by the
    order they were started: one rank's bucket is summed with another's other bucket. Buckets of the same
    size raise nothing and the replicas part (reported, then asserted: the run fails); buckets of
    different sizes make gloo abort: "Received data size doesn't match expected size".
On torch 2.14.1 new_group(backend="gloo", pg_options=...) ignores the options (tests/test_ch14_powersgd.py),
so the group comes from a registered backend that passes them, and the lesson checks the worker threads
it then has (Linux: the threads named pt_gloo_runloop). benchmarks/powersgd_gloo.py repeats every case.
"""

import argparse
import datetime
import faulthandler
import os
import time
from pathlib import Path

# Tensors stay on the CPU. With a GPU visible, torch 2.14.1's PowerSGD calls torch.cuda.synchronize on the
# CPU tensors' device, an error (lessons/14_hooks.py, tests/test_gpu_workarounds.py).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib

START = 2  # start_powerSGD_iter: plain all-reduces before it
LAYERS, WIDTH = 4, 64
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one layer's float32 weight and bias: 16640 bytes


def layers_per_bucket(buckets, uneven):
    """The layers in each bucket, the first bucket (the last layers, whose gradients come first) first."""
    return [3, 1] if uneven else [LAYERS // buckets] * buckets


def cap_mb(layers):
    """DDP's bucket_cap_mb for buckets of `layers` layers. DDP closes a bucket once it holds at least the cap
    (the tensor that crosses it goes in too), so a cap of exactly k layers' bytes makes buckets of k layers,
    and one a little above a layer takes in the next layer too: half as many buckets."""
    return LAYER_BYTES * layers / 2**20


def gloo_workers(expected, within=5.0):
    """How many gloo worker threads this process has, every group's, once `expected` of them have named
    themselves (each names itself when it starts) or `within` seconds have passed; None without /proc."""
    end = time.monotonic() + within
    while True:
        comms = list(Path("/proc/self/task").glob("*/comm"))
        count = sum(p.read_text().strip() == "pt_gloo_runloop" for p in comms if p.exists()) if comms else None
        if count in (None, expected) or time.monotonic() > end:
            return count
        time.sleep(0.01)


# [start: group]
def gloo_group(threads, timeout):
    """A gloo group with `threads` worker threads (ProcessGroupGloo's own options)."""

    def create(store, rank, size, timeout):
        options = dist.ProcessGroupGloo._Options()
        options._threads, options._timeout = threads, timeout
        names = os.environ.get("GLOO_SOCKET_IFNAME")  # the interfaces, as the default group reads them
        make, default = dist.ProcessGroupGloo.create_device, dist.ProcessGroupGloo.create_default_device
        options._devices = [make(interface=n) for n in names.split(",")] if names else [default()]
        return dist.ProcessGroupGloo(store, rank, size, options)

    dist.Backend.register_backend("gloo_threads", create, devices=["cpu"])
    return dist.new_group(backend="gloo_threads", timeout=timeout)


# [end: group]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--buckets", type=int, default=1, choices=(1, 2, 4))
    parser.add_argument("--uneven", action="store_true", help="with --buckets 2: buckets of 3 layers and 1")
    parser.add_argument("--gloo-threads", type=int, default=2, choices=range(1, 33), metavar="1..32")
    parser.add_argument("--steps", type=int, default=40, choices=range(START + 1, 201), metavar=f"{START + 1}..200")
    parser.add_argument("--pg-timeout", type=float, default=5, help="seconds: the group's timeout and the watchdog")
    args = parser.parse_args()
    if args.uneven and args.buckets != 2:
        parser.error("--uneven needs --buckets 2")
    layers = layers_per_bucket(args.buckets, args.uneven)
    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    # [start: ddp]
    group = gloo_group(args.gloo_threads, datetime.timedelta(seconds=args.pg_timeout))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ddp = DDP(net, process_group=group, bucket_cap_mb=cap_mb(layers[0]))
    state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=START)
    seen = {}  # this step's buckets: index -> bytes

    def hook(state, bucket):
        seen[bucket.index()] = bucket.buffer().numel() * bucket.buffer().element_size()
        return powerSGD_hook.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    # [end: ddp]
    default = dist.ProcessGroupGloo._Options()._threads  # the default group's, gloo's default: 2
    workers = gloo_workers(default + args.gloo_threads)
    assert workers in (None, default + args.gloo_threads), (
        f"rank {ctx.rank}: {workers} gloo worker threads, not {default} + --gloo-threads {args.gloo_threads}"
    )
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(ctx.rank))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(args.steps):
        if step == START:  # compression starts: from here on a hang ends with every thread's stack, exit 1
            faulthandler.dump_traceback_later(args.pg_timeout, exit=True)
        seen.clear()
        opt.zero_grad()
        F.mse_loss(ddp(x), x).backward()
        opt.step()
        if step == 1:  # DDP's buckets are final from the second step (chapter 7)
            sizes = [seen[i] for i in sorted(seen)]
            assert sizes == [LAYER_BYTES * n for n in layers], f"rank {ctx.rank}: buckets of {sizes} bytes"
            lessonlib.report("buckets", {"bytes": sizes, "gloo worker threads": workers})
    faulthandler.cancel_dump_traceback_later()
    weights = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    copies = [torch.empty_like(weights) for _ in range(ctx.world_size)]
    dist.all_gather(copies, weights)
    gap = max((c - weights).abs().max().item() for c in copies)
    lessonlib.report("replicas", {"largest gap": gap, "weights": weights.abs().max().item()})
    assert gap == 0, f"rank {ctx.rank}: the replicas differ, by up to {gap:.2e}, after {args.steps} steps"
    threads = args.gloo_threads
    print(f"rank {ctx.rank}: {args.steps} steps, {len(sizes)} bucket(s), {threads} gloo threads: replicas equal")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
