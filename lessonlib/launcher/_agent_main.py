"""The torchrun agent as `lessonlib.launch` starts it: torch.distributed.run (or the deprecated
torch.distributed.launch, with --legacy), but one that ends the run when the launcher dies (chapter 1).

If the launcher (a notebook kernel) is killed, nobody is left to run its cleanup. torchrun's own
shutdown is not enough: it asks its ranks to stop (SIGTERM) and waits up to 30 s for one that
ignores it, and it knows nothing of a process a rank started in a session of its own, nor of the run
folder. So a thread of this agent watches the launcher, and when it is gone does what the launcher
would have done: kill every process that carries the run's marker, remove the run folder, and exit.
For an agent forked from the launcher's agent server (lessonlib.launcher.fastpath.agentserver), the process
it watches is that server, which exits when the launcher does.

Before torchrun runs, the agent makes its changes inside torch (lessonlib.launcher.torchpatches, each
guarded): the rendezvous names its events without `inspect.stack()`; a one-machine run's TCPStore
servers listen on 127.0.0.1 alone; torchrun's failure report names the lesson's script, not the rank
wrapper; and, where ranks are forked (lessonlib.launcher.fastpath.forkrank), torchrun forks each rank
from this agent.
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

from lessonlib.launcher import torchpatches
from lessonlib.launcher.fastpath import forkrank
from lessonlib.launcher.runfolder import LAUNCHER_PID_VAR, RUN_DIR_VAR, STORES_ON_VAR
from lessonlib.launcher.watch import run_processes
from lessonlib.processes.marks import marks_of

WATCH_INTERVAL = 0.2  # seconds between two looks at the launcher


def end_run_when_launcher_dies(launcher_pid):
    while os.getppid() == launcher_pid:
        time.sleep(WATCH_INTERVAL)
    run_id = marks_of(os.environ)[-1]  # the launch gives its run's mark last
    for proc in run_processes(run_id):  # every process of the run but this one
        with contextlib.suppress(psutil.Error):
            proc.kill()
    # No waiting for them to go (killed ranks stay zombies until torchrun reaps them): torchrun's own
    # thread, seeing its ranks die, writes into its log folder inside the run folder, so remove the
    # folder and exit at once, before it can write again.
    shutil.rmtree(os.environ[RUN_DIR_VAR], ignore_errors=True)
    os._exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    # No death signal for the agent itself (lessonlib.processes.lifeline): torchrun would handle it and exit
    # before the watch below had cleaned up. The watch also covers a launcher gone before this line.
    launcher = int(os.environ[LAUNCHER_PID_VAR])
    threading.Thread(target=end_run_when_launcher_dies, args=(launcher,), daemon=True).start()
    module = "torch.distributed.run"
    if sys.argv[1:2] == ["--legacy"]:
        module = "torch.distributed.launch"
        del sys.argv[1]
    torchpatches.quicken_rendezvous()
    torchpatches.name_the_script(forkrank.RANK_MODULE)  # its failure report names lessons/X.py
    if os.environ.get(STORES_ON_VAR):  # a one-machine launch: the stores on 127.0.0.1 alone (chapter 16)
        torchpatches.bind_store_servers(os.environ[STORES_ON_VAR])
    if forkrank.wanted():  # ranks forked from this agent, torch already imported
        forkrank.install()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
