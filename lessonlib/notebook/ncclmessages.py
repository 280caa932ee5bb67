"""What a GPU job prints where chapter 12's gloo jobs print their errors, and where each line lives.

Chapter 12 makes every failure happen on CPU with gloo. A GPU job talks through NCCL, whose words differ.
Each row here pairs a symptom's gloo text (shown running in the chapter) with NCCL's, quoted verbatim as
`lessons/12_nccl.py` printed it on a GPU or as torch's source writes it, with the parts that vary in a run
(ranks, counts, times) as they came out there. `parts` are the fixed pieces of that text and `file` the
file of the installed torch (or of the NCCL and CUDA libraries it installs) that holds them:
`find_in_torch` looks them up, and tests/test_nccl_messages.py fails when an upgrade changes one. A row
whose `absent` is true quotes text the pinned version no longer has: the test checks that it is still gone.
Chapter 12, section "On a GPU: what NCCL says", shows the table.
"""

import mmap
from dataclasses import dataclass
from pathlib import Path

from ..launcher.spec import ROOT

# Where lessons/12_nccl.py's output, run on a GPU, is kept for readers without one.
CAPTURE = ROOT / "book" / "captured" / "12_nccl_gpu.json"


@dataclass(frozen=True, kw_only=True)
class NcclMessage:
    symptom: str
    gloo: str  # what this chapter's gloo runs show
    nccl: str  # what a GPU job shows, verbatim where quoted
    seen: str  # "run": printed by lessons/12_nccl.py on a GPU (see CAPTURE); "source": read, not run
    file: str = ""  # relative to the site-packages folder that holds torch
    parts: tuple = ()  # fixed text that must be in `file`, and in the GPU run's output if seen == "run"
    also: tuple = ()  # fixed text that must be in `file`, not printed by that run (a setting, a newer line)
    absent: bool = False  # quoted from another version: the pinned one must not have it


