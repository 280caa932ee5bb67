"""torchrun agents forked from one server per launching process, which has imported torch once.

Every `lessonlib.launch` starts a torchrun agent, `python -m lessonlib.launcher._agent_main ...`, which imports
torch and torch._dynamo and then forks the ranks from itself
(lessonlib.launcher.fastpath.forkrank).
A chapter launches a dozen times or more, each paying for those imports again. So at its first launch
the launching process (a notebook kernel, a test worker, the terminal runner) starts this server, which
imports them once, and every launch forks its agent from it. The child becomes what the fresh agent
would have been, by the same `forkrank.become` that makes a forked rank what a fresh rank would be: a
session of its own, the launch's environment and working folder, its log file on stdout and stderr,
signal handlers and interpreter state as a fresh start leaves them, then `lessonlib.launcher._agent_main` run as
`python -m` runs it. From there on it is the agent a fresh process would be.

Which launches take this path: those whose ranks would be forked (forkrank.wanted), with no `env=` of
their own, and whose environment equals the server's but for the run's own variables (PER_RUN, and the
run's mark, which only code running later reads). torch reads some variables once, as it is imported,
and the server imported it under its environment. A launch whose environment differs (`os.environ`
changed since) replaces an idle server, or starts a fresh agent while the server has a run going.

The run's mark. The launcher finds every process of a run by its mark in /proc/PID/environ
(lessonlib.processes.marks), which shows the environment a process was started with, not what it set
since. The server starts with a placeholder mark of the same length as a run's (marks.PLACEHOLDER, last
in its MARKS_VAR), and each agent writes its run's mark over it, in place, in its own copy of that
memory (ctypes.memmove into the block /proc/PID/environ reads): /proc/PID/environ then names the run,
for the agent and for every rank it forks.

Lifetime. The server exits when the launching process closes its end of the socket or dies (its parent
changes); an agent watches the server as its launcher (lessonlib.launcher._agent_main), so when the kernel is
killed, the server goes, and every run still going is ended by its own agent.

Protocol, over a SOCK_SEQPACKET socket pair: the launcher sends a request (JSON: the agent's arguments,
environment and working folder) with two file descriptors, the agent's log file and one end of a new
socket pair for this agent; the server forks the agent and sends its pid on that pair, then, when it has
reaped it, its wait status, and closes it.
"""

import atexit
import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

from lessonlib.launcher.fastpath import forkrank
from lessonlib.launcher.runfolder import BACKEND_VAR, INTERFACE_VARS, LAUNCHER_PID_VAR, RUN_DIR_VAR, STORES_ON_VAR
from lessonlib.paths import ROOT
from lessonlib.processes.marks import MARK_LENGTH, MARKS_VAR, PLACEHOLDER

