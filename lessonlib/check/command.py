"""`python -m lessonlib check [options] -- SCRIPT [ARGS]`: run a reader's DDP script with the course's checks.

The script runs as torchrun would run it (`lessonlib.launch`: 2 ranks by default, on CPU with gloo unless
the script picks a GPU and NCCL itself), unchanged, bounded by --timeout; every rank loads the probe
(lessonlib.check.probe) first. After the run, the findings (lessonlib.check.findings), one line each:

    lessons/broken.py:61: error: replicas differ after optimizer step 1: ... [chapter 12, “...”]

errors first, then warnings, then one line saying what the run was (ranks, backend, devices, batch, lr).
Exit status: 0 when the run succeeded and nothing is an error (warnings may remain), 1 when a finding is
an error or the script failed, 124 on timeout, 130 on Ctrl-C, 2 for bad input, before anything starts.
Nothing of the run outlives it: the launcher's bounds, and the check's own folder is removed (or swept by
the next check when this one was killed).
"""

import os
import shutil
import sys
import tempfile

from ..launcher import runfolder
from ..processes import owners
from .findings import ERROR, INFO, WARNING, findings, needs_gpu, read_records
from .probe import STALL_EXIT

PREFIX = "lessonlib-check-"
DEFAULT_TIMEOUT = 300.0
DEFAULT_STALL = 30.0
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_INTERRUPTED = 0, 1, 2, 124, 130


def default_nproc():
    """The machine's GPUs when it has two or more (one rank each, NCCL), else 2 ranks."""
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    return gpus if gpus >= 2 else 2


def check(script, args=(), nproc=None, timeout=DEFAULT_TIMEOUT, stall=DEFAULT_STALL, quiet=False, out=None, err=None):
    """Run `script` with the checks; print the run (unless quiet) and the findings; return (exit status,
    findings, the launch's RunResult)."""
    from ..launcher.core import launch
    from ..launcher.faults import EnvironmentFault
    from ..view.live import TextLiveView

    out, err = out or sys.stdout, err or sys.stderr
    nproc = nproc or default_nproc()
    owners.sweep(tempfile.gettempdir(), PREFIX)
    folder = tempfile.mkdtemp(prefix=owners.owned_prefix(PREFIX))
    try:
        env = {runfolder.CHECK_DIR_VAR: folder, runfolder.CHECK_STALL_VAR: str(stall)}
        view = "none" if quiet else TextLiveView(str(script), list(args), nproc, 1)
        try:
            result = launch(script, nproc=nproc, args=list(args), timeout=timeout, env=env, show=view, cwd=os.getcwd())
        except EnvironmentFault as e:
            err.write(f"lessonlib check: {e}\n")
            return EXIT_FAILED, [], None
        found = findings(read_records(folder, result.world_size), result)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out.flush()
    status = report(found, result, stall, out)
    return status, found, result


def report(found, result, stall, out):
    """Print the findings and the run's end; return the exit status."""
    from ..view.story import failure_line

    gpu = None if result.ok else needs_gpu(result)
    lines = []
    if gpu is not None:
        rank, said = gpu
        lines.append(
            f"lessonlib check: this script needs a GPU that this machine does not have (rank {rank.rank}: "
            f"“{said}”); give it a CPU path (gloo) to check it here"
        )
    elif not result.ok:
        stalled = any(r.exitcode == STALL_EXIT for r in result.ranks)
        if stalled:
            lines.append(
                f"lessonlib check: a collective waited more than {stall:g} s (--stall), so the run was stopped"
            )
        else:
            lines.append(f"lessonlib check: the script failed: {failure_line(result)}")
    errors = [f for f in found if f.severity == ERROR]
    warnings = [f for f in found if f.severity == WARNING]
    info = [f for f in found if f.severity == INFO]
    for f in errors + warnings + info:
        lines.append(f.line())
    verdict = (
        f"lessonlib check: {len(errors)} error(s), {len(warnings)} warning(s)"
        if errors or warnings
        else "lessonlib check: no findings"
    )
    lines.append(verdict)
    out.write("\n".join(lines) + "\n")
    out.flush()
    if result.timed_out:
        return EXIT_TIMEOUT
    if errors or not result.ok:
        return EXIT_FAILED
    return EXIT_OK
