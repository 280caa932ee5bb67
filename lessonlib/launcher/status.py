"""How one rank of a run ended: RunStatus (chapter 1).

A str Enum, so a status is also its word: `r.status == "failed"`, `f"{r.status:10}"` and a table cell read
as they read with a plain string, while code in lessonlib names the members. A leaf: the result sets it
(lessonlib.launcher.result), the views read it (lessonlib.view).
"""

import enum


class RunStatus(str, enum.Enum):
    OK = "ok"  # exit 0
    FAILED = "failed"  # its own error, a non-zero exit, or a signal other than torchrun's SIGTERM
    HUNG = "hung"  # still running when the run timed out, then killed
    INTERRUPTED = "interrupted"  # still running when the run was stopped (Ctrl-C, Stop), then killed
    TERMINATED = "terminated"  # stopped from outside: torchrun's SIGTERM after another rank failed, or no record
    NOT_STARTED = "not started"  # never started its script

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)
