"""python lessons/12_nccl.py

What NCCL says when a GPU job breaks: each failure that one GPU can produce, made to happen in a child
process under a time bound, with the lines the child printed and a check that the expected ones are there.

Options: --case NAME (repeatable; default: every case), --list (name the cases and stop), --save PATH
(write what each case printed, as JSON).

Needs a CUDA GPU (`torch.cuda.is_available()`); without one it says so, names the cases and runs none.
One GPU is enough: a collective that never completes is an all-reduce of a one-rank group queued behind
a kernel that sleeps on the GPU. The store is a file (init_method file://...), so no case needs a port.

`--list` names the cases: NCCL connecting lazily or in init_process_group, the watchdog's timeout and
the settings that change what follows it, a wrong NCCL_SOCKET_IFNAME, two ranks on one GPU, CUDA out of
memory, a CUDA error reported at a later line, and monitored_barrier beside NCCL.
"""

import argparse
import datetime
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python lessons/12_nccl.py` from a checkout with no install
    sys.path.insert(0, str(ROOT))

from lessonlib import run_bounded  # noqa: E402 (after the path fix above)

TIMEOUT = 5  # seconds: the process group's timeout in the cases that time out
SLEEP = 20  # seconds the GPU kernel sleeps before the all-reduce: far past TIMEOUT
SLEEP_TEARDOWN = 120  # in the timeout case: long enough for the watchdog to dump, then end the process


# ---------------------------------------------------------------- what runs in the child process


def init(store, *, device_id=True, backend="nccl"):
    torch.cuda.set_device(0)
    rank, world, timeout = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), datetime.timedelta(seconds=TIMEOUT)
    device = torch.device("cuda", 0) if device_id else None
    # In order: backend, init_method, timeout, world_size, rank.
    dist.init_process_group(backend, f"file://{store}", timeout, world, rank, device_id=device)


def mark(text):
    print(f"MARK {time.monotonic() - START:.1f}s {text}", flush=True)


def gpu_sleep(seconds):
    # torch.cuda._sleep spins for a number of GPU clock cycles: measure the rate first.
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(10**8)
    torch.cuda.synchronize()
    rate = 10**8 / (time.perf_counter() - t)
    torch.cuda._sleep(int(seconds * rate))


def child_lazy_init(store, device_id):
    init(store, device_id=device_id)
    mark("init_process_group returned")
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    mark(f"first all_reduce done: {x.item()}")
    dist.destroy_process_group()


def child_stuck_all_reduce(store, blocking=False, sleep=SLEEP):
    init(store)
    x = torch.ones(1, device="cuda")
    for _ in range(2):  # two collectives that complete: the flight recorder's earlier entries
        dist.all_reduce(x)
    torch.cuda.synchronize()
    mark("two all_reduces done; the GPU now sleeps before the third")
    gpu_sleep(sleep)
    work = dist.all_reduce(x, async_op=True)
    mark("third all_reduce enqueued")
    if blocking:
        try:
            work.wait()
            mark("wait returned")
        except Exception as e:  # noqa: BLE001 (show whatever it raises)
            mark(f"wait raised {type(e).__module__}.{type(e).__name__}: {e}")
        os._exit(0)  # the GPU still sleeps; do not wait for it in teardown
    torch.cuda.synchronize()
    mark("synchronize returned: the process lived through the timeout")
    os._exit(0)


def child_two_ranks_one_gpu(store):
    # Rank 1 is this script again, started here so that it shares rank 0's output and time bound.
    argv = [sys.executable, __file__, "--child", "eager-init", "--store", store]
    peer = subprocess.Popen(argv, env=dict(os.environ, RANK="1"))
    try:
        child_lazy_init(store, device_id=True)  # both ranks on cuda:0
    finally:
        mark(f"rank 1 exited with {peer.wait()}")


def child_oom():
    try:
        torch.empty(2**50, dtype=torch.uint8, device="cuda")  # 1 PiB
    except torch.OutOfMemoryError as e:
        mark(f"raised torch.OutOfMemoryError: {e}")


def child_async_error():
    x = torch.zeros(4, device="cuda")
    i = torch.tensor([10], device="cuda")  # out of range for 4 values
    y = x[i]  # the kernel that fails
    mark("indexing returned")
    z = (y * 2).sum()
    mark(f"value {z.item()}")


def child_monitored_barrier(store, backend, gloo_group=False):
    init(store, backend=backend)
    group = dist.new_group(backend="gloo") if gloo_group else None  # a CPU group beside the NCCL one
    where = f"backend {backend!r}" + (" with a gloo group from new_group" if gloo_group else "")
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=TIMEOUT))
        mark(f"monitored_barrier passed on {where}")
    except Exception as e:  # noqa: BLE001 (show whatever it raises)
        mark(f"monitored_barrier on {where} raised {type(e).__name__}: {e}")
    dist.destroy_process_group()


def child(name, store):
    stuck = functools.partial(child_stuck_all_reduce, store)
    run = {
        "lazy-init": lambda: child_lazy_init(store, device_id=False),
        "eager-init": lambda: child_lazy_init(store, device_id=True),
        "duplicate-gpu": lambda: child_two_ranks_one_gpu(store),
        "timeout": lambda: stuck(sleep=SLEEP_TEARDOWN),
        "desync-debug": stuck,
        "no-teardown": stuck,
        "blocking-wait": lambda: stuck(blocking=True),
        "socket-ifname": lambda: (init(store), mark("init_process_group returned")),
        "oom": child_oom,
        "async-error": child_async_error,
        "async-error-blocking": child_async_error,
        "monitored-barrier-nccl": lambda: child_monitored_barrier(store, "nccl"),
        "monitored-barrier-group": lambda: child_monitored_barrier(store, "nccl", gloo_group=True),
        "monitored-barrier-both": lambda: child_monitored_barrier(store, "cpu:gloo,cuda:nccl"),
    }
    run[name]()


# ---------------------------------------------------------------- the cases, as the parent runs them


class Case(NamedTuple):
    what: str  # what it shows
    env: dict = {}  # noqa: RUF012 (never mutated) added to the child's environment
    expected: tuple = ()  # (label, regex) that the output must match
    bound: float = 120  # seconds before the child is killed


TIMED_OUT = (("the watchdog's timeout", r"Watchdog caught collective operation timeout"),)
ASSERT = (("the CUDA error", r"device-side assert triggered"),)
KERNEL_LINE = r"\s+y = x\[i\]"  # shown under a traceback's frame when the error is reported at that kernel
CASES = {
    "lazy-init": Case(
        "no device_id: NCCL's communicator is made at the first collective, not in init_process_group",
        {"NCCL_DEBUG": "INFO"},
        (("NCCL initialised after init returned", r"init_process_group returned[\s\S]*Init COMPLETE"),),
    ),
    "eager-init": Case(
        "device_id given: the communicator is made inside init_process_group",
        {"NCCL_DEBUG": "INFO"},
        (("NCCL initialised before init returned", r"Init COMPLETE[\s\S]*init_process_group returned"),),
    ),
    "timeout": Case(
        "a collective that never completes: the watchdog, the flight recorder's dump, the abort",
        {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"},
        (
            *TIMED_OUT,
            ("the work that timed out", r"WorkNCCL\(SeqNum=3, OpType=ALLREDUCE"),
            ("the teardown", r"Some NCCL operations have failed or timed out"),
        ),
        bound=180,
    ),
    "desync-debug": Case(
        "the same timeout with TORCH_NCCL_DESYNC_DEBUG=1", {"TORCH_NCCL_DESYNC_DEBUG": "1"}, TIMED_OUT
    ),
    "no-teardown": Case(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: the timeout is logged and the process goes on",
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
        (*TIMED_OUT, ("the process lived on", r"synchronize returned")),
    ),
    "blocking-wait": Case(
        "TORCH_NCCL_BLOCKING_WAIT=1: work.wait() raises the timeout in the calling thread",
        {"TORCH_NCCL_BLOCKING_WAIT": "1"},
        (("wait() raised", r"wait raised"),),
    ),
    "socket-ifname": Case(
        "NCCL_SOCKET_IFNAME naming an interface this machine does not have",
        {"NCCL_SOCKET_IFNAME": "nosuch0", "NCCL_DEBUG": "WARN"},
        (("NCCL's warning", r"no socket interface found"),),
    ),
    "duplicate-gpu": Case("two ranks that both use cuda:0", {"NCCL_DEBUG": "WARN", "WORLD_SIZE": "2"}),
    "oom": Case("an allocation larger than the GPU", expected=(("the error", r"CUDA out of memory"),)),
    "async-error": Case(
        "an out-of-range index on the GPU, reported later",
        expected=(
            *ASSERT,
            ("the advice", r"CUDA_LAUNCH_BLOCKING=1"),
            ("reported at a later line", rf"in child_async_error\n(?!{KERNEL_LINE})"),
        ),
    ),
    "async-error-blocking": Case(
        "the same with CUDA_LAUNCH_BLOCKING=1, reported at its own line",
        {"CUDA_LAUNCH_BLOCKING": "1"},
        (*ASSERT, ("reported at the kernel's line", rf"in child_async_error\n{KERNEL_LINE}")),
    ),
    "monitored-barrier-nccl": Case("monitored_barrier on an NCCL-only group"),
    "monitored-barrier-group": Case(
        "monitored_barrier on a gloo group made with new_group beside NCCL",
        expected=(("it passed", r"monitored_barrier passed"),),
    ),
    "monitored-barrier-both": Case('monitored_barrier on backend "cpu:gloo,cuda:nccl"'),
}


def run_case(name, folder):
    what, extra, expected, bound = CASES[name]
    store = folder / f"{name}.store"
    env = dict(os.environ, **{"RANK": "0", "WORLD_SIZE": "1", "PYTHONUNBUFFERED": "1", **extra})
    env["TORCH_FR_DUMP_TEMP_FILE"] = str(folder / f"{name}-trace-rank-")
    finished = run_bounded([sys.executable, __file__, "--child", name, "--store", str(store)], bound, env=env)
    output, codes, timed_out = finished.stdout, [finished.returncode], finished.timed_out
    checks = {label: bool(re.search(pattern, output)) for label, pattern in expected}
    traces = sorted(p.name for p in folder.glob(f"{name}-trace-rank-*"))
    result = dict(case=name, what=what, env=extra, seconds=round(finished.seconds, 1), returncodes=codes)
    result.update(timed_out=timed_out, output=output, checks=checks, trace_files=traces)
    if traces:  # the flight recorder's dump, read by torch's own analyser
        fr = run_bounded([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "-j",
                          str(folder), "-p", f"{name}-trace-rank-"], 60)  # fmt: skip
        result["fr_trace"] = fr.stdout
    return result


def describe(result):
    head = f"[{result['case']}] {result['what']}: exit {result['returncodes']}, {result['seconds']} s"
    if result["timed_out"]:
        head += " (killed at the bound)"
    pattern = r"MARK|Error|error|Watchdog|WARN|timed out|timeout|Init COMPLETE|Duplicate|assert"
    lines = [line for line in result["output"].splitlines() if not line.lstrip().startswith("frame #")]
    keep = [line for line in lines if re.search(pattern, line)]
    return "\n".join([head, *("    " + line[:300] for line in keep[:14])])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="a case to run (default: all)")
    parser.add_argument("--list", action="store_true", help="name the cases and stop")
    parser.add_argument("--save", type=Path, help="write every case's output to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.store)
    names = args.case or list(CASES)
    if args.list or not torch.cuda.is_available():
        if not args.list:
            print("skipped: no CUDA GPU here (torch.cuda.is_available() is False); on a machine with one, these run:")
        for name in names:
            print(f"  {name}: {CASES[name].what}")
        return None
    gpu = torch.cuda.get_device_name(0)
    about = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())), "gpu": gpu}
    print(f"torch {about['torch']}, NCCL {about['nccl']}, {gpu}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="nccl-cases-") as tmp:
        for name in names:
            results.append(run_case(name, Path(tmp)))
            print(describe(results[-1]), flush=True)
    if args.save:
        args.save.write_text(json.dumps({"about": about, "cases": results}, indent=1))
    failed = [f"{r['case']}: {label}" for r in results for label, ok in r["checks"].items() if not ok]
    assert not failed, "expected lines missing: " + "; ".join(failed)
    print(f"every expected line was there, in {len(results)} cases")


START = time.monotonic()

if __name__ == "__main__":
    main()
