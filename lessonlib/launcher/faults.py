"""Faults of the machine a run goes on, each named in one line (chapter 1).

Some runs fail for a reason outside the lesson: the temporary folder is missing, read-only or full, the
ranks run out of file descriptors, the kernel kills a rank for memory. Each reads, rank by rank, as an
obscure failure ("exit code 1 ... no traceback: see its stderr", and an empty stderr, when the disk that
holds the ranks' output filled up), so the launcher names it once, where the failure is told.

Before a launch starts anything (lessonlib.launcher.request, lessonlib.launcher.core):

- `check_tmpdir`: a TMPDIR that does not exist or is not a folder is a `TmpdirMissing` (a
  FileNotFoundError). Python's tempfile would quietly fall back to /tmp, and so would every rank.
- `make_run_folder`: the run folder, made in TMPDIR (else Python's temporary folder), or an
  `EnvironmentFault` in one line naming the folder, the cause (a read-only file system, permission
  denied, less than MIN_FREE free) and what to do.

While a run goes, an `EnvironmentWatch` notes the lowest free space on the run folder's disk (one
statvfs per look) and the out-of-memory kills counted before and after (the cgroup's memory.events, or
memory.oom_control under cgroup v1, else the machine's /proc/vmstat); what it saw is a `Seen`.

After a run that failed, `name_fault` gives RunResult.fault (lessonlib.launcher.result), which the failure
story opens with (`Cause: ...`, lessonlib.view.story), or None:

- the run folder's disk filled up (under FULL_BELOW free at some look), or a rank or torchrun wrote
  "No space left on device";
- "Too many open files" (EMFILE) in what a rank or torchrun wrote: the rank's soft and hard
  RLIMIT_NOFILE (from its exit record, lessonlib.launcher.runfolder; else this process's, which the
  ranks inherit) and how to raise them;
- the first rank to fail was killed by SIGKILL, which the launcher did not send (its own kills, at a
  timeout or an interrupt, leave the rank "hung" or "interrupted", not "failed"): likely the
  out-of-memory killer, with the OOM kills counted during the run and where to look.

Standard library only.
"""

import errno
import os
import re
import resource
import signal
import tempfile
from dataclasses import dataclass

from .status import RunStatus

MIN_FREE = 1 << 20  # bytes the run folder's disk must have free before a launch starts
FULL_BELOW = 64 << 10  # bytes: a disk with less free at some look during the run filled up
ENOSPC_TEXT = re.compile(r"No space left on device|\[Errno 28\]")
EMFILE_TEXT = re.compile(r"Too many open files|\[Errno 24\]")
WHAT_TO_DO = "set TMPDIR to a writable folder with space (e.g. `mkdir -p ~/tmp && export TMPDIR=~/tmp`)"
OOM_COUNTERS = ("memory.events", "memory.oom_control")  # cgroup v2, cgroup v1: each has a line `oom_kill N`
CGROUP_ROOT = "/sys/fs/cgroup"
VMSTAT = "/proc/vmstat"  # the machine's count of OOM kills, `oom_kill N` (Linux 4.13 on)
HOW_TO_CHECK_OOM = "`dmesg | grep -i -e oom -e 'killed process'` or `journalctl -k | grep -i oom` says"


