"""The torchrun agent as `lessonlib.launch` starts it: torch.distributed.run (or the deprecated
torch.distributed.launch, with --legacy), but one that ends the run when the launcher dies (chapter 1).

If the launcher (a notebook kernel) is killed, nobody is left to run its cleanup. torchrun's own
shutdown is not enough: it asks its ranks to stop (SIGTERM) and waits up to 30 s for one that
ignores it, and it knows nothing of a process a rank started in a session of its own, nor of the run
folder. So a thread of this agent watches the launcher, and when it is gone does what the launcher
would have done: kill every process that carries the run's marker, remove the run folder, and exit.
For an agent forked from the launcher's agent server (lessonlib.launcher._agentserver), the process it watches
is that server, which exits when the launcher does.

One speed fix, with no change in what torchrun does: its rendezvous names the method that records
each of its events with `inspect.stack()`, which looks up the source file and module of every frame
on the stack, walking all of sys.modules for each (a few thousand modules once torch is imported).
That took some 2.5 of the 2.7 CPU-seconds a launch of a script that does nothing cost the agent. The
agent swaps in its own `get_method_name`, which reads the same name from the frame itself.
"""

import contextlib
import os
import runpy
import shutil
import signal
import sys
import threading
import time

import psutil

from lessonlib.launcher import _forkrank, _loopback
from lessonlib.launcher._runfolder import LAUNCHER_PID_VAR, RUN_DIR_VAR, RUN_ID_VAR
from lessonlib.launcher.processes import run_processes

WATCH_INTERVAL = 0.2  # seconds between two looks at the launcher


def get_method_name(depth=2):
    """torch's dynamic_rendezvous.get_method_name: the function `depth` frames up from this one (its
    caller's caller by default), or "no_method_name" when the stack is not that deep; without
    inspect.stack(), which also reads each frame's source file and searches sys.modules for its module."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def quicken_rendezvous():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = get_method_name


def end_run_when_launcher_dies(launcher_pid):
    while os.getppid() == launcher_pid:
        time.sleep(WATCH_INTERVAL)
    for proc in run_processes(os.environ[RUN_ID_VAR]):  # every process of the run but this one
        with contextlib.suppress(psutil.Error):
            proc.kill()
    # No waiting for them to go (killed ranks stay zombies until torchrun reaps them): torchrun's own
    # thread, seeing its ranks die, writes into its log folder inside the run folder, so remove the
    # folder and exit at once, before it can write again.
    shutil.rmtree(os.environ[RUN_DIR_VAR], ignore_errors=True)
    os._exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    # No death signal for the agent itself (lessonlib.launcher._lifeline): torchrun would handle it and exit
    # before the watch below had cleaned up. The watch also covers a launcher gone before this line.
    launcher = int(os.environ[LAUNCHER_PID_VAR])
    threading.Thread(target=end_run_when_launcher_dies, args=(launcher,), daemon=True).start()
    module = "torch.distributed.run"
    if sys.argv[1:2] == ["--legacy"]:
        module = "torch.distributed.launch"
        del sys.argv[1]
    quicken_rendezvous()
    _loopback.install_if_asked()  # a one-machine launch: the stores on 127.0.0.1 alone (chapter 16)
    if _forkrank.wanted():  # ranks forked from this agent, torch already imported (lessonlib.launcher._forkrank)
        _forkrank.install()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
