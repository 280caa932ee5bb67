"""torchrun --nproc_per_node=2 lessons/16_bandwidth.py

All-reduce time against message size on the network the ranks share, and DDP's gradient compression on it.

Chapter 16 runs it with one rank on each host of a lessonlib.Hosts whose links tc limits to a given rate,
and fits the times to the alpha-beta model; on one machine (as above) the ranks share loopback.

Options: --sizes MiB,... (all-reduced float32 tensors; default 0.25,1,4), --repeats N (default 3),
--hooks none,fp16,powersgd (the DDP communication hooks to time: none is DDP's own all-reduce),
--steps N (timed DDP steps per hook, after 2 untimed; default 3), --pg-timeout S (default 60),
--threads N (torch's intra-op threads per rank; default 1, 0 keeps torch's default of one per core).

Why one thread: chapter 16's hosts share one machine's cores, and torchrun sets OMP_NUM_THREADS=1 only
when a node runs several ranks. With a thread per core in each rank, the OpenMP threads that spin after
each parallel op take the cores the other host's rank needs to send and receive; on a 2-core machine the
DDP step without a hook then took up to twice its all-reduce (chapter 16).

Reported: "allreduce", {bytes: [seconds of each repeat]}, each repeat the slowest rank's time from a common
start (a barrier), as a collective ends for everyone only when the slowest rank is done; "own", the same
with each rank's own time; "wire", {"sent": bytes this rank's network interfaces (all but loopback, from
Linux's /proc/net/dev) sent while it timed the all-reduces, "payload": the bytes the ring model says its
all-reduces send}, on Linux with a network other than loopback only; and "compress",
{hook: {"step": median seconds, "bytes": bytes each rank all-reduces per step}}. Asserted on every rank:
the all-reduced values are right; DDP under each hook leaves every rank's weights equal.
"""

import argparse
import os
import statistics
import time
from pathlib import Path

# Tensors stay on the CPU; with a GPU visible, torch 2.14.1's PowerSGD synchronizes a CUDA device (chapter 14).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import lessonlib  # noqa: E402
from lessonlib.argtypes import comma_list  # noqa: E402

HOOKS = ("none", "fp16", "powersgd")
WIDTH, LAYERS, RANK_R = 512, 4, 2  # the DDP model: 4 Linear(512, 512), 1.05 M float32 parameters, 4 MiB


# [start: time_allreduce]
def time_allreduce(numel, repeats):
    """Seconds of each repeat of one all-reduce of `numel` float32 values: the slowest rank's, and this rank's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((numel,), float(rank + 1))
    seconds, own = [], []
    for _ in range(repeats):
        x.fill_(rank + 1)
        dist.barrier()  # a common start
        t0 = time.perf_counter()
        dist.all_reduce(x)
        took = torch.tensor([time.perf_counter() - t0])
        own.append(took.item())
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # done for all only when the slowest is
        seconds.append(took.item())
        assert x[0].item() == x[-1].item() == world * (world + 1) / 2, f"rank {rank}: all-reduce gave {x[0]}"
    return seconds, own


# [end: time_allreduce]


def interface_bytes_sent():
    """Bytes sent so far by every network interface of this host but loopback (Linux's /proc/net/dev), or None."""
    try:
        lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    except OSError:
        return None
    sent = 0
    for line in lines:
        name, fields = line.split(":", 1)
        if name.strip() != "lo":
            sent += int(fields.split()[8])  # receive has 8 columns, then transmit's bytes
    return sent


# [start: compress]
def hook_setup(name, model):
    """DDP's communication hook `name` on `model`, and the bytes each rank then all-reduces per step."""
    params = [p for p in model.parameters()]
    full = sum(p.numel() for p in params) * 4
    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)  # float16 on the wire
        return full // 2
    if name == "powersgd":  # rank-2 factors P (n x r) and Q (m x r) of each weight matrix; biases whole
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=RANK_R, start_powerSGD_iter=2)
        model.register_comm_hook(state, psgd.powerSGD_hook)
        return sum((p.shape[0] + p.shape[1]) * RANK_R * 4 if p.dim() == 2 else p.numel() * 4 for p in params)
    return full


# [end: compress]


def time_steps(name, steps, rank):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    # One bucket: PowerSGD on gloo fails with several (chapter 14).
    model = DDP(net, bucket_cap_mb=1024)
    sent = hook_setup(name, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds = []
    for step in range(2 + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, WIDTH, generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if step >= 2:  # PowerSGD compresses from its step 2 on; before it, a plain all-reduce
            seconds.append(took.item())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, other) for other in everyone), f"rank {rank}: {name}: weights differ across ranks"
    return {"step": statistics.median(seconds), "bytes": sent}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--sizes", type=comma_list(float, low=0.001, high=256), default=[0.25, 1.0, 4.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hooks", type=comma_list(str, choices=HOOKS), default=list(HOOKS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.threads < 0:
        parser.error("--threads must be 0 (torch's default) or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = lessonlib.setup(device="cpu", timeout=args.pg_timeout)
    rank, world = ctx.rank, ctx.world_size
    times, own = {}, {}
    sent_before = interface_bytes_sent()
    for mib in args.sizes:
        numel = int(mib * 2**20) // 4
        times[numel * 4], own[numel * 4] = time_allreduce(numel, args.repeats)
    # Read after the last repeat's MAX all-reduce, which no rank passes before every rank has received all
    # it was sent: this rank's bytes have left its interface by then.
    sent = interface_bytes_sent() - sent_before if sent_before is not None else 0
    payload = sum(nbytes * 2 * (world - 1) / world for nbytes in times) * args.repeats
    lessonlib.report("allreduce", times)
    lessonlib.report("own", own)
    if sent:  # nothing on loopback alone
        lessonlib.report("wire", {"sent": sent, "payload": payload})
    compress = {name: time_steps(name, args.steps, rank) for name in args.hooks}
    lessonlib.report("compress", compress)
    if rank == 0:
        for nbytes, s in times.items():
            mib, best = nbytes / 2**20, min(s) * 1e3
            print(f"all-reduce of {mib:g} MiB over {ctx.world_size} ranks: {best:.1f} ms (best of {len(s)})")
        if sent:
            print(f"sent on the network: {sent / payload:.3f} bytes per byte of all-reduce payload (rank 0)")
        for name, c in compress.items():
            print(f"DDP step, hook {name}: {c['step'] * 1e3:.1f} ms, {c['bytes'] / 2**20:.2f} MiB all-reduced per rank")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
