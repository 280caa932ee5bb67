"""Starting a launch's torchrun agent: one function, `start_agent`, whatever path it takes (chapter 1).

The reference path is a fresh process: `python -m lessonlib.launcher._agent_main ...` in a session of its
own, its output to the agent's log, psutil.Popen. Everything a launch needs of its agent (pid, poll, wait,
kill, returncode) is what that Popen has.

The fast path is an optimisation behind it, with the same result: where it applies (Linux, no NVIDIA
devices, no `env=` that torch could read as it is imported), the agent is forked from this process's
agent server, which has imported torch once for every launch (lessonlib.launcher.fastpath.agentserver),
and the agent then forks each rank (lessonlib.launcher.fastpath.forkrank). `LESSONLIB_FRESH_RANKS=1` in
the environment, or a server that does not answer, gives the reference path. The tests run the same
checks through both (tests/test_forkrank.py, tests/test_agentserver.py).
"""

import subprocess

import psutil

from .fastpath import agentserver

# Variables a launch's env= may set and still take the fast path: read when a process group is made,
# never as torch is imported (chapter 16's interface choices).
READ_AFTER_IMPORT = agentserver.READ_AFTER_IMPORT


def start_agent(cmd, env, cwd, log, *, own_env=False, prefix=()):
    """Start the torchrun agent `cmd` with environment `env` in `cwd`, its stdout and stderr on the file
    `log`; return a Popen-like object. `prefix`: the command that puts it on a lessonlib.Hosts host (the
    start of `cmd`). `own_env`: the launch passed env= with variables torch may read as it is imported,
    which only a fresh process reads as torch's own start would."""
    agent = agentserver.fork_agent(cmd, env, cwd, log, own_env=own_env, prefix=prefix)
    if agent is None:
        agent = psutil.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    return agent


def forget_hosts(prefixes):
    """End what start_agent keeps running on the hosts these command prefixes reach (their agent servers):
    lessonlib.Hosts calls it as it closes."""
    agentserver.close_servers(prefixes)