class EnvironmentFault(OSError):
    """This machine cannot run a launch as it is: the message, one line, names the folder, the cause and what
    to do. `errno` is the cause's (EROFS, EACCES, ENOSPC, ENOENT, ...)."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.errno = code


class TmpdirMissing(EnvironmentFault, FileNotFoundError):
    """TMPDIR names a folder that does not exist, or something that is not a folder."""


# --------------------------------------------------------------------------- before a launch


def check_tmpdir(env=None):
    """Raise TmpdirMissing when TMPDIR, in this process's environment or in a launch's `env`, is set to
    something that is not an existing folder."""
    for name, environ in (("TMPDIR", os.environ), ("env['TMPDIR']", env or {})):
        folder = environ.get("TMPDIR")
        if not folder:
            continue
        if not os.path.exists(folder):
            why, do, code = "does not exist", f"create it (`mkdir -p {folder}`) or {WHAT_TO_DO}", errno.ENOENT
        elif not os.path.isdir(folder):
            why, do, code = "is not a folder", WHAT_TO_DO, errno.ENOTDIR
        else:
            continue
        raise TmpdirMissing(
            f"{name} is {folder!r}, which {why}: the run folder, torchrun's logs and every rank's temporary "
            f"files go there; {do}",
            code,
        )


def temporary_folder():
    """Where run folders go: TMPDIR when set (what the ranks use too), else Python's temporary folder."""
    return os.path.abspath(os.environ["TMPDIR"]) if os.environ.get("TMPDIR") else tempfile.gettempdir()


def make_run_folder(prefix):
    """A new folder named `prefix`... in the temporary folder, or an EnvironmentFault saying why not."""
    parent = temporary_folder()
    free = free_bytes(parent)
    if free is not None and free < MIN_FREE:
        raise EnvironmentFault(
            f"the temporary folder {parent} has {size(free)} free, less than the {size(MIN_FREE)} a launch "
            f"needs (each rank's output, torchrun's logs): free space there, or {WHAT_TO_DO}",
            errno.ENOSPC,
        )
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=parent)
    except OSError as e:
        causes = {
            errno.EROFS: "it is on a read-only file system",
            errno.EACCES: "permission denied",
            errno.EPERM: "permission denied",
            errno.ENOSPC: "no space left on the device",
            errno.EDQUOT: "the disk quota is used up",
        }
        why = causes.get(e.errno, e.strerror or str(e))
        name = errno.errorcode.get(e.errno, "")
        raise EnvironmentFault(
            f"cannot make the run folder in {parent}: {why}" + (f" ({name})" if name else "") + f"; {WHAT_TO_DO}",
            e.errno,
        ) from None


def free_bytes(folder):
    """Bytes free for this process on the disk of `folder` (root may use the blocks kept for root), or None."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def total_bytes(folder):
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def size(n):
    """Bytes in a short human form: '0 B', '12.0 KiB', '3.5 MiB', '1.2 GiB'."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # not reached


# --------------------------------------------------------------------------- while a run goes


def oom_kill_counter():
    """(file, count) of the OOM kills counted for this process's cgroup, else for the machine; (None, None)
    where no counter can be read."""
    candidates = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one hierarchy
            candidates += [f"{CGROUP_ROOT}{path}/memory.events", f"{CGROUP_ROOT}/unified{path}/memory.events"]
        elif "memory" in controllers.split(","):  # cgroup v1: the memory controller's own hierarchy
            candidates.append(f"{CGROUP_ROOT}/memory{path}/memory.oom_control")
    # In a container with a cgroup namespace the path above is the host's; the mount's root is its own.
    candidates += [f"{CGROUP_ROOT}/memory.events", f"{CGROUP_ROOT}/memory/memory.oom_control", VMSTAT]
    for path in candidates:
        count = _oom_kill_line(path.replace("//", "/"))
        if count is not None:
            return path.replace("//", "/"), count
    return None, None


def _oom_kill_line(path):
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


@dataclass(frozen=True)
class Seen:
    """What the launcher saw of the machine during a run (EnvironmentWatch.seen)."""

    folder: str  # the run folder
    total: int | None  # bytes of its disk
    lowest_free: int | None  # the fewest bytes free on it at any look during the run
    oom_kills: int | None  # OOM kills counted during the run, None with no counter
    oom_counter: str | None  # the file that counted them
    nofile: tuple  # this process's RLIMIT_NOFILE (soft, hard): what the ranks inherit


