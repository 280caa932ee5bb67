"""lessonlib: the small library the course's lessons, notebooks and tests share.

- `launch` runs a lesson under torchrun in a subprocess and shows each rank's output apart (chapter 1);
  it returns a `RunResult` (each rank a `RankOutput`, how it ended a `RunStatus`), and
  `.raise_for_status()` raises `LaunchError`.
- `setup` / `teardown` join and leave the process group a lesson runs in (chapter 1).
- `report` hands values from a rank to the notebook that launched it (chapter 1).
- `ROOT` is the course checkout (lessons/ and book/ live there).
- `show_table` and `reserve_port` are small display and networking helpers (chapter 1).
- `run_bounded` runs any command bounded and leaves none of its processes behind; `started` does the
  same for a command that runs in the background while a cell works with it (chapters 11 and 12).
- `python -m lessonlib run lessons/X.py -n N` and `python -m lessonlib list` run and list lessons
  from a terminal (lessonlib.cli, chapter 1).
- `show_code` shows a marked region or a whole function of a lesson file as highlighted code, the
  same in the book, in Jupyter and in VS Code (chapter 1).
- `plot_ranks` draws what each rank holds, one row per rank (chapter 2).
- `glue` records a number a chapter's prose states, from the run the page shows (MyST-NB's glue).
- `panel` is a run panel (ipywidgets): a lesson's ranks and options as controls, Run and Stop, each
  rank's output live (chapter 2).
- `check_function` checks an exercise answer that must run on every rank (chapter 2).
- `comma_list` is an argparse type for options like `--ops a,b,c` (chapter 2).
- `load_lesson` loads another lesson file as a module, without running its main() (chapter 15).
- `Hosts` makes several hosts on one Linux machine, network namespaces on a switch, to launch on (chapter 16);
  `Hosts.unavailable()` says why it cannot here.
- `Slurm` runs a Slurm cluster on such hosts: a login host, compute nodes, real sbatch and srun (chapter 17).
- `lessonlib.training` has the small deterministic model and data the DDP chapters compare against
  one process (chapter 5); import it from there.
- `lessonlib.digits` has chapter 11's data pipeline (scikit-learn's bundled digits through torchvision
  v2, or MNIST files already on disk), its small CNN and an atomic save; import it from there.

Where the code lives, by the concern it serves (each folder's __init__ lists its modules):
- at the top, what runs inside a rank: `dist` (setup, teardown, report), `training`, `digits`,
  `sharding`, `exercises`, `argtypes`, `sockets`; and two leaves anything may import: `paths` (ROOT,
  the lessons, the one rule that finds a lesson file) and `machine` (facts about this machine);
- `lessonlib.launcher`: launching a run and reading its result (`launch`);
- `lessonlib.view`: showing a run: live views, the failure story, tracebacks, HTML;
- `lessonlib.processes`: finding, watching and killing processes by their mark (`run_bounded`);
- `lessonlib.cluster`: simulated machines: `Hosts` and `Slurm` (chapters 16 and 17);
- `lessonlib.cli`: `python -m lessonlib run/list` and the lesson catalog;
- `lessonlib.notebook`: what a chapter's cells call (the run panel, `show_code`, `plot_ranks`, tables);
- `lessonlib.book`: the book's build (the Sphinx extension, reading maps);
- `gpucheck`: `make gpu-check`, on a GPU machine (torch and the standard library only).

Names are imported on first use: every rank and torchrun agent of a launch imports a piece of this
package, and should not pay for the rest (psutil for the launcher, torch for `setup`).
"""

import importlib

_WHERE = {
    "launch": "launcher.core",
    "LaunchError": "launcher.result",
    "RunResult": "launcher.result",
    "RankOutput": "launcher.result",
    "RunStatus": "launcher.status",
    "MAX_NPROC": "launcher.request",
    "MAX_NNODES": "launcher.request",
    "reserve_port": "launcher.ports",
    "setup": "dist",
    "teardown": "dist",
    "DistContext": "dist",
    "report": "dist",
    "pick_backend": "dist",
    "ROOT": "paths",
    "run_bounded": "processes.bounded",
    "started": "processes.bounded",
    "Hosts": "cluster.hosts",
    "Slurm": "cluster.slurm",
    "show_table": "notebook.table",
    "show_code": "notebook.code",
    "plot_ranks": "notebook.plots",
    "glue": "notebook.glue",
    "panel": "notebook.panel",
    "RunPanel": "notebook.panel",
    "check_function": "exercises",
    "load_lesson": "exercises",
    "comma_list": "argtypes",
}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'lessonlib' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_WHERE])
