"""Measuring what sharding changes, and predicting it (chapter 13).

    with Traffic() as t:              # around one training step, on every rank
        step()
    t.sent                            # bytes this process handed to the kernel to send (Linux), or None
    t.calls, t.payload                # collectives seen, by name: how many, and the bytes they were given

    held(tensors)                     # bytes of the storage behind tensors (a shard's padding included)
    per_rank_bytes(params, world_size, strategy)     # the calculator: what each rank holds
    sent_per_step(params, world_size, strategy)      # and what each rank sends per step

The bytes sent are measured, not assumed: `/proc/self/io`'s `wchar` counts every byte this process
passed to the write family of system calls (write, writev, ...; not send, sendto or sendmsg), and
gloo's TCP transport sends tensors with writev (strace shows it), so the difference around a step
is what the rank really sent (nothing else may write meanwhile: no print inside the block). Other
systems have no /proc: `sent` is then None and the lessons say so. The calls are counted by a
TorchDispatchMode, which sees every c10d collective started on this thread, the ones DDP's C++
reducer issues during backward included; not those started from callbacks on gloo's own threads
(PowerSGD's, chapter 14), whose bytes `sent` still counts.
"""

import math
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

IO = "/proc/self/io"

# Collectives by the name the dispatcher gives them (torch.ops.c10d.*), in the words the chapter uses.
COLLECTIVES = {
    "allreduce_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "reduce_": "reduce",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "send": "send",
    "recv_": "recv",
    "barrier": "barrier",
}

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


def bytes_written():
    """Bytes this process has passed to write(), writev() and the like since it started (Linux), or None
    elsewhere. send(), sendto() and sendmsg() are not counted: check_counted catches a transport that uses them."""
    try:
        with open(IO) as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from _tensors(item)


class _CountCollectives(TorchDispatchMode):
    def __init__(self, calls, payload):
        super().__init__()
        self.calls, self.payload = calls, payload

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if func.namespace == "c10d":
            name = COLLECTIVES.get(packet.__name__, packet.__name__)
            self.calls[name] += 1
            # The input: the first tensor argument (or list of them); outputs come first only for
            # the *_base_ and gather forms, whose input is the second.
            second = packet.__name__ in ("_allgather_base_", "_reduce_scatter_base_", "allgather_", "reduce_scatter_")
            given = _tensors(args[1] if second else args[0]) if args else ()
            self.payload[name] += sum(t.numel() * t.element_size() for t in given)
        return func(*args, **(kwargs or {}))


class Traffic:
    """What this rank sends inside a `with` block: bytes (measured by the kernel) and collectives.

    `sent` is None where /proc/self/io does not exist (not Linux). `calls` counts collectives by name
    ("all_reduce", "all_gather", "reduce_scatter", "broadcast", ...), `payload` the bytes of the
    tensors each rank gave them. Wait for async work inside the block: bytes sent after it are missed.
    """

    def __init__(self):
        self.calls, self.payload = Counter(), Counter()
        self.sent = None
        self._mode = _CountCollectives(self.calls, self.payload)

    def __enter__(self):
        # The first dispatch-mode call imports torch._dynamo, which probes the temporary folder by
        # writing a 4-byte file: done here, before the count starts, so that it is not counted.
        tempfile.gettempdir()
        self._start = bytes_written()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        end = bytes_written()
        self.sent = None if end is None or self._start is None else end - self._start
        if exc[0] is None and dist.is_initialized():
            check_counted(self.sent, sum(self.payload.values()), dist.get_world_size())
        return False


def check_counted(sent, payload, world_size):
    """Raise when collectives with a payload ran across ranks and `wchar` did not move at all.

    `wchar` counts the write family of system calls (gloo's TCP pairs use `writev`), not `send`,
    `sendto` or `sendmsg`: a transport that sends with those would read as 0 bytes, not as a cheap step.
    """
    if sent == 0 and payload > 0 and world_size > 1:
        raise RuntimeError(
            f"collectives gave {payload} bytes to {world_size} ranks, yet /proc/self/io's wchar did not "
            "move: this transport sends with send()/sendmsg(), which wchar does not count, so Traffic "
            "cannot measure it"
        )