AGENT_MODULE = "lessonlib.launcher._agent_main"
SERVER_MODULE = "lessonlib.launcher.fastpath.agentserver"
# Variables a launch sets for its own run, read only by code that runs after the imports (the agent's
# rendezvous, the ranks): launches that differ only in these (and in the run's mark) share a server.
PER_RUN = (RUN_DIR_VAR, LAUNCHER_PID_VAR, BACKEND_VAR, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
# Set by a test runner and changed at every test (pytest names the test running in it); nothing that torch
# imports reads it. Every launch still gets the value it had, as it gets every variable.
NOT_READ_AT_IMPORT = ("PYTEST_CURRENT_TEST",)
# Read when a process group is made, never as torch is imported: a launch's env= that sets only these
# (chapter 16's interface choices) can still fork its agent from a server.
READ_AFTER_IMPORT = (*INTERFACE_VARS, STORES_ON_VAR)
READY_TIMEOUT = 120  # seconds for the server to answer a request (its first: after importing torch)
WATCH_INTERVAL = 0.2  # seconds between two looks at the launching process


# --------------------------------------------------------------------------- the launching process's side


class Unavailable(Exception):
    """The server did not start the agent: start a fresh one."""


class ForkedAgent:
    """What the launcher uses of an agent's Popen (pid, poll, wait, kill, returncode), for an agent
    forked from the server. Its exit status arrives on the agent's socket; psutil.wait_procs accepts it."""

    def __init__(self, pid, channel, args):
        self.pid, self.args, self.returncode = pid, args, None
        self._channel, self._orphan = channel, False

    def _receive(self, timeout):
        if self.returncode is not None:
            return
        if self._orphan:  # the server died before reaping it: the agent ends its run itself (_agent_main)
            if not _alive(self.pid):
                self.returncode = -signal.SIGKILL
            elif timeout is None or timeout > 0:
                time.sleep(0.05 if timeout is None else min(timeout, 0.05))
            return
        if not select.select([self._channel], [], [], timeout)[0]:
            return
        try:
            data = self._channel.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data.startswith(b"exit "):
            self.returncode = os.waitstatus_to_exitcode(int(data[5:]))
            self._channel.close()
        else:
            self._orphan = True
            self._channel.close()

    def poll(self):
        self._receive(0)
        return self.returncode

    def wait(self, timeout=None):
        import psutil

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise psutil.TimeoutExpired(timeout, self.pid)
            self._receive(left)
        return self.returncode

    def is_running(self):
        return self.poll() is None

    def kill(self):
        if self.poll() is None:  # not reaped yet, so its pid is still its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def __repr__(self):
        return f"ForkedAgent(pid={self.pid}, returncode={self.returncode})"


def _ignored_signals():
    return [s for s in signal.valid_signals() if signal.getsignal(s) == signal.SIG_IGN]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class _Server:
    def __init__(self, base, prefix=()):
        self.base, self.agents = base, []
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", SERVER_MODULE, str(theirs.fileno())],
                env=_with_placeholder(base[0]),
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # a kernel would show it in a cell; a failure reads as no answer
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a Ctrl-C in the terminal is the launcher's to handle
            )

    def idle(self):
        # Read only what each agent's own launch has read: two threads must not read one socket.
        self.agents = [a for a in self.agents if a.returncode is None]
        return not self.agents

    def start(self, cmd, env, cwd, log, skip=0):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = {"args": cmd[skip + 3 :], "env": {**env, LAUNCHER_PID_VAR: str(self.proc.pid)}, "cwd": str(cwd)}
        try:
            with theirs:
                socket.send_fds(self.socket, [json.dumps(request).encode()], [log.fileno(), theirs.fileno()])
            ready = select.select([mine], [], [], READY_TIMEOUT)[0]
            pid = mine.recv(64) if ready else b""
        except OSError as e:
            mine.close()
            raise Unavailable(str(e)) from None
        if not pid.isdigit():
            mine.close()
            raise Unavailable("no answer" if ready else f"no answer in {READY_TIMEOUT} s")
        agent = ForkedAgent(int(pid), mine, cmd)
        self.agents.append(agent)
        return agent

    def close(self):
        """The server exits when its end of the socket closes; reap it (it is this process's child)."""
        self.socket.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_lock = threading.Lock()
_servers = {}  # one per host: () for this machine's own network, else the host's command prefix (chapter 16)
_broken = False  # this machine's server failed to answer: fresh agents from now on
_exit_hook = False  # atexit has been told to end this process's servers


def fork_agent(cmd, env, cwd, log, own_env, prefix=()):
    """The torchrun agent `cmd` (python -m lessonlib.launcher._agent_main ..., after `prefix`, the command that
    puts it on a lessonlib.Hosts host) forked from this process's server for that host, or None: start it
    fresh (lessonlib.launcher.agents.start_agent). `own_env`: the launch passed env= with variables torch
    may read as it is imported (then fresh)."""
    global _broken, _exit_hook
    prefix = list(prefix)
    skip = len(prefix)
    if (
        own_env
        or (_broken and not prefix)
        or not sys.platform.startswith("linux")
        or cmd[:skip] != prefix
        or cmd[skip : skip + 3] != [sys.executable, "-m", AGENT_MODULE]
        or not forkrank.wanted(env)
        or len(env.get(MARKS_VAR, "").rsplit(":", 1)[-1]) != MARK_LENGTH
    ):
        return None
    # The environment (the run's own mark left out), and the signals ignored here (an ignored signal stays
    # ignored across exec and fork).
    ignored = PER_RUN + NOT_READ_AT_IMPORT + READ_AFTER_IMPORT
    base = ({k: v for k, v in _without_run_mark(env).items() if k not in ignored}, _ignored_signals())
    key = tuple(prefix)
    with _lock:
        server = _servers.get(key)
        if server is not None and server.base != base and server.idle():
            server.close()
            del _servers[key]
            server = None
        if server is None:
            if not _exit_hook:
                atexit.register(_close)  # this process's exit ends the servers, and reaps them
                _exit_hook = True
            server = _servers[key] = _Server(base, prefix)
        if server.base != base:
            return None
        try:
            return server.start(cmd, env, cwd, log, skip)
        except Unavailable as e:
            if not prefix:  # a host's server goes with its host; this machine's should not fail
                _broken = True
                warnings.warn(
                    f"lessonlib: the agent server did not answer ({e}); fresh torchrun agents from now on",
                    stacklevel=3,
                )
            server.close()
            _servers.pop(key, None)
            return None


