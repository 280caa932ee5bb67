"""The keeper of a `lessonlib.Hosts` network (chapter 16): removes it when its owner is done or gone.

`Hosts` starts this file as a process of its own session (`python lessonlib/cluster/_netkeeper.py`, the
standard library only, so it starts in milliseconds), and before it creates any network namespace or
file it writes the name here, one JSON line each on this process's standard input. When that input
ends, because `Hosts` closed it or because its process died however it died (a notebook kernel
killed, SIGKILL included), this process removes everything it was told of: every process inside
each namespace killed, each namespace deleted (its veth ends and bridge go with it), each file or
folder removed. Then it prints what it removed and exits. SIGTERM and SIGHUP do the same at once;
SIGINT (a Ctrl-C sent to a terminal's whole foreground group) is ignored, so the owner's own cleanup
decides.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

KILL_BOUND = 5.0  # seconds for the processes inside the namespaces to be gone


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def _pids(namespace):
    out = _ip("netns", "pids", namespace)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def remove(namespaces, paths):
    """Kill every process in `namespaces`, delete them, remove `paths`; return what could not be removed."""
    deadline = time.monotonic() + KILL_BOUND
    while True:
        pids = [p for ns in namespaces for p in _pids(ns)]
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    left = []
    for ns in reversed(namespaces):  # hosts first, the switch (made first) last
        if os.path.exists(f"/run/netns/{ns}") and _ip("netns", "delete", ns).returncode != 0:
            left.append(f"netns {ns}")
    for path in reversed(paths):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:  # a file or a link (rmtree refuses both)
            try:
                os.remove(path)
            except OSError:
                pass
        if os.path.lexists(path):
            left.append(path)
    return left


def main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGHUP, _raise_stop)
    namespaces, paths = [], []
    try:
        for line in sys.stdin:
            item = json.loads(line)
            (namespaces if "netns" in item else paths).append(item.get("netns") or item.get("path"))
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        left = remove(namespaces, paths)
        try:  # the owner reads this when it closed the input itself; a dead owner reads nothing
            print(json.dumps({"removed": len(namespaces) + len(paths) - len(left), "left": left}), flush=True)
        except OSError:
            pass


if __name__ == "__main__":
    main()
