"""Run a lesson from a terminal, and list the lessons (chapter 1).

    python -m lessonlib run lessons/02_collectives.py -n 4 -- --ops broadcast,all_reduce
    python -m lessonlib run lessons/01_launch.py --columns
    python -m lessonlib list

`run` is `lessonlib.launch(..., show="text")`: every line a rank prints appears at once with a
`[rank N]` prefix (a traceback or stack as soon as it has ended, folded: the lesson's frames and one line
for lessonlib's, torch's and Python's below them; --all-frames shows every frame), the run is bounded by
--timeout, and no process of it outlives it. Afterwards
--columns shows the ranks side by side, as wide as the terminal. Options for the lesson itself go
after `--`. Exit status: 0 when every rank exited 0; 1 when a rank failed, and the last lines on
stderr say how each rank ended and where it was, then name the first rank that failed with its error
(a line `Cause: ...` first when the machine made it fail: a full disk, too many open files, a rank
likely killed for memory); 1 also when the machine cannot run a launch at all (a missing TMPDIR, a
read-only or full temporary folder), said in one line before anything starts; 124 on timeout; 130 on
Ctrl-C; 2 for bad input, before anything starts.

`list` and `--help` read files only (the catalog: docstrings with ast, chapter titles from the notebooks
with json): they do not import torch, or even the launcher.
"""

import argparse
import os
import re
import shutil
import signal
import sys

# The launcher's bounds, without importing the launcher (nor torch).
from ..launcher.request import MAX_NPROC, MAX_TIMEOUT, ranks_problem, timeout_problem
from ..paths import ROOT, find_script, script_candidates

# How a run is told is the view's (the same words as in a notebook); it imports no torch.
from ..view.story import describe_failure, failure_line, render_columns
from .catalog import chapter_titles, command_of, kind_of, lesson_files, nproc_of, summary_of

# A fold line's pointer to every frame, in a terminal where there is no RunResult to read them from.
EVERY_FRAME = "run again with --all-frames"

DEFAULT_NPROC = 2  # for a script whose docstring names no world size
DEFAULT_TIMEOUT = 300.0
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_INTERRUPTED = 0, 1, 2, 124, 130

RUN_EPILOG = f"""\
Options for the lesson itself go after `--`: everything after it is passed to the lesson as is.
An option that lessonlib run does not know, given before `--`, is an error.

examples:
  python -m lessonlib run lessons/02_collectives.py            ranks as its docstring says (4)
  python -m lessonlib run lessons/01_launch.py -n 3            3 ranks
  python -m lessonlib run lessons/01_launch.py -- --fail-rank 1
                                                              see how a failing rank looks
  python -m lessonlib run lessons/07_buckets.py --columns -- --steps 5
                                                              ranks side by side afterwards
  python -m lessonlib run lessons/01_launch.py -n 1 -- --help  the lesson's own options

exit status: 0 every rank exited 0; 1 a rank failed (the last lines on stderr name the first rank
that failed and its error), or the machine cannot run it (one line: a missing TMPDIR, a read-only or
full temporary folder); {EXIT_TIMEOUT} timed out; {EXIT_INTERRUPTED} interrupted (Ctrl-C); 2 bad input (nothing
started).
"""


class UsageError(Exception):
    """Bad input found before anything started: a message for the reader, exit status 2."""


# --------------------------------------------------------------------------- list


def list_lessons(out=None, root=ROOT):
    """Print every lesson grouped by chapter: its command, and what it shows."""
    out = out or sys.stdout
    titles = chapter_titles(root)
    lessons = lesson_files(root)
    chapter = None
    for path in lessons:
        number = int(path.name[:2])
        if number != chapter:
            chapter = number
            title, notebook = titles.get(number, (f"Chapter {number}", None))
            if not re.match(rf"{number}\.\s", title):
                title = f"{number}. {title}"
            where = f"  (book/{notebook})" if notebook else ""
            out.write(("\n" if path != lessons[0] else "") + title + where + "\n")
        try:
            command, summary = command_of(path), summary_of(path)
        except SyntaxError as e:
            command, summary = f"lessons/{path.name}", f"(does not parse: {e})"
        out.write(f"  {command or 'lessons/' + path.name}\n")
        if summary:
            out.write(f"      {summary}\n")
    out.write(
        f"\n{len(lessons)} lessons. Run one with: python -m lessonlib run lessons/NN_name.py "
        "[-n N] [-- lesson options]\n"
    )


# --------------------------------------------------------------------------- run


def _nproc(text):
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of ranks, 1 to {MAX_NPROC}; got {text!r}") from None
    if problem := ranks_problem(n):
        raise argparse.ArgumentTypeError(problem)
    return n


def _timeout(text):
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if problem := timeout_problem(t):
        raise argparse.ArgumentTypeError(problem)
    return t