def held(tensors):
    """Bytes of the storage behind `tensors`, each storage counted once.

    The storage, not numel(): a shard that FSDP padded to an even split has storage beyond its
    visible elements, and that padding is memory the rank holds.
    """
    seen = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor: this rank's piece
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state(opt):
    """The tensors an optimizer keeps between steps (Adam: exp_avg, exp_avg_sq and step, per parameter)."""
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def shard(n, world_size):
    """Elements per rank when n elements are split evenly, padded up: ceil(n / world_size)."""
    return math.ceil(n / world_size)


def per_rank_bytes(params, world_size, strategy, *, param_bytes=4, grad_bytes=4, state_bytes=8):
    """What one rank holds, in bytes, for a model of `params` parameters (the calculator).

    Per parameter: `param_bytes` for the weights, `grad_bytes` for the gradients, `state_bytes` for
    the optimizer (Adam in float32: 8, its two moments; with a float32 master copy beside bf16
    weights, 12). ddp keeps everything whole on every rank; zero1 splits the optimizer state, zero2
    the gradients too, fsdp (ZeRO-3) the weights as well. Splits are padded up (`shard`). Activations
    and the temporary whole weights FSDP gathers are not included: they depend on the batch and on
    how the model is wrapped (the chapter measures them).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if world_size < 1 or params < 0:
        raise ValueError(f"need params >= 0 and world_size >= 1; got {params} and {world_size}")
    part = shard(params, world_size)
    level = STRATEGIES.index(strategy)  # 0: nothing split, 1: optimizer, 2: + gradients, 3: + weights
    out = {
        "parameters": (part if level >= 3 else params) * param_bytes,
        "gradients": (part if level >= 2 else params) * grad_bytes,
        "optimizer state": (part if level >= 1 else params) * state_bytes,
    }
    out["total"] = sum(out.values())
    return out


def sent_per_step(params, world_size, strategy, *, param_bytes=4, reduce_scatter="ring"):
    """Bytes one rank sends per training step, by the ring model, for `params` parameters.

    An all-reduce of B bytes sends 2(N-1)/N * B per rank; an all-gather or a reduce-scatter whose
    whole tensor is B bytes sends (N-1)/N * B. ddp: one all-reduce of the gradients. zero1 and zero2:
    a reduce-scatter of the gradients and an all-gather of the updated weights. fsdp: an all-gather of
    the weights in forward, another in backward, a reduce-scatter of the gradients.
    reduce_scatter="allreduce" is for gloo, whose reduce-scatter is an all-reduce of the whole tensor
    (measured in chapter 13): it sends 2(N-1)/N * B.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if reduce_scatter not in ("ring", "allreduce"):
        raise ValueError(f"reduce_scatter must be 'ring' or 'allreduce'; got {reduce_scatter!r}")
    n, whole = world_size, params * param_bytes
    one = (n - 1) / n * whole  # an all-gather or a ring reduce-scatter
    rs = one if reduce_scatter == "ring" else 2 * one
    if strategy == "ddp":
        return 2 * one
    if strategy in ("zero1", "zero2"):
        return rs + one
    return 2 * one + rs


# Bytes per parameter: float32 training with Adam, and mixed precision as the ZeRO paper counts it
# (bf16 weights and gradients, a float32 master copy of the weights and Adam's two float32 moments).
PRECISIONS = {
    "float32": {"param_bytes": 4, "grad_bytes": 4, "state_bytes": 8},
    "mixed": {"param_bytes": 2, "grad_bytes": 2, "state_bytes": 12},
}


def plan(params, world_size, precision="mixed", memory=None):
    """The closing table of chapter 13: for each strategy, what one rank holds and sends per step.

    `params`: the model's parameter count; `precision`: "float32" or "mixed" (PRECISIONS); `memory`:
    the bytes one accelerator has, to say whether weights, gradients and optimizer state fit (with
    nothing left for activations, which this does not count). Traffic by the ring model (NCCL).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    sizes = PRECISIONS[precision]
    ddp_sent = sent_per_step(params, world_size, "ddp", param_bytes=sizes["grad_bytes"])
    rows = []
    for strategy in STRATEGIES:
        held = per_rank_bytes(params, world_size, strategy, **sizes)
        sent = sent_per_step(params, world_size, strategy, param_bytes=sizes["grad_bytes"])
        row = {
            "strategy": strategy,
            **held,
            "sent per step": sent,
            "sent vs ddp": sent / ddp_sent if ddp_sent else 1.0,
        }
        if memory is not None:
            row["fits"] = held["total"] <= memory
        rows.append(row)
    return rows