class EnvironmentWatch:
    """Notes, while a run goes, the lowest free space on the run folder's disk and the OOM kills counted."""

    def __init__(self, folder):
        self.folder = folder
        self.total = total_bytes(folder)
        self.lowest = free_bytes(folder)
        self.counter, self.oom_before = oom_kill_counter()

    def sample(self):
        free = free_bytes(self.folder)
        if free is not None and (self.lowest is None or free < self.lowest):
            self.lowest = free

    def seen(self):
        self.sample()
        counter, after = oom_kill_counter()
        same = counter == self.counter and after is not None and self.oom_before is not None
        return Seen(
            folder=self.folder,
            total=self.total,
            lowest_free=self.lowest,
            oom_kills=after - self.oom_before if same else None,
            oom_counter=counter if same else None,
            nofile=resource.getrlimit(resource.RLIMIT_NOFILE),
        )


# --------------------------------------------------------------------------- after a run


def name_fault(result, seen=None):
    """What in the machine made the run `result` (a RunResult that failed) fail, in one line, or None.
    `seen`: what the launcher saw during the run (a Seen), when it watched."""
    return _disk_full(result, seen) or _too_many_files(result, seen) or _killed(result, seen)


def _saying(result, pattern):
    """The first rank whose error or output matches `pattern` (a RankOutput), 'torchrun' when only torchrun's
    own output does, or None."""
    for r in result.ranks:
        if pattern.search(r.error or "") or pattern.search(r.traceback or "") or pattern.search(r.stderr):
            return r
    return "torchrun" if pattern.search(result.launcher_output or "") else None


def _who(found):
    return "torchrun" if found == "torchrun" else f"rank {found.rank}"


def _disk_full(result, seen):
    if seen is not None and seen.lowest_free is not None and seen.lowest_free < FULL_BELOW:
        return (
            f"the disk of the run folder filled up during the run ({os.path.dirname(seen.folder)}: "
            f"{size(seen.lowest_free)} free of {size(seen.total)} at the lowest), and a rank that cannot write "
            f"fails with no traceback (its stderr is on that disk); free space there, or {WHAT_TO_DO}"
        )
    found = _saying(result, ENOSPC_TEXT)
    if found is not None:
        return (
            f"a disk filled up during the run: {_who(found)} wrote 'No space left on device' (ENOSPC); "
            "`df -h` shows which disk is full"
        )
    return None


def _limit(n):
    return "unlimited" if n == resource.RLIM_INFINITY else str(n)


def _too_many_files(result, seen):
    found = _saying(result, EMFILE_TEXT)
    if found is None:
        return None
    own = found != "torchrun" and found.nofile_limit
    soft, hard = own or (seen.nofile if seen is not None else resource.getrlimit(resource.RLIMIT_NOFILE))
    whose = "its open-file limit" if own else "the open-file limit the ranks inherit from this process"
    raise_to = f"`ulimit -n {_limit(hard)}` in the shell that starts Python or Jupyter raises the soft one"
    return (
        f"too many open files (EMFILE) on {_who(found)}: {whose} (RLIMIT_NOFILE) is soft {_limit(soft)}, "
        f"hard {_limit(hard)}; {raise_to} (above the hard one needs root, or /etc/security/limits.conf), "
        "or close the files it no longer needs"
    )


def _killed(result, seen):
    cause = result.root_cause
    if cause is None or cause.status != RunStatus.FAILED or cause.exitcode != -signal.SIGKILL:
        return None
    if seen is None or seen.oom_kills is None:
        counted = "no OOM counter could be read here"
    elif seen.oom_kills:
        counted = f"{seen.oom_counter} counted {seen.oom_kills} OOM kill(s) during the run"
    else:
        counted = f"{seen.oom_counter} counted no OOM kill during the run, so perhaps another process sent it"
    return (
        f"rank {cause.rank} was killed by SIGKILL, which the launcher did not send: likely the out-of-memory "
        f"killer ({counted}); {HOW_TO_CHECK_OOM} which process it killed and why"
    )