def python_file(script, hint, not_python):
    """The file `script` names, found as torchrun would read it (from this directory), else from the course
    root, like lessonlib.launch; or UsageError: no such file (then `hint`), or not a .py file (`not_python`)."""
    path = find_script(script)
    if path is None:
        where = " or ".join(str(c) for c in script_candidates(script))
        raise UsageError(f"{script}: no such file ({where}){hint}")
    if path.suffix != ".py":
        raise UsageError(f"{script}: {not_python}")
    return path


def check_script(script, nproc):
    """(resolved path, nproc to use), or UsageError naming what is wrong and what is allowed."""
    path = python_file(
        script,
        "; `python -m lessonlib list` shows the lessons",
        "not a lesson (a lesson is a Python file, lessons/NN_name.py)",
    )
    try:
        command = command_of(path)
    except SyntaxError as e:
        raise UsageError(f"{script}: not a lesson: it is not valid Python ({e.msg}, line {e.lineno})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{script}: not a lesson: not a UTF-8 text file") from None
    kind = kind_of(command)
    if kind == "spawn":
        raise UsageError(
            f"{script} starts its own processes (torch.multiprocessing.spawn), so it does not run "
            f"under torchrun; run it as its docstring says: {command}"
        )
    if kind == "single" and nproc not in (None, 1):
        raise UsageError(f"{script} is a one-process script (its command is `{command}`): -n must be 1; got {nproc}")
    if nproc is None:
        nproc = nproc_of(command) or DEFAULT_NPROC
    return path, nproc


def run_lesson(script, nproc=None, timeout=DEFAULT_TIMEOUT, args=(), columns=False, all_frames=False):
    """Launch `script` with every rank's lines shown live; return the exit status (see the docstring)."""
    path, nproc = check_script(script, nproc)
    from ..launcher.core import launch  # psutil and the views, not torch
    from ..launcher.faults import EnvironmentFault
    from ..view.live import TextLiveView

    every_frame = None if all_frames else EVERY_FRAME
    view = TextLiveView(str(path), list(args), nproc, 1, every_frame=every_frame)
    try:
        result = launch(path, nproc=nproc, args=list(args), timeout=timeout, show=view, cwd=os.getcwd())
    except EnvironmentFault as e:  # the machine, not the command: one line, no usage
        sys.stderr.write(f"lessonlib run: {e}\n")
        sys.stderr.flush()
        return EXIT_FAILED
    except (ValueError, FileNotFoundError) as e:  # the launcher's own checks, before it starts anything
        raise UsageError(str(e)) from None
    sys.stdout.flush()
    if columns:
        sys.stdout.write(render_columns(result, shutil.get_terminal_size().columns, every_frame) + "\n")
        sys.stdout.flush()
    if result.ok:
        return EXIT_OK
    # Every traceback and stack was shown above as it came, [rank N]-prefixed: here one line per rank,
    # then the verdict, not those tracebacks again.
    sys.stderr.write(describe_failure(result, details=False) + "\n")
    sys.stderr.write(f"lessonlib run: {failure_line(result)}\n")
    sys.stderr.flush()
    return EXIT_TIMEOUT if result.timed_out else EXIT_FAILED


# --------------------------------------------------------------------------- command line


