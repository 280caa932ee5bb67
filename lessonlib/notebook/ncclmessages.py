"""What chapter 12 quotes from torch without a run on its page that prints it, and where each line lives.

Chapter 12 makes every failure happen on CPU with gloo, and asserts the messages those runs print. Two
kinds of quote have no such run: what a GPU job prints (NCCL's words), and what the prose quotes from
torch's source or libraries (a setting's name, a default path, an older release's wording). Both are here,
each with the file of the installed torch that holds it, so that tests/test_nccl_messages.py can look them
up and an upgrade that rewords one fails the tests instead of leaving the chapter wrong.

`MESSAGES` is the chapter's table: each symptom's gloo text (shown running in the chapter) beside NCCL's,
quoted verbatim as `lessons/12_nccl.py` printed it on a GPU (`seen="run"`, kept in `CAPTURE`) or as torch's
source writes it (`seen="source"`), with the parts that vary in a run (ranks, counts, times) as they came
out there. `QUOTES` are the prose's other quotes from torch. A `Lookup` names a file, relative to the
site-packages folder that holds torch (the NCCL and CUDA libraries of pip's wheels sit beside it), and the
fixed parts of the quote that it must hold; `present=False` marks words quoted from another version, which
the installed one must no longer have. Chapter 12, section "On a GPU: what NCCL says", shows the table.
"""

import mmap
from dataclasses import dataclass
from pathlib import Path

from ..paths import ROOT

# Where lessons/12_nccl.py's output, run on a GPU, is kept for readers without one.
CAPTURE = ROOT / "book" / "captured" / "12_nccl_gpu.json"

# The libraries that hold most of the quotes. pip's CUDA wheels install all four; a CPU-only torch has
# neither libtorch_cuda.so nor nvidia/, and the tests skip those lookups, naming the missing file.
CPU = "torch/lib/libtorch_cpu.so"
CUDA = "torch/lib/libtorch_cuda.so"
C10_CUDA = "torch/lib/libc10_cuda.so"
NCCL = "nvidia/nccl/lib/libnccl.so.2"
C10D = "torch/distributed/distributed_c10d.py"


@dataclass(frozen=True, kw_only=True)
class Lookup:
    file: str  # relative to the site-packages folder that holds torch
    parts: tuple  # fixed text, each found in the file byte for byte
    present: bool = True  # False: another version's words, which the installed file must not have


@dataclass(frozen=True, kw_only=True)
class NcclMessage:
    symptom: str
    gloo: str  # what this chapter's gloo runs show
    nccl: str  # what a GPU job shows, verbatim where quoted
    seen: str  # "run": printed by lessons/12_nccl.py on a GPU (see CAPTURE); "source": read, not run
    printed: tuple = ()  # fixed text that the GPU run printed (checked against CAPTURE)
    lookups: tuple = ()  # where the installed torch holds the quote (or must not)


@dataclass(frozen=True, kw_only=True)
class Quote:
    said: str  # as chapter 12's prose quotes it, between backticks (the tests find it there)
    lookups: tuple


