"""Marks: how every process that a launch or a bounded command started is found again, wherever it went.

torchrun puts its workers in sessions of their own, a rank's children (DataLoader workers) may outlive
their parent and be reparented to init, and a command on a `lessonlib.Hosts` host runs in another
namespace: neither a process tree nor a session finds them all. So whoever starts such a group of
processes puts a mark, a fresh id, into the environment it gives them. Every process started from there
inherits it, and /proc/PID/environ shows it (the environment a process was started with, whatever it
set since), so a scan of every process finds the group, and only it.

One variable holds the marks, MARKS_VAR, a colon-separated list, so that groups nest: a bounded command
that launches a lesson gives the lesson's ranks both its mark and the run's, and killing either group
reaches them. A launch's run id is its mark (lessonlib.launcher.core); so is each run_bounded command's
(lessonlib.processes.bounded). PLACEHOLDER is a mark of a real one's length that no process is found by:
the agent server starts with it and each agent it forks writes its run's id over it, in place
(lessonlib.launcher.fastpath.agentserver).
"""

import os
import uuid

import psutil

MARKS_VAR = "LESSONLIB_MARKS"  # "MARK:MARK:...": one mark per group a process belongs to, outermost first
MARK_LENGTH = 32  # uuid4().hex
PLACEHOLDER = "-" * MARK_LENGTH  # a slot for a mark, written over in place (the agent server's)


def new_mark():
    """A fresh mark: no process carries it yet."""
    return uuid.uuid4().hex


def marks_of(environ):
    """The marks an environment carries, outermost first (the placeholder is not one)."""
    return [m for m in environ.get(MARKS_VAR, "").split(":") if m and m != PLACEHOLDER]


def add_mark(env, mark):
    """A copy of `env` whose processes also carry `mark`, after the marks it already has."""
    return {**env, MARKS_VAR: ":".join(filter(None, [env.get(MARKS_VAR), mark]))}


def marked_processes(mark, var=MARKS_VAR):
    """Every live process (not this one) whose environment has `var` (by default the marks) set to `mark`,
    or to a colon-separated list that holds it."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() != psutil.STATUS_ZOMBIE and mark in p.environ().get(var, "").split(":"):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return found


def kill_all(procs):
    """SIGKILL each of `procs` (psutil.Process objects) and wait for them to go, at most 5 s."""
    for p in procs:
        try:
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(procs, timeout=5)


def kill_marked(mark):
    """Kill every process that carries `mark`."""
    kill_all(marked_processes(mark))
