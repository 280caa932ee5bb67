"""Tie a process's life to its parent's (Linux), so no part of a launch outlives the launcher (chapter 1).

`lessonlib.launch` kills the whole run on timeout, error or interrupt. If the launcher itself dies
(a notebook kernel restarted or killed), nobody is left to do that: the torchrun agent then ends
the run itself (lessonlib.launcher._agent_main), and each rank asks the kernel for SIGKILL when its parent,
the agent, exits, in case the agent died too hard to stop it. The book's chapter executor ties itself
to the build the same way. Elsewhere than Linux this is a no-op; the launcher's own cleanup still applies.
"""

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig, expected_parent=None):
    """Ask for `sig` when the parent exits; exit now if it already has (the race before this call)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(sig))