MESSAGES = (
    NcclMessage(
        symptom="A collective some rank never joins, or one that never completes",
        gloo="Timed out waiting 4000ms for recv operation to complete (raised in every waiting rank's own thread)",
        nccl="[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, "
        "NumelIn=1, NumelOut=1, Timeout(ms)=5000) ran for 5077 milliseconds before timing out. "
        "(printed by a watchdog thread; the Python thread is still inside whatever waits for the GPU)",
        seen="run",
        file="torch/lib/libtorch_cuda.so",
        parts=("Watchdog caught collective operation timeout: ", "WorkNCCL(", " milliseconds before timing out."),
    ),
    NcclMessage(
        symptom="How that rank then ends",
        gloo="the exception ends the rank like any other, and torchrun stops the rest",
        nccl="Received a dump signal due to a collective timeout from this local rank and we will try our best "
        "to dump the debug info. ... Some NCCL operations have failed or timed out. Due to the asynchronous "
        "nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data. ... "
        "terminate called after throwing an instance of 'c10::DistBackendError' ... Process group watchdog "
        "thread terminated with exception: ... (SIGABRT, exit code -6, about a minute after the timeout: the "
        "time it gives the flight recorder's dump)",
        seen="run",
        file="torch/lib/libtorch_cuda.so",
        parts=(
            "Received a dump signal due to a collective timeout from ",
            "Some NCCL operations have failed or timed out. Due to the ",
            "Process group watchdog thread terminated with exception: ",
        ),
    ),
    NcclMessage(
        symptom="TORCH_NCCL_ASYNC_ERROR_HANDLING=0",
        gloo="(no such setting)",
        nccl="the watchdog prints the same timeout, then nothing ends the process: it waits on for as long as "
        "the GPU work does, forever if a peer never comes",
        seen="run",
        file="torch/lib/libtorch_cuda.so",
        also=("TORCH_NCCL_ASYNC_ERROR_HANDLING",),
    ),
    NcclMessage(
        symptom="TORCH_NCCL_BLOCKING_WAIT=1",
        gloo="(gloo always raises in the waiting thread)",
        nccl="[Rank 0] Work WorkNCCL(SeqNum=3, ...) timed out in blocking wait. and work.wait() raises "
        "torch.distributed.DistBackendError with the watchdog's text, in your Python thread (run on torch 2.11, "
        "where the watchdog also ran; torch 2.14.1's source logs 'TORCH_NCCL_BLOCKING_WAIT is enabled, NO "
        "watchdog thread is created.')",
        seen="run",
        file="torch/lib/libtorch_cuda.so",
        parts=(" timed out in blocking wait.",),
        also=("TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created.",),
    ),
    NcclMessage(
        symptom="Which rank is behind: TORCH_NCCL_DESYNC_DEBUG=1",
        gloo="TORCH_DISTRIBUTED_DEBUG=DETAIL's checks before each collective (section: collectives that do not match)",
        nccl="Rank 0 - [0] Timeout at collective: ALLREDUCE, #3 - To our best knowledge, the "
        "lagging/dead/mismatched ranks that caused the desync are: - [0] joined but didn't finish collective #3 "
        "(count from 1)",
        seen="run",
        file="torch/lib/libtorch_cuda.so",
        parts=("] Timeout at collective: ", "the lagging/dead/mismatched ranks that caused the desync are:"),
    ),
    NcclMessage(
        symptom="The watchdog itself stuck (a CUDA call that never returns)",
        gloo="(no watchdog)",
        nccl="ProcessGroupNCCL's watchdog got stuck for ... seconds ...; you can either increase the timeout "
        "(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC) to a larger value or disable the heartbeat monitor "
        "(TORCH_NCCL_ENABLE_MONITORING=0).",
        seen="source",
        file="torch/lib/libtorch_cuda.so",
        also=(
            "ProcessGroupNCCL's watchdog got stuck for ",
            "you can either increase the timeout (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC) to a larger value or "
            "disable the heartbeat monitor (TORCH_NCCL_ENABLE_MONITORING=0).",
        ),
    ),
    NcclMessage(
        symptom="A rank that raised, was killed, or exited 0 early",
        gloo="Connection closed by peer / reset by peer in the others, at once",
        nccl="no error at once: the others wait in their collective until the watchdog's timeout (first row); "
        "read the first rank to fail, not the timeouts",
        seen="source",
    ),
    NcclMessage(
        symptom="When the ranks connect",
        gloo="inside init_process_group, which waits for every rank",
        nccl="without device_id, at the first collective (NCCL_DEBUG=INFO prints '... commId 0x... - Init "
        "COMPLETE' after init_process_group returned); with device_id, inside init_process_group",
        seen="run",
        file="nvidia/nccl/lib/libnccl.so.2",
        parts=(" - Init COMPLETE",),
    ),
    NcclMessage(
        symptom="A network interface name that does not exist",
        gloo="GLOO_SOCKET_IFNAME (not shown in this chapter)",
        nccl="NCCL WARN Bootstrap : no socket interface found, then torch.distributed.DistBackendError: NCCL "
        "error in: .../ProcessGroupNCCL.cpp:3135, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL "
        "version 2.28.9",
        seen="run",
        file="nvidia/nccl/lib/libnccl.so.2",
        parts=("Bootstrap : no socket interface found", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
    ),
    NcclMessage(
        symptom="Two ranks on one GPU (every rank on cuda:0)",
        gloo="(CPU: no device to share)",
        nccl="NCCL WARN Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60, then "
        "DistBackendError ... invalid usage (NCCL 2.28.9, with torch 2.11). The NCCL 2.30.7 that torch 2.14.1 "
        "installs no longer has this text; what it does instead was not run here",
        seen="run",
        file="nvidia/nccl/lib/libnccl.so.2",
        parts=("Duplicate GPU detected",),
        absent=True,
    ),
    NcclMessage(
        symptom="Out of memory on one rank",
        gloo="the host's OOM killer: exit code -9, Signal 9 (SIGKILL), no traceback",
        nccl="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1048576.00 GiB. GPU 0 has a total "
        "capacity of 139.80 GiB of which 139.29 GiB is free. ... on that rank; its peers then wait as in the "
        "first row",
        seen="run",
        file="torch/lib/libc10_cuda.so",
        parts=("CUDA out of memory. Tried to allocate ",),
    ),
    NcclMessage(
        symptom="A CUDA error reported at the wrong line",
        gloo="(CPU kernels fail at their own line)",
        nccl="torch.AcceleratorError: CUDA error: device-side assert triggered ... CUDA kernel errors might be "
        "asynchronously reported at some other API call, so the stacktrace below might be incorrect. For "
        "debugging consider passing CUDA_LAUNCH_BLOCKING=1",
        seen="run",
        file="torch/lib/libc10_cuda.so",
        parts=("CUDA kernel errors might be asynchronously reported at some other API call",),
    ),
    NcclMessage(
        symptom="dist.monitored_barrier in a GPU job",
        gloo="works: it names the ranks that did not come",
        nccl="ValueError: monitored_barrier requires a group with a CPU-capable backend (e.g. GLOO). torch 2.14.1 "
        'accepts the backend "cpu:gloo,cuda:nccl" (its CPU side); torch 2.11 refused it too ("monitored_barrier '
        'is only implemented for GLOO backend.", run). On both, a group from new_group(backend="gloo") works (run)',
        seen="source",
        file="torch/distributed/distributed_c10d.py",
        parts=("monitored_barrier requires a group with a CPU-capable backend (e.g. GLOO).",),
    ),
    NcclMessage(
        symptom="A process that ends without destroy_process_group()",
        gloo="(nothing printed)",
        nccl="WARNING: destroy_process_group() was not called before program exit, which can leak resources.",
        seen="run",
        file="torch/lib/libtorch_cuda.so",
        parts=("WARNING: destroy_process_group() was not called before program exit, which can leak resources.",),
    ),
)


def torch_site_packages():
    """The folder that holds the installed torch package (and, for pip's wheels, nvidia/)."""
    import torch

    return Path(torch.__file__).resolve().parent.parent


def find_in_torch(file, parts):
    """{part: found} for each fixed text in `file` (relative to torch's site-packages), read as bytes."""
    path = torch_site_packages() / file
    if not path.exists():
        raise FileNotFoundError(f"{path} is not installed: the quoted messages cannot be checked against it")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return {part: data.find(part.encode()) != -1 for part in parts}
