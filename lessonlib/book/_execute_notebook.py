"""Execute one chapter notebook the way MyST-NB does, in a process of its own (lessonlib.book.rebuild).

    python -m lessonlib.book._execute_notebook book/NN.ipynb OUT.ipynb TIMEOUT

The same function and settings as MyST-NB's own execution with `run_in_temp: false`: jupyter-cache's
`single_nb_execution`, the kernel started in the notebook's folder, TIMEOUT seconds per cell, errors
not allowed. The kernel is the one the chapter names, or this environment's Python kernel when that
one is not registered (kernel_choice).

The last line on stdout is JSON: `{"seconds": S, "slowest": [[CELL, S], ...]}` (the five slowest
cells, from the per-cell times nbclient records) after the executed notebook was written to OUT (exit
status 0), or `{"cell": I, "source": ..., "error": "Name: message", "traceback": ...}` for the cell
that failed (its index counts markdown cells too; exit status 1). A kernel that dies before its first
cell is started again, at most twice more, a second apart, and each start says so on stderr.

When the build records what it runs (LESSONLIB_LAUNCH_RECORD, lessonlib.book.launchrecord), the kernel
is told the chapter's name, so each of its launches is recorded with it, and the record gets a last line
for the chapter: whether every cell ran.
"""

import json
import os
import signal
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

import nbformat
from jupyter_cache.executors.utils import ExecutionResult, single_nb_execution

from lessonlib.book import launchrecord
from lessonlib.processes.lifeline import die_with_parent

# A kernel that dies before its first cell is started again (died_before_its_first_cell). One retry was
# not always enough on a loaded 2-core CI machine: a rebuild test lost a kernel twice running.
KERNEL_STARTS = 3
RESTART_PAUSE = 1.0  # seconds between starts


def execute(source, out, timeout):
    """Execute the notebook at `source`; write it to `out` and return the report (a dict)."""
    source = Path(source).resolve()
    for start in range(1, KERNEL_STARTS + 1):
        nb = nbformat.read(source, as_version=4)
        result = execute_once(nb, source, timeout)
        if not died_before_its_first_cell(result, nb) or start == KERNEL_STARTS:
            break
        print(
            f"{source.name}: the kernel died before its first cell ({result.err}); starting it again", file=sys.stderr
        )
        time.sleep(RESTART_PAUSE)
    if result.err is not None:
        # nbclient stops at the failing cell: the last code cell with an error output. Its own error
        # (name and value, as the reader would see it) is the report; the whole traceback comes after.
        for i, cell in reversed(list(enumerate(nb.cells))):
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            if cell.cell_type == "code" and errors:
                return {
                    "cell": i,
                    "source": cell.source,
                    "error": f"{errors[0].ename}: {errors[0].evalue}",
                    "traceback": result.exc_string,
                }
        return {"cell": None, "source": None, "error": result.exc_string, "traceback": result.exc_string}
    slowest = slowest_cells(nb)
    for cell in nb.cells:  # the timings stay out of the cached notebook: its cache key must not change
        cell.get("metadata", {}).pop("execution", None)
    nbformat.write(nb, out)
    return {"seconds": round(result.time, 1), "slowest": slowest}


def execute_once(nb, source, timeout):
    """single_nb_execution's ExecutionResult. It returns a cell's error or timeout; a kernel that died
    (nbclient's RuntimeError "Kernel died before replying to kernel_info", or DeadKernelError, one of
    its kind) it raises: that comes back as the result's error too."""
    try:
        return single_nb_execution(
            nb, cwd=str(source.parent), timeout=timeout, allow_errors=False, record_timing=True, **kernel_choice(nb)
        )
    except RuntimeError as err:
        return ExecutionResult(nb, str(source.parent), 0.0, err, traceback.format_exc())


def died_before_its_first_cell(result, nb):
    """Whether the kernel ended before running anything. One way it happens on a busy machine:
    jupyter_client picks free ports, closes them and hands them to the kernel, and another process can
    take one in between."""
    started = any(c.cell_type == "code" and c.get("execution_count") for c in nb.cells)
    return result.err is not None and not started and "Kernel died before replying to kernel_info" in str(result.err)


def kernel_choice(nb):
    """{} to run the kernel the chapter names (`dp-course`, which `make setup` registers), or
    {"kernel_name": "python3"} when no kernel of that name is registered: the Python kernel of the
    environment running the build (jupyter_client starts a spec's `python` as this interpreter). So a
    plain `jupyter-book build book` works in any environment with requirements.txt installed. Only the
    kernel to start changes: the notebook's own metadata, part of its cache key, stays as it is."""
    from jupyter_client.kernelspec import KernelSpecManager

    declared = nb.metadata.get("kernelspec", {}).get("name")
    if not declared or declared in KernelSpecManager().find_kernel_specs():
        return {}
    return {"kernel_name": "python3"}


def slowest_cells(nb, n=5):
    """[[cell index, seconds], ...]: the `n` slowest cells, from the timestamps nbclient records."""
    times = []
    for i, cell in enumerate(nb.cells):
        stamps = cell.get("metadata", {}).get("execution", {})
        begin, end = stamps.get("iopub.status.busy"), stamps.get("shell.execute_reply")
        if begin and end:
            seconds = (
                datetime.fromisoformat(end.replace("Z", "+00:00"))
                - datetime.fromisoformat(begin.replace("Z", "+00:00"))
            ).total_seconds()
            times.append([i, round(seconds, 1)])
    return sorted(times, key=lambda t: -t[1])[:n]


def main(argv):
    if len(argv) != 3:
        raise SystemExit(f"usage: python -m lessonlib.book._execute_notebook NOTEBOOK OUT TIMEOUT (got {argv})")
    # If the build that started this process dies, even by SIGKILL, this one gets SIGTERM, on which
    # nbclient shuts the kernel down (and the kernel's launches end with it: lessonlib.processes.lifeline).
    die_with_parent(signal.SIGTERM)
    if launchrecord.record_file():  # the kernel inherits this environment, so its launches name the chapter
        os.environ[launchrecord.CHAPTER_VAR] = Path(argv[0]).name
    report = execute(argv[0], argv[1], int(argv[2]))
    launchrecord.record_chapter("seconds" in report)
    print(json.dumps(report), flush=True)
    sys.stderr.flush()
    # Not sys.exit: after a kernel that died at its start, nbclient's atexit cleanup fails ("assert
    # self.km is not None") and would print after the report, which must be the last line. Every kernel
    # this process started has been shut down by now, and the build kills what might remain.
    os._exit(0 if "seconds" in report else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
