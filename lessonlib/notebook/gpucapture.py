"""What `make gpu-check` saw on a GPU machine, as a chapter quotes it (the Start page, chapters 8, 13, 15).

`python -m lessonlib.gpucheck` (lessonlib/gpucheck.py) runs the templates, chapter 15's classes and chapter
8's AMP lessons on real GPUs and writes every case to CAPTURE. A chapter calls `show("train_ddp")` to show
the cases whose names start with that prefix, labelled with the GPU, torch, CUDA and NCCL versions they ran
on, and the lines that say what ran (`running:`, the last `epoch` lines, `stopped at ...`; a lesson's last
lines). Where no GPU run
was captured, it says so in one line instead: the page never implies a GPU result it does not have.
"""

import json
import re
from pathlib import Path

from ..paths import ROOT

CAPTURE = ROOT / "book" / "captured" / "gpu_check.json"
KEY_LINES = re.compile(r"^(running:.*|epoch \d+:.*|stopped at epoch.*|resumed .*|.*nothing left to do.*)$", re.M)


def load(path=CAPTURE):
    """The captured run ({"about": ..., "cases": [...]}) or None when there is none."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def label(about):
    gpus = about["gpus"]
    count = f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"
    return f"{count}, torch {about['torch']}, CUDA {about['cuda']}, NCCL {about['nccl']}, captured {about['captured']}"


def key_lines(output, last=3):
    """The lines of a case's output that say what ran (the first `running:` line) and how it ended (the
    `last` other key lines)."""
    found = [m.group(0).strip() for m in KEY_LINES.finditer(output)]
    running = [line for line in found if line.startswith("running:")][:1]
    return running + [line for line in found if not line.startswith("running:")][-last:]


def shown_lines(output):
    """A template's key lines; for a lesson, which prints no `epoch` lines, its last lines."""
    return key_lines(output) or [line.strip() for line in output.splitlines() if line.strip()][-3:]


def rows(prefix, capture):
    return [
        {
            "case": c["name"],
            "what": c["what"],
            "result": c["status"] + (f": {c['reason']}" if c["reason"] else ""),
            "seconds": c["seconds"],
            "lines": " / ".join(shown_lines(c["output"])),
        }
        for c in capture["cases"]
        if c["name"].startswith(prefix)
    ]


def show(prefix, path=CAPTURE):
    """Show the captured GPU cases whose names start with `prefix`, labelled; or say none was captured."""
    from .table import show_table

    capture = load(path)
    if capture is None or not rows(prefix, capture):
        print(
            f"No GPU run of {prefix!r} has been captured for this page yet: `make gpu-check` on a machine with "
            f"GPUs runs it and writes {Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else path}."
        )
        return None
    show_table(rows(prefix, capture), title=f"make gpu-check on {label(capture['about'])}")
    return capture
