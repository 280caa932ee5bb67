"""The entry point of every rank that `lessonlib.launch` starts (chapter 1).

`launch` runs `python -m torch.distributed.run ... -m lessonlib.launcher._rank_main SCRIPT ARGS...`, so each
worker starts here and then runs SCRIPT exactly as `python SCRIPT ARGS...` would. Before that it:

- points the rank's file descriptors 1 and 2 at files of its own, so the launcher can show each rank
  apart (C++ warnings from torch and gloo land there too, since this works below Python);
- makes SIGUSR1 print every thread's Python stack (faulthandler), so a hung rank can say where it
  hangs before the launcher kills it; SIGTERM (torchrun stopping the other ranks after one failed)
  prints the stack too and then terminates as usual, while the script runs (once it has ended, the
  rank is only on its way out: a SIGTERM then just terminates it, though not before the exit record
  below is written); a hard crash (segfault, abort) prints its stack as well;
- records how the rank ended (exit code, exception, traceback, time, its open-file limit) in a small
  JSON file, which is how `LaunchError` can name the first rank that failed rather than the last one to
  notice. One file descriptor is held back from the start and given back just before that record is
  written, so a script that failed with "Too many open files" still leaves it.

The files it writes, and the variables it reads, are the run folder's (lessonlib.launcher.runfolder).

It also dies if the torchrun agent dies (`lessonlib.processes.lifeline`). The traceback printed for an uncaught
exception leaves out this module's frames: it reads exactly as it would under bare torchrun.
"""

import faulthandler
import os
import resource
import runpy
import signal
import sys
import time
import traceback

from lessonlib.launcher import runfolder
from lessonlib.processes.lifeline import die_with_parent


def _redirect_std_streams(run_dir, rank):
    for fd, stream in zip((1, 2), runfolder.STREAMS):
        target = os.open(runfolder.output_file(run_dir, rank, stream), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _script_traceback(exc, script):
    """The traceback of `exc` starting at the script's first frame (runpy's and ours dropped)."""
    tb = exc.__traceback__
    script = os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


class _DeferredSigterm:
    """SIGTERM held back while the rank writes how it ended. A rank whose collective failed because a peer
    died (gloo's "Connection closed by peer") is often still writing its own traceback when torchrun's
    SIGTERM comes: terminated there, it would leave neither its error nor where it was. The signal is
    noted instead (a Python handler, so whichever thread the kernel hands it to), and sent again once the
    record is written: the rank then ends by SIGTERM as it would have, its exit record already there."""

    def __init__(self):
        self.came = False

    def hold(self):
        signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame):
        self.came = True

    def release(self):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.came:
            os.kill(os.getpid(), signal.SIGTERM)


_SIGTERM = _DeferredSigterm()


def _write_exit(run_dir, rank, record, spare):
    """The exit record, with the rank's open-file limit, after giving back the file descriptor held for it;
    then a SIGTERM held back meanwhile ends the rank."""
    os.close(spare)
    record.update(end=time.time(), nofile=list(resource.getrlimit(resource.RLIMIT_NOFILE)))
    runfolder.write_exit(run_dir, rank, record)
    _SIGTERM.release()


def _run_script(script):
    """Run the script as `python SCRIPT` would. However it ends, a SIGTERM from then on (torchrun stopping
    the ranks after another failed) finds the rank on its way out, not where the script was: it prints no
    stack, waits until the exit record is written (_DeferredSigterm), then terminates the rank. A hang
    after that (atexit functions, the interpreter's teardown) still prints a stack when the launcher asks
    (SIGUSR1)."""
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        faulthandler.unregister(signal.SIGTERM)  # restores SIG_DFL; held back from the next instruction on
        _SIGTERM.hold()


def main():
    # If the torchrun agent dies without stopping this rank, the rank must not live on alone.
    die_with_parent(signal.SIGKILL)
    run_dir = os.environ[runfolder.RUN_DIR_VAR]
    rank = int(os.environ.get("RANK", "0"))
    _redirect_std_streams(run_dir, rank)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Dumped from C at once, even while blocked in a collective; chain=True then dies as SIGTERM would.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    # The deprecated torch.distributed.launch inserts --local-rank=N before the program's arguments,
    # which here means before SCRIPT; the script must see it first among its own arguments.
    legacy = [a for a in sys.argv[1:2] if a.startswith(("--local-rank=", "--local_rank="))]
    rest = sys.argv[1 + len(legacy) :]
    script = rest[0]
    sys.argv = [script, *legacy, *rest[1:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would set it
    started = time.time()
    runfolder.write_start(run_dir, rank, {"rank": rank, "pid": os.getpid(), "time": started})
    spare = os.open(os.devnull, os.O_RDONLY)  # given back for the exit record (EMFILE)
    if os.environ.get(runfolder.CHECK_DIR_VAR):  # `python -m lessonlib check`: its probe, before the script
        from lessonlib.check import probe

        probe.install(os.environ[runfolder.CHECK_DIR_VAR], rank, float(os.environ[runfolder.CHECK_STALL_VAR]))

    record = {"rank": rank, "pid": os.getpid(), "start": started}
    try:
        _run_script(script)
        record["exitcode"] = 0
    except SystemExit as e:
        code = e.code
        record["exitcode"] = 0 if code is None else code if isinstance(code, int) else 1
        if record["exitcode"] != 0:
            record.update(exc_type="SystemExit", message=str(code), traceback="")
        _write_exit(run_dir, rank, record, spare)
        raise  # Python prints a string code and exits with it, as usual
    except BaseException as e:  # noqa: BLE001 - every way out of the script is recorded
        text = _script_traceback(e, script)
        sys.stderr.write(text)
        record.update(exitcode=1, exc_type=type(e).__name__, message=str(e), traceback=text)
    sys.stdout.flush()
    sys.stderr.flush()
    _write_exit(run_dir, rank, record, spare)
    sys.exit(record["exitcode"])


if __name__ == "__main__":
    main()
