"""torchrun --nproc_per_node=2 lessons/14_powersgd_gloo.py

PowerSGD on gloo: one bucket trains; two or more fail, whatever the number of gloo threads.

Options: --buckets 1 (1, 2 or 4: DDP's bucket_cap_mb is chosen to make that many); --gloo-threads 2 (the
worker threads of the process group DDP and PowerSGD use; gloo's default is 2); --steps 40; --pg-timeout 5
(seconds: the process group's timeout, and the watchdog's).

The model: 4 Linear(64, 64) layers, float32, under DDP with powerSGD_hook (matrix_approximation_rank 1,
start_powerSGD_iter 2, error feedback and warm start on, the defaults). The process group is a new gloo
group with --gloo-threads worker threads (ProcessGroupGloo options). PowerSGD sends three all-reduces per
bucket, the second and third started from callbacks when the one before has finished. With one bucket
the ranks train --steps steps (asserted: their weights are equal). With more, the buckets' callbacks
start their all-reduces in an order that can differ from rank to rank, and the run fails: gloo matches
a message of the wrong size (it aborts: "Received data size doesn't match expected size"), or the ranks
wait for each other for ever. The process group's timeout does not end that wait, so a faulthandler
watchdog of --pg-timeout seconds, armed once compression starts, ends it with every thread's stack.
Measured while writing it, on a 2-core machine: 1 bucket trained with 1 and 2 threads; 2 buckets failed
in 14 runs of 14, with 1, 2, 4 and 8 threads, and 4 buckets in 2 of 2, with 8.
"""

import argparse
import datetime
import faulthandler
import os

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
CAPS = {1: 25, 2: 0.04, 4: 0.0165}  # MiB: 1 bucket, 2 buckets, 4 buckets for this 66 kB model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--buckets", type=int, default=1, choices=sorted(CAPS))
    parser.add_argument("--gloo-threads", type=int, default=2, choices=range(1, 33), metavar="1..32")
    parser.add_argument("--steps", type=int, default=40, choices=range(START + 1, 201), metavar=f"{START + 1}..200")
    parser.add_argument("--pg-timeout", type=float, default=5, help="seconds: the group's timeout and the watchdog")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    # [start: group]
    options = dist.ProcessGroupGloo._Options()
    options._threads = args.gloo_threads  # gloo's worker threads for this group (default 2)
    options._timeout = datetime.timedelta(seconds=args.pg_timeout)
    group = dist.new_group(backend="gloo", pg_options=options)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    ddp = DDP(net, process_group=group, bucket_cap_mb=CAPS[args.buckets])
    state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=START)
    seen = set()  # the buckets of this step, by index

    def hook(state, bucket):
        seen.add(bucket.index())
        return powerSGD_hook.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    # [end: group]
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(ctx.rank))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(args.steps):
        if step == START:  # compression starts: from here on a hang ends with every thread's stack, exit 1
            faulthandler.dump_traceback_later(args.pg_timeout, exit=True)
        seen.clear()
        opt.zero_grad()
        F.mse_loss(ddp(x), x).backward()
        opt.step()
        if step == 1:  # DDP's buckets are final from the second step (chapter 7)
            buckets = len(seen)
            assert buckets == args.buckets, f"rank {ctx.rank}: {buckets} buckets, not {args.buckets}"
    faulthandler.cancel_dump_traceback_later()
    weights = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    copies = [torch.empty_like(weights) for _ in range(ctx.world_size)]
    dist.all_gather(copies, weights)
    assert all(torch.equal(c, weights) for c in copies), f"rank {ctx.rank}: the replicas differ"
    lessonlib.report("powersgd", {"buckets": buckets, "gloo threads": args.gloo_threads, "steps": args.steps})
    threads = args.gloo_threads
    print(f"rank {ctx.rank}: {args.steps} steps, {buckets} bucket(s), {threads} gloo threads: ended normally")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