MESSAGES = (
    NcclMessage(
        symptom="A collective some rank never joins, or one that never completes",
        gloo="Timed out waiting 4000ms for recv operation to complete (raised in every waiting rank's own thread)",
        nccl="[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, "
        "NumelIn=1, NumelOut=1, Timeout(ms)=5000) ran for 5077 milliseconds before timing out. "
        "(printed by a watchdog thread; the Python thread is still inside whatever waits for the GPU)",
        seen="run",
        printed=("Watchdog caught collective operation timeout: ", "WorkNCCL(", " milliseconds before timing out."),
        lookups=(
            Lookup(
                file=CUDA,
                parts=(
                    "Watchdog caught collective operation timeout: ",
                    "WorkNCCL(",
                    " milliseconds before timing out.",
                ),
            ),
        ),
    ),
    NcclMessage(
        symptom="Which collective, and where it was called",
        gloo="each rank's own traceback, and the flight recorder the lesson writes (section: where is each rank?)",
        nccl="[PG ID 0 PG GUID 0(default_pg) Rank 0]  failure detected by watchdog at work sequence id: 3 PG "
        "status: last enqueued work: 3, last completed work: 2 ... Stack trace of the failed collective: #0 "
        "all_reduce from .../distributed_c10d.py:3068 #1 wrapper from .../c10d_logger.py:83 #2 "
        "child_stuck_all_reduce from lessons/12_nccl.py:88 ...",
        seen="run",
        printed=(
            " failure detected by watchdog at work sequence id: ",
            " PG status: last enqueued work: ",
            "Stack trace of the failed collective: ",
        ),
        lookups=(
            Lookup(
                file=CUDA,
                parts=(
                    " failure detected by watchdog at work sequence id: ",
                    " PG status: last enqueued work: ",
                    "Stack trace of the failed collective: ",
                    "Stack trace of the failed collective not found, ",
                ),
            ),
        ),
    ),
    NcclMessage(
        symptom="How that rank then ends",
        gloo="the exception ends the rank like any other, and torchrun stops the rest",
        nccl="Received a dump signal due to a collective timeout from this local rank and we will try our best "
        "to dump the debug info. ... Some NCCL operations have failed or timed out. Due to the asynchronous "
        "nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data. ... "
        "terminate called after throwing an instance of 'c10::DistBackendError' ... Process group watchdog "
        "thread terminated with exception: ... (SIGABRT, exit code -6, about a minute after the timeout: the "
        "time it gives the flight recorder's dump; torchrun's summary: Signal 6 (SIGABRT), no traceback)",
        seen="run",
        printed=(
            "Received a dump signal due to a collective timeout from ",
            "Some NCCL operations have failed or timed out. Due to the ",
            "Process group watchdog thread terminated with exception: ",
        ),
        lookups=(
            Lookup(
                file=CUDA,
                parts=(
                    "Received a dump signal due to a collective timeout from ",
                    "Some NCCL operations have failed or timed out. Due to the ",
                    "Process group watchdog thread terminated with exception: ",
                ),
            ),
        ),
    ),
    NcclMessage(
        symptom="TORCH_NCCL_ASYNC_ERROR_HANDLING=0",
        gloo="(no such setting)",
        nccl="the watchdog prints the same timeout, then nothing ends the process: it waits on for as long as "
        "the GPU work does, forever if a peer never comes",
        seen="run",
        lookups=(Lookup(file=CUDA, parts=("TORCH_NCCL_ASYNC_ERROR_HANDLING",)),),
    ),
    NcclMessage(
        symptom="TORCH_NCCL_BLOCKING_WAIT=1",
        gloo="(gloo always raises in the waiting thread)",
        nccl="[Rank 0] Watchdog caught collective operation timeout: ... and [Rank 0] Work WorkNCCL(SeqNum=3, "
        "...) timed out in blocking wait., both logged by work.wait() itself, which then raises "
        "torch.distributed.DistBackendError in your Python thread (run: torch 2.11). torch 2.14.1's source "
        "starts no watchdog thread in this mode: 'TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is "
        "created.' (an INFO line), so no dump and no abort",
        seen="run",
        printed=(" timed out in blocking wait.",),
        lookups=(
            Lookup(
                file=CUDA,
                parts=(
                    " timed out in blocking wait.",
                    "TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created.",
                ),
            ),
        ),
    ),
    NcclMessage(
        symptom="Which rank is behind: TORCH_NCCL_DESYNC_DEBUG=1",
        gloo="TORCH_DISTRIBUTED_DEBUG=DETAIL's checks before each collective (section: collectives that do not match)",
        nccl="Rank 0 - [0] Timeout at collective: ALLREDUCE, #3 - To our best knowledge, the "
        "lagging/dead/mismatched ranks that caused the desync are: - [0] joined but didn't finish collective #3 "
        "(count from 1)",
        seen="run",
        printed=("] Timeout at collective: ", "the lagging/dead/mismatched ranks that caused the desync are:"),
        lookups=(
            Lookup(
                file=CUDA,
                parts=("] Timeout at collective: ", "the lagging/dead/mismatched ranks that caused the desync are:"),
            ),
        ),
    ),
    NcclMessage(
        symptom="The watchdog itself stuck (a CUDA call that never returns)",
        gloo="(no watchdog)",
        nccl="ProcessGroupNCCL's watchdog got stuck for ... seconds ...; you can either increase the timeout "
        "(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC) to a larger value or disable the heartbeat monitor "
        "(TORCH_NCCL_ENABLE_MONITORING=0). Older releases printed 'Heartbeat monitor timed out! Process will be "
        "terminated after dumping debug info.' first; torch 2.14.1 no longer has that line",
        seen="source",
        lookups=(
            Lookup(
                file=CUDA,
                parts=(
                    "ProcessGroupNCCL's watchdog got stuck for ",
                    "you can either increase the timeout (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC) to a larger value or "
                    "disable the heartbeat monitor (TORCH_NCCL_ENABLE_MONITORING=0).",
                ),
            ),
            Lookup(file=CUDA, parts=("Heartbeat monitor timed out",), present=False),
        ),
    ),
    NcclMessage(
        symptom="A rank that raised, was killed, or exited 0 early",
        gloo="Connection closed by peer / reset by peer in the others, at once",
        nccl="no error in the others' collective. Under torchrun a rank that raised or was killed exits with an "
        "error, and its agent stops the other ranks of its node (SIGTERM) within its monitor interval; ranks on "
        "other nodes, and every rank when the one that left exited 0, wait until the watchdog's timeout (first "
        "row). The agent's part runs here on gloo (section: jobs that never start)",
        seen="source",
    ),
    NcclMessage(
        symptom="When the ranks connect",
        gloo="inside init_process_group, which waits for every rank",
        nccl="without device_id, at the first collective (NCCL_DEBUG=INFO prints '... commId 0x... - Init "
        "COMPLETE' after init_process_group returned); with device_id, inside init_process_group",
        seen="run",
        printed=(" - Init COMPLETE",),
        lookups=(Lookup(file=NCCL, parts=(" - Init COMPLETE",)),),
    ),
    NcclMessage(
        symptom="dist.barrier() without device_id",
        gloo="(CPU: no device to choose)",
        nccl="UserWarning on rank 0: barrier(): using the device under current context. You can specify "
        "`device_id` in `init_process_group` to mute this warning. Older releases: '... using GPU 0 to perform "
        "barrier as devices used by this process are currently unknown. ...', which torch 2.14.1 no longer has",
        seen="source",
        lookups=(
            Lookup(
                file=C10D,
                parts=(
                    "barrier(): using the device under current context. ",
                    "You can specify `device_id` in `init_process_group` to mute this warning.",
                ),
            ),
            Lookup(
                file=CUDA,
                parts=("to perform barrier as devices used by this process are currently unknown",),
                present=False,
            ),
            Lookup(
                file=C10D,
                parts=("to perform barrier as devices used by this process are currently unknown",),
                present=False,
            ),
        ),
    ),
    NcclMessage(
        symptom="A network interface name that does not exist",
        gloo="GLOO_SOCKET_IFNAME (not shown in this chapter)",
        nccl="NCCL WARN Bootstrap : no socket interface found, then torch.distributed.DistBackendError: NCCL "
        "error in: .../ProcessGroupNCCL.cpp:3135, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL "
        "version 2.28.9",
        seen="run",
        printed=("Bootstrap : no socket interface found", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
        lookups=(
            Lookup(
                file=NCCL,
                parts=("Bootstrap : no socket interface found", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
            ),
        ),
    ),
    NcclMessage(
        symptom="Two ranks on one GPU (every rank on cuda:0)",
        gloo="(CPU: no device to share)",
        nccl="NCCL WARN Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60, then "
        "DistBackendError ... invalid usage (NCCL 2.28.9, with torch 2.11). The NCCL 2.30.7 that torch 2.14.1 "
        "installs no longer has this text; what it does instead was not run here",
        seen="run",
        printed=("Duplicate GPU detected",),
        lookups=(Lookup(file=NCCL, parts=("Duplicate GPU detected",), present=False),),
    ),
    NcclMessage(
        symptom="Out of memory on one rank",
        gloo="the host's OOM killer: exit code -9, Signal 9 (SIGKILL), no traceback",
        nccl="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1048576.00 GiB. GPU 0 has a total "
        "capacity of 139.80 GiB of which 139.29 GiB is free. ... on that rank; its peers then wait as in the "
        "first row",
        seen="run",
        printed=("CUDA out of memory. Tried to allocate ",),
        lookups=(Lookup(file=C10_CUDA, parts=("CUDA out of memory. Tried to allocate ",)),),
    ),
    NcclMessage(
        symptom="A CUDA error reported at the wrong line",
        gloo="(CPU kernels fail at their own line)",
        nccl="torch.AcceleratorError: CUDA error: device-side assert triggered ... CUDA kernel errors might be "
        "asynchronously reported at some other API call, so the stacktrace below might be incorrect. For "
        "debugging consider passing CUDA_LAUNCH_BLOCKING=1",
        seen="run",
        printed=("CUDA kernel errors might be asynchronously reported at some other API call",),
        lookups=(
            Lookup(
                file=C10_CUDA, parts=("CUDA kernel errors might be asynchronously reported at some other API call",)
            ),
        ),
    ),
    NcclMessage(
        symptom="dist.monitored_barrier in a GPU job",
        gloo="works: it names the ranks that did not come",
        nccl="ValueError: monitored_barrier requires a group with a CPU-capable backend (e.g. GLOO). torch 2.14.1 "
        'accepts the backend "cpu:gloo,cuda:nccl" (its CPU side); torch 2.11 refused it too ("monitored_barrier '
        'is only implemented for GLOO backend.", run). On both, a group from new_group(backend="gloo") works (run)',
        seen="source",
        printed=("monitored_barrier is only implemented for GLOO backend.",),
        lookups=(
            Lookup(file=C10D, parts=("monitored_barrier requires a group with a CPU-capable backend (e.g. GLOO).",)),
            Lookup(file=C10D, parts=("monitored_barrier is only implemented for GLOO backend.",), present=False),
        ),
    ),
    NcclMessage(
        symptom="A process that ends without destroy_process_group()",
        gloo="(nothing printed)",
        nccl="WARNING: destroy_process_group() was not called before program exit, which can leak resources.",
        seen="run",
        printed=("WARNING: destroy_process_group() was not called before program exit, which can leak resources.",),
        lookups=(
            Lookup(
                file=CUDA,
                parts=(
                    "WARNING: destroy_process_group() was not called before program exit, which can leak resources.",
                ),
            ),
        ),
    ),
)

# The prose's quotes from torch that no run on the page prints. tests/test_ch12_quotes.py finds every
# message-like quote of the chapter either in an assert of its cells, in the table above, or here.
QUOTES = (
    # the flight recorder: its settings and its default file (DebugInfoWriter::getWriter, FlightRecorder.cpp).
    # The compiler keeps "comm_lib_trace_rank_" as its first 16 bytes plus 4 in the code: the file holds
    # "comm_lib_trace_r", beside the other pieces of the default path.
    Quote(said="TORCH_FR_BUFFER_SIZE", lookups=(Lookup(file=CPU, parts=("TORCH_FR_BUFFER_SIZE",)),)),
    Quote(said="TORCH_FR_BUFFER_SIZE=2000", lookups=(Lookup(file=CPU, parts=("TORCH_FR_BUFFER_SIZE",)),)),
    Quote(said="TORCH_FR_DUMP_TEMP_FILE", lookups=(Lookup(file=CPU, parts=("TORCH_FR_DUMP_TEMP_FILE",)),)),
    Quote(
        said="TORCH_NCCL_DEBUG_INFO_TEMP_FILE", lookups=(Lookup(file=CPU, parts=("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",)),)
    ),
    Quote(
        said="$XDG_CACHE_HOME/torch/comm_lib_trace_rank_<rank>",
        lookups=(
            Lookup(
                file=CPU, parts=("TORCH_FR_DUMP_TEMP_FILE", "XDG_CACHE_HOME", "/.cache", "/torch", "comm_lib_trace_r")
            ),
        ),
    ),
    Quote(
        said="~/.cache/torch/comm_lib_trace_rank_<rank>",
        lookups=(Lookup(file=CPU, parts=("/.cache", "/torch", "comm_lib_trace_r")),),
    ),
    Quote(said="XDG_CACHE_HOME", lookups=(Lookup(file=CPU, parts=("XDG_CACHE_HOME",)),)),
    Quote(
        said="/tmp/nccl_trace_rank_<rank>",
        lookups=(
            Lookup(file=CPU, parts=("/tmp/nccl_trace_rank_",), present=False),
            Lookup(file=CUDA, parts=("/tmp/nccl_trace_rank_",), present=False),
        ),
    ),
    Quote(
        said="Finished writing Flight Recorder debug info to ...",
        lookups=(Lookup(file=CPU, parts=("Finished writing Flight Recorder debug info to ",)),),
    ),
    Quote(
        said="Error opening file for writing Flight Recorder debug info",
        lookups=(Lookup(file=CPU, parts=("Error opening file for writing Flight Recorder debug info: ",)),),
    ),
    Quote(
        said="TORCH_CPP_LOG_LEVEL=INFO", lookups=(Lookup(file="torch/lib/libc10.so", parts=("TORCH_CPP_LOG_LEVEL",)),)
    ),
    Quote(
        said="Here we assume the current rank is not the source of the error.",
        lookups=(
            Lookup(
                file="torch/distributed/flight_recorder/components/utils.py",
                parts=("Here we assume the current rank is not the source of the error.",),
            ),
        ),
    ),
    # NCCL's watchdog and its settings (ProcessGroupNCCL.cpp)
    Quote(
        said="Stack trace of the failed collective not found, ...",
        lookups=(Lookup(file=CUDA, parts=("Stack trace of the failed collective not found, ",)),),
    ),
    Quote(
        said="TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created.",
        lookups=(Lookup(file=CUDA, parts=("TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created.",)),),
    ),
    Quote(said="TORCH_NCCL_BLOCKING_WAIT=1", lookups=(Lookup(file=CUDA, parts=("TORCH_NCCL_BLOCKING_WAIT",)),)),
    Quote(
        said="TORCH_NCCL_ASYNC_ERROR_HANDLING", lookups=(Lookup(file=CUDA, parts=("TORCH_NCCL_ASYNC_ERROR_HANDLING",)),)
    ),
    Quote(
        said="TORCH_NCCL_ASYNC_ERROR_HANDLING=0",
        lookups=(Lookup(file=CUDA, parts=("TORCH_NCCL_ASYNC_ERROR_HANDLING",)),),
    ),
    Quote(said="TORCH_NCCL_DESYNC_DEBUG=1", lookups=(Lookup(file=CUDA, parts=("TORCH_NCCL_DESYNC_DEBUG",)),)),
    Quote(
        said="TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
        lookups=(Lookup(file=CUDA, parts=("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",)),),
    ),
    Quote(said="TORCH_NCCL_ENABLE_MONITORING=0", lookups=(Lookup(file=CUDA, parts=("TORCH_NCCL_ENABLE_MONITORING",)),)),
    Quote(
        said="Heartbeat monitor timed out",
        lookups=(Lookup(file=CUDA, parts=("Heartbeat monitor timed out",), present=False),),
    ),
    Quote(
        said="Heartbeat monitor timed out! Process will be terminated after dumping debug info.",
        lookups=(Lookup(file=CUDA, parts=("Heartbeat monitor timed out",), present=False),),
    ),
    Quote(
        said="ProcessGroupNCCL's watchdog got stuck for ... seconds without making progress in monitoring "
        "enqueued collectives.",
        lookups=(
            Lookup(
                file=CUDA,
                parts=(
                    "ProcessGroupNCCL's watchdog got stuck for ",
                    " seconds without making progress in monitoring enqueued collectives. ",
                ),
            ),
        ),
    ),
    # the barrier's device
    Quote(
        said="barrier(): using the device under current context.",
        lookups=(Lookup(file=C10D, parts=("barrier(): using the device under current context. ",)),),
    ),
    Quote(
        said="using GPU 0 to perform barrier as devices used by this process are currently unknown",
        lookups=(
            Lookup(
                file=CUDA,
                parts=("to perform barrier as devices used by this process are currently unknown",),
                present=False,
            ),
            Lookup(
                file=C10D,
                parts=("to perform barrier as devices used by this process are currently unknown",),
                present=False,
            ),
        ),
    ),
    Quote(
        said="Guessing device ID based on global rank. This can cause a hang if rank to GPU mapping is heterogeneous.",
        lookups=(
            Lookup(
                file=CUDA,
                parts=(
                    "Guessing device ID based on global rank. ",
                    "This can cause a hang if rank to GPU mapping is heterogeneous. ",
                ),
            ),
        ),
    ),
    # dist.breakpoint (torch/distributed/__init__.py)
    Quote(
        said="Supports using PDB from inside a multiprocessing child process.",
        lookups=(
            Lookup(
                file="torch/distributed/__init__.py",
                parts=("Supports using PDB from inside a multiprocessing child process.", 'open("/dev/stdin")'),
            ),
        ),
    ),
    Quote(
        said="torch.distributed.breakpoint(rank=R, skip=0, timeout_s=3600)",
        lookups=(
            Lookup(
                file="torch/distributed/__init__.py",
                parts=("def breakpoint(rank: int = 0, skip: int = 0, timeout_s=3600):",),
            ),
        ),
    ),
    Quote(
        said="timeout_s=None",
        lookups=(Lookup(file="torch/distributed/__init__.py", parts=("if timeout_s is not None:",)),),
    ),
    # torchrun, gloo and the data loader
    Quote(
        said="traceback : To enable traceback see: ...",
        lookups=(
            Lookup(
                file="torch/distributed/elastic/multiprocessing/errors/__init__.py",
                parts=("To enable traceback see: ",),
            ),
        ),
    ),
    Quote(
        said="ProcessGroupWrapper: Monitored Barrier encountered error running collective:",
        lookups=(
            Lookup(file=CPU, parts=("ProcessGroupWrapper: Monitored Barrier encountered error running collective:",)),
        ),
    ),
    Quote(
        said="RuntimeError: Gloo connectFullMesh failed with ... Connection refused",
        lookups=(Lookup(file=CPU, parts=("Gloo connectFullMesh failed with ",)),),
    ),
    Quote(
        said="DataLoader worker (pid N) is killed by signal: Killed.",
        lookups=(
            Lookup(
                file="torch/lib/libtorch_python.so", parts=("DataLoader worker (pid {}) is killed by signal: {}. ",)
            ),
        ),
    ),
    Quote(
        said="DataLoader worker (pid(s) N) exited unexpectedly",
        lookups=(
            Lookup(
                file="torch/utils/data/dataloader.py",
                parts=('f"DataLoader worker (pid(s) {pids_str}) exited unexpectedly"',),
            ),
        ),
    ),
    Quote(
        said="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        lookups=(
            Lookup(
                file="torch/distributed/elastic/rendezvous/dynamic_rendezvous.py",
                parts=('os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")',),
            ),
        ),
    ),
    Quote(
        said="TORCHELASTIC_ERROR_FILE",
        lookups=(
            Lookup(
                file="torch/distributed/elastic/multiprocessing/errors/error_handler.py",
                parts=('"TORCHELASTIC_ERROR_FILE"',),
            ),
        ),
    ),
    Quote(
        said="TORCHELASTIC_RUN_ID",
        lookups=(
            Lookup(
                file="torch/distributed/elastic/agent/server/local_elastic_agent.py", parts=('"TORCHELASTIC_RUN_ID"',)
            ),
        ),
    ),
    Quote(
        said="TORCHELASTIC_RESTART_COUNT",
        lookups=(
            Lookup(
                file="torch/distributed/elastic/agent/server/local_elastic_agent.py",
                parts=('"TORCHELASTIC_RESTART_COUNT"',),
            ),
        ),
    ),
)


def torch_site_packages():
    """The folder that holds the installed torch package (and, for pip's wheels, nvidia/)."""
    import torch  # noqa: PLC0415  (imported on first use: the chapter's table needs no torch)

    return Path(torch.__file__).resolve().parent.parent


def missing(file):
    """None when `file` (relative to torch's site-packages) is installed; else why its quotes cannot be checked."""
    path = torch_site_packages() / file
    if path.exists():
        return None
    return f"{file} is not installed here ({path} is missing, as in a CPU-only torch): its quotes cannot be checked"


def find_in_torch(file, parts):
    """{part: found} for each fixed text in `file` (relative to torch's site-packages), read as bytes."""
    why = missing(file)
    if why:
        raise FileNotFoundError(why)
    with open(torch_site_packages() / file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return {part: data.find(part.encode()) != -1 for part in parts}