def _without_run_mark(env):
    """`env` without its last mark (the run's), which each agent writes into the server's placeholder."""
    outer = env.get(MARKS_VAR, "").rsplit(":", 1)[:-1]
    env = {k: v for k, v in env.items() if k != MARKS_VAR}
    return {**env, MARKS_VAR: outer[0]} if outer else env


def _with_placeholder(base):
    """The server's environment: the launches' own, and a placeholder where each agent writes its run's mark."""
    return {**base, MARKS_VAR: ":".join(filter(None, [base.get(MARKS_VAR), PLACEHOLDER]))}


def close_servers(prefixes):
    """End the servers of the hosts that these command prefixes start commands on (lessonlib.Hosts.close)."""
    with _lock:
        for key in [tuple(p) for p in prefixes]:
            if key in _servers:
                _servers.pop(key).close()


def _close():
    with _lock:
        while _servers:
            _servers.popitem()[1].close()


# --------------------------------------------------------------------------- the server's side


def _find_slot():
    """The address of the placeholder mark, the last of "MARKS_VAR=...", in the memory /proc/self/environ
    reads, or None."""
    if not sys.platform.startswith("linux"):
        return None
    entry = f"{MARKS_VAR}={os.environ.get(MARKS_VAR, '')}".encode()
    if not entry.endswith(PLACEHOLDER.encode()):
        return None
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start and env_end (proc(5), fields 50 and 51)
    i = 0
    while environ[i]:
        address = environ[i]
        if start <= address < end and ctypes.string_at(address) == entry:
            return address + len(entry) - MARK_LENGTH
        i += 1
    return None


def _serve(fd):
    slot = _find_slot()  # before anything can change the environment
    control = socket.socket(fileno=fd)
    launcher = os.getppid()
    if slot is None:
        sys.exit(3)  # no placeholder to mark agents with: the launcher falls back to fresh agents
    # What torch.distributed.run imports, but not that module itself: the agent runs it as __main__, and
    # runpy warns when the module it runs was imported already.
    import torch  # noqa: F401
    import torch.distributed.argparse_util  # noqa: F401
    import torch.distributed.elastic.multiprocessing.subprocess_handler  # noqa: F401
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401

    forkrank.import_dynamo()

    saved = forkrank.snapshot()
    gc.freeze()  # an agent's collections never touch (and so copy) the pages of these objects
    wake_r, wake_w = os.pipe()
    for end in (wake_r, wake_w):
        os.set_blocking(end, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    agents = {}  # pid -> the socket its status goes to
    while os.getppid() == launcher:
        ready = select.select([control, wake_r], [], [], WATCH_INTERVAL)[0]
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(agents)
        if control not in ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
        except OSError:
            break
        if not message:
            break  # the launching process closed its end, or is gone
        log, channel = fds
        channel = socket.socket(fileno=channel)
        pid = os.fork()
        if pid == 0:
            _become_agent(json.loads(message), log, slot, saved, [control, channel, *agents.values()], wake_r, wake_w)
        os.close(log)
        with contextlib.suppress(OSError):
            channel.send(str(pid).encode())
        agents[pid] = channel
    os._exit(0)


def _reap(agents):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        channel = agents.pop(pid, None)
        if channel is not None:
            with contextlib.suppress(OSError):
                channel.send(f"exit {status}".encode())
            channel.close()


def _become_agent(request, log, slot, saved, sockets, *fds):
    """In the forked child: the run's mark, the server's sockets and pipes closed, then the agent."""
    try:
        env = request["env"]
        mark = env[MARKS_VAR].rsplit(":", 1)[-1].encode()
        ctypes.memmove(slot, mark, MARK_LENGTH)
        for s in sockets:
            s.close()
        for fd in fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd in (1, 2):
            os.dup2(log, fd)
        os.close(log)
    except BaseException:  # noqa: BLE001 - never return into the server's loop
        os._exit(1)
    forkrank.become(AGENT_MODULE, request["args"], env, [None, None], saved, cwd=request["cwd"])


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