CHECK_EPILOG = """\
Everything after `--` is the script and its own options, as torchrun would take them.

examples:
  python -m lessonlib check -- lessons/train_ddp.py --epochs 2
  python -m lessonlib check -n 4 --quiet -- my_train.py --lr 0.1

Each finding is one line: file:line: error|warning: what was seen [the chapter section that shows it].
The last line before the verdict says what the run was: ranks, backend, devices, batch, lr.

exit status: 0 the run succeeded and no finding is an error; 1 a finding is an error, or the script
failed; 124 timed out; 130 interrupted (Ctrl-C); 2 bad input (nothing was started)."""


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m lessonlib",
        description="Run the course's lessons from a terminal.",
        epilog="examples:\n  python -m lessonlib list\n  python -m lessonlib run lessons/01_launch.py -n 2\n"
        "  python -m lessonlib run --help",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,list,check}")
    run = sub.add_parser(
        "run",
        help="run a lesson under torchrun, each rank's lines shown live with a [rank N] prefix",
        description="Run a lesson under torchrun (lessonlib.launch): every rank's lines shown live with a\n"
        "[rank N] prefix, bounded by --timeout, no process left behind.",
        usage="python -m lessonlib run SCRIPT [-n N] [--timeout SECONDS] [--columns] [--all-frames]\n"
        "       [-- LESSON OPTIONS ...]",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("script", help="the lesson, e.g. lessons/01_launch.py (python -m lessonlib list shows them)")
    run.add_argument(
        "-n",
        "--nproc",
        type=_nproc,
        default=None,
        metavar="N",
        help=f"ranks, 1 to {MAX_NPROC} (default: the N in the lesson's docstring command, else {DEFAULT_NPROC})",
    )
    run.add_argument(
        "--timeout",
        type=_timeout,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"stop the run after this many seconds, printing where each rank was "
        f"(default {DEFAULT_TIMEOUT:g}, at most {MAX_TIMEOUT:g})",
    )
    run.add_argument(
        "--columns",
        action="store_true",
        help="after the run, show the ranks side by side in columns as wide as the terminal",
    )
    run.add_argument(
        "--all-frames",
        action="store_true",
        help="show every frame of each traceback and stack (by default the frames of lessonlib, torch and "
        "Python below the lesson's own are folded into one line)",
    )
    check = sub.add_parser(
        "check",
        help="run your own DDP script with the course's checks (replicas, samplers, checkpoints, collectives)",
        description="Run a DDP script as torchrun would (2 ranks on CPU with gloo by default), unchanged,\n"
        "with the course's checks loaded into every rank; then one line per finding, with the chapter\n"
        "section that shows that mistake running.",
        usage="python -m lessonlib check [-n N] [--timeout SECONDS] [--stall SECONDS] [--quiet] -- SCRIPT [ARGS ...]\n"
        "       python -m lessonlib check --list",
        epilog=CHECK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument(
        "-n",
        "--nproc",
        type=_nproc,
        default=None,
        metavar="N",
        help=f"ranks, 1 to {MAX_NPROC} (default: the GPUs when there are two or more, else 2)",
    )
    check.add_argument(
        "--timeout",
        type=_timeout,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"stop the run after this many seconds (default {DEFAULT_TIMEOUT:g}, at most {MAX_TIMEOUT:g})",
    )
    check.add_argument(
        "--stall",
        type=_stall,
        default=30.0,
        metavar="SECONDS",
        help="a collective that waits longer than this is a hang: the run stops and says who never came (default 30)",
    )
    check.add_argument("--quiet", action="store_true", help="print the findings only, not the ranks' output")
    check.add_argument(
        "--list", action="store_true", help="list the findings the check looks for, with their chapters, and exit"
    )
    sub.add_parser(
        "list",
        help="list every lesson by chapter, with the command that runs it",
        description="List every lesson (lessons/NN_*.py) by chapter, with the command on the first "
        "line of its docstring and what it shows.",
    )
    return parser, run, check


def _stall(text):
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stall must be a number of seconds, got {text!r}") from None
    if not 1 <= t <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(f"--stall must be from 1 to {MAX_TIMEOUT:g} seconds, got {text}")
    return t


def check_command(args, rest, parser):
    """`check`: the script is the first word after `--`; returns the exit status."""
    if args.list:
        if rest:
            raise UsageError("--list takes no script")
        from ..check.findings import listing

        sys.stdout.write(listing() + "\n")
        return EXIT_OK
    if not rest:
        raise UsageError("no script: give it after `--`, e.g. python -m lessonlib check -- train.py --epochs 1")
    script, script_args = rest[0], rest[1:]
    path = python_file(script, "", "not a Python script (SCRIPT is the .py file torchrun would run)")
    from ..check.command import check

    status, _, _ = check(path, script_args, args.nproc, args.timeout, args.stall, args.quiet)
    return status


def main(argv=None):
    """`python -m lessonlib`: returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # Everything after the first `--` belongs to the lesson; argparse never sees it.
        split = argv.index("--") if "--" in argv else len(argv)
        ours, lesson_args = argv[:split], argv[split + 1 :]
        parser, run_parser, check_parser = build_parser()
        args, unknown = parser.parse_known_args(ours)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        if args.command == "check":
            if unknown:
                check_parser.error(
                    f"unrecognized argument(s) {' '.join(unknown)}: the script and its options go after `--`"
                )
            try:
                return check_command(args, lesson_args, check_parser)
            except UsageError as e:
                check_parser.print_usage(sys.stderr)
                sys.stderr.write(f"{check_parser.prog}: error: {e}\n")
                return EXIT_USAGE
        if unknown:
            if args.command == "run":
                run_parser.error(
                    f"unrecognized argument(s) {' '.join(unknown)}: options for the lesson go after "
                    f"`--`, e.g. python -m lessonlib run {args.script} -- {' '.join(unknown)}"
                )
            parser.error(f"unrecognized argument(s): {' '.join(unknown)}")
        if args.command == "list":
            if split < len(argv):
                parser.error("list takes no arguments")
            try:
                list_lessons()
                sys.stdout.flush()
            except BrokenPipeError:  # `python -m lessonlib list | head`: the reader has seen enough
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
        try:
            return run_lesson(args.script, args.nproc, args.timeout, lesson_args, args.columns, args.all_frames)
        except UsageError as e:
            run_parser.print_usage(sys.stderr)
            sys.stderr.write(f"{run_parser.prog}: error: {e}\n")
            return EXIT_USAGE
    except KeyboardInterrupt:
        # The launcher has already stopped and killed every process of the run before this arrives.
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not print a traceback now
        sys.stdout.flush()
        command = "check" if "check" in argv[:1] else "run"
        sys.stderr.write(f"\nlessonlib {command}: interrupted (Ctrl-C); every process of the run was stopped\n")
        sys.stderr.flush()
        return EXIT_INTERRUPTED
