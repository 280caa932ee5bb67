"""Who made what lessonlib leaves outside the repository, and sweeping what a dead owner left.

A launch's run folder and the book build's scratch folder (in the temporary folder), and a
`lessonlib.Hosts` network (namespaces, /etc/netns folders, what its keeper was told to keep) are removed
by their owner when it ends, or by a helper that outlives it (a run's torchrun agent, the hosts' keeper).
A process killed together with its helper (SIGKILL to a whole session, the out-of-memory killer, a
machine that loses power) leaves them. So each carries its owner: the process id and the process's start
time (field 22 of /proc/PID/stat, clock ticks after boot), so that a pid the kernel gave to another
process since is not mistaken for the owner. A folder carries them in its name,
`lessonlib-run-4242-1234567-...`; a network, whose names stay short (a link's name is at most 15
characters, IFNAMSIZ), in a registry file of its own (lessonlib.cluster.hosts).

The next start of the same kind (the next launch, the next book build, the next Hosts) sweeps what
belongs to owners that are gone: `sweep(folder, prefix)`. A live owner's things are never touched,
and a name that carries no owner (made by an older lessonlib, or by something else) is left alone.
Standard library only.
"""

import contextlib
import os
import re
import shutil


def start_time(pid):
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat), or None when no such process
    runs (a zombie has ended: it only waits for its parent to read its exit status)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces and parentheses: the fields start after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # field 3, the state: a zombie, or dead
        return None
    return int(fields[19])  # field 22


def tag(pid=None):
    """'PID-START' of process `pid` (default: this one), or None without /proc (not Linux)."""
    pid = os.getpid() if pid is None else pid
    start = start_time(pid)
    return None if start is None else f"{pid}-{start}"


def alive(pid, start):
    """True while the process `pid` that started at `start` (clock ticks after boot) runs."""
    return start_time(int(pid)) == int(start)


def owned_prefix(prefix):
    """The start of the name of something this process makes: `prefix`, then this process's tag and '-'
    (`prefix` alone without /proc: then nothing sweeps it)."""
    mine = tag()
    return f"{prefix}{mine}-" if mine else prefix


def owner_in(name, prefix):
    """(pid, start) of the owner that the name `name` carries after `prefix`, or None."""
    m = re.match(rf"{re.escape(prefix)}(\d+)-(\d+)-", name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def sweep(folder, prefix):
    """Remove what a dead owner left in `folder`: every entry named `prefix`PID-START-... whose owner no
    longer runs. Returns the paths removed; a folder that cannot be read, or an entry that cannot be
    removed, is left as it is. (After a reboot, a pid and start time of the earlier boot could name a
    process of this one by chance: then the entry stays, the safe side of the mistake.)"""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for name in names:
        owner = owner_in(name, prefix)
        if owner is None or alive(*owner):
            continue
        path = os.path.join(folder, name)
        remove_path(path)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def remove_path(path):
    """Remove a file, a link or a folder with everything in it; what cannot be removed stays."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)
