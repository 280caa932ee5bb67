"""What the book build ran: one JSON line per launch and per plain command, and the committed summary.

The tests skip a lesson run when the book build, in the same pytest session, makes the same run: the
same lesson at the same world size with default arguments, every rank ending with exit status 0; or the
same plain command, exit status 0. Which runs those are is not read from the chapters' text: the book
build records what it ran, and `launches.json` (next to this file) is the summary the tests read.

- The record. While the book build executes a chapter (lessonlib.book.rebuild), RECORD_VAR names a file,
  `_build/lessonlib-launches.jsonl`, and CHAPTER_VAR the chapter (set by lessonlib.book._execute_notebook).
  Then every `lessonlib.launch` in that chapter's kernel (the run panel's too, and a launch in a process the
  kernel started) appends one line: its chapter, script, world size, whether it took the reader's
  default path (no `args`, no `env`, no other option changed; `changed` names what did) and whether it
  was ok. `run_bounded(..., record=True)` (chapter 11's `run_python`) appends one for its command, as a
  reader types it (`python ...`): default when it ran from the course root with this environment. The
  executor appends a last line for its chapter, `ok` when every cell ran. Each line is one `os.write` on a
  file opened with O_APPEND, so chapters executing side by side never mix their lines. Without the
  variable (a reader's notebook) nothing is written, and nothing but that look-up is done.
- The build truncates the record at its start, so the record holds exactly what that build executed.
  A chapter whose cache was fresh did not execute and has no line in it: the record is of runs that
  happened, never of runs assumed.
- The summary, `launches.json`: the (script, world size, chapter) of every launch that ran with defaults
  and was ok, and the (command, chapter) of every such plain command; sorted, one entry a line.
  `python -m lessonlib.book.launchrecord _build/lessonlib-launches.jsonl` (`make book-record`) rewrites
  the entries of the chapters that build executed and keeps those of the chapters it did not (their
  cache was fresh: nothing they run changed since); entries of a chapter no longer in book/_toc.yml go.
  After a build from an empty `_build/` (`make clean book-record`, or the book test's), every entry comes
  from that build. A record in which a chapter did not run to its end is refused: its runs would be
  partial. (A launch interrupted by Ctrl-C writes no line; its chapter then fails anyway.)
- The book test (tests/test_book.py) builds from scratch and fails when its record's summary and
  `launches.json` differ, either way (`drift`), naming the entries and the command that rewrites it.
"""

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ..paths import BOOK, ROOT

RECORD_VAR = "LESSONLIB_LAUNCH_RECORD"  # the record file; set by the book build for the chapters it executes
CHAPTER_VAR = "LESSONLIB_LAUNCH_CHAPTER"  # the chapter executing (its notebook's file name)
RECORD_FILE = "lessonlib-launches.jsonl"  # written next to the build's lessonlib-execution.json, in _build/
SUMMARY = Path(__file__).with_name("launches.json")
REWRITE = "make book-record"

# A launch's settings as a reader's `lessonlib.launch("lessons/X.py", nproc=N)` leaves them: a run with any
# other value is not the run a test of the lesson stands for (timeout and show change no rank's work).
LAUNCH_DEFAULTS = {
    "args": (),
    "env": {},
    "nnodes": 1,
    "backend": None,
    "launcher": "torchrun",
    "rendezvous": "c10d",
    "cwd": ROOT,
    "max_restarts": 0,
    "hosts": (),
    "torchrun_args": (),
}
# Each kind of line and the fields it must have, with their types.
FIELDS = {
    "launch": {"chapter": str, "script": str, "ranks": int, "defaults": bool, "changed": list, "ok": bool},
    "command": {"chapter": str, "command": str, "defaults": bool, "changed": list, "ok": bool},
    "chapter": {"chapter": str, "ok": bool},
}


class RecordError(ValueError):
    """A record or summary that cannot be read, or cannot be summarised truthfully."""


def record_file():
    """The record file this process appends to, or None when nothing is being recorded."""
    return os.environ.get(RECORD_VAR) or None


def append(entry):
    """Append `entry` (a dict, with CHAPTER_VAR's chapter added) to the record, as one line in one write.
    Does nothing when no record is being made."""
    path = record_file()
    if path is None:
        return
    line = json.dumps({"chapter": os.environ.get(CHAPTER_VAR), **entry}) + "\n"
    data = line.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(f"{path}: wrote {written} of a record line's {len(data)} bytes")


def _course_path(path):
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def record_launch(spec, result):
    """Note a launch (its lessonlib.launcher.request.LaunchSpec and RunResult), if a record is being made."""
    if record_file() is None:
        return
    changed = [name for name, default in LAUNCH_DEFAULTS.items() if _plain(getattr(spec, name)) != default]
    append(
        {
            "kind": "launch",
            "script": _course_path(spec.script),
            "ranks": spec.world_size,
            "defaults": not changed,
            "changed": changed,
            "ok": bool(result.ok),
        }
    )


def _plain(value):
    return dict(value) if hasattr(value, "keys") else value


def record_command(argv, cwd, env, finished):
    """Note a command run_bounded ran (`finished`, its Finished), if a record is being made. The command is
    written as a reader types it: this interpreter is `python`."""
    if record_file() is None:
        return
    argv = [str(a) for a in argv]
    if argv and argv[0] == sys.executable:
        argv[0] = "python"
    changed = (["env"] if env is not None else []) + ([] if Path(cwd or os.getcwd()).resolve() == ROOT else ["cwd"])
    append(
        {
            "kind": "command",
            "command": shlex.join(argv),
            "defaults": not changed,
            "changed": changed,
            "ok": finished.returncode == 0 and not finished.timed_out,
        }
    )


def record_chapter(ok):
    """Note that the chapter executing has finished: `ok` when every cell ran (lessonlib.book._execute_notebook)."""
    append({"kind": "chapter", "ok": bool(ok)})


def read_record(path):
    """The record's lines, as dicts; a RecordError names the file and line of one that is not a whole,
    well-formed line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise RecordError(f"{path}: cannot read the book's launch record: {e}") from None
    if text and not text.endswith("\n"):
        raise RecordError(f"{path}, line {text.count(chr(10)) + 1}: cut short (no end of line): {text[-200:]!r}")
    return [_checked(path, number, line) for number, line in enumerate(text.splitlines(), 1)]


def _checked(path, number, line):
    where = f"{path}, line {number}"
    try:
        entry = json.loads(line)
    except ValueError as e:
        raise RecordError(f"{where}: not JSON ({e}): {line[:200]!r}") from None
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind not in FIELDS:
        raise RecordError(f"{where}: not a record line (kind must be one of {', '.join(FIELDS)}): {line[:200]!r}")
    for name, kind_of in FIELDS[kind].items():
        value = entry.get(name)
        if not isinstance(value, kind_of) or kind_of is int and isinstance(value, bool):
            raise RecordError(f"{where}: a {kind} line needs {name!r} ({kind_of.__name__}); it has {value!r}")
    return entry


@dataclass(frozen=True)
class Summary:
    """What the book ran with defaults and succeeded: `launches`, a frozenset of (script, ranks, chapter);
    `commands`, a frozenset of (command, chapter). Loaded from launches.json or made from a record."""

    launches: frozenset = frozenset()
    commands: frozenset = frozenset()

    def chapters_launching(self, script, ranks):
        """The chapters that launch `script` (e.g. 'lessons/03_eval.py') at `ranks`, sorted; [] if none."""
        return sorted(c for s, n, c in self.launches if s == script and n == ranks)

    def chapters_running(self, command):
        """The chapters that run `command` (compared word by word, as a shell splits it), sorted."""
        words = shlex.split(command)
        return sorted(c for cmd, c in self.commands if shlex.split(cmd) == words)

    def chapters(self):
        return {c for *_, c in self.launches} | {c for _, c in self.commands}

    def without(self, chapters):
        """This summary less the entries of `chapters`."""
        return Summary(
            frozenset(e for e in self.launches if e[2] not in chapters),
            frozenset(e for e in self.commands if e[1] not in chapters),
        )

    def __or__(self, other):
        return Summary(self.launches | other.launches, self.commands | other.commands)


def summarise(entries):
    """The Summary of a record's lines: the launches and commands that ran with defaults and were ok."""
    return Summary(
        frozenset(
            (e["script"], e["ranks"], e["chapter"])
            for e in entries
            if e["kind"] == "launch" and e["defaults"] and e["ok"] and not Path(e["script"]).is_absolute()
        ),
        frozenset(
            (e["command"], e["chapter"]) for e in entries if e["kind"] == "command" and e["defaults"] and e["ok"]
        ),
    )


def executed_chapters(entries, path="the record"):
    """The chapters the record's build executed to the end. A RecordError if one failed or stopped (its
    runs would be a part of what it runs), or if a run's line names a chapter with no end of its own."""
    ended = {e["chapter"]: e["ok"] for e in entries if e["kind"] == "chapter"}
    failed = sorted(c for c, ok in ended.items() if not ok)
    unended = sorted({e["chapter"] for e in entries if e["kind"] != "chapter"} - set(ended))
    if failed or unended:
        said = [f"{c}: failed" for c in failed] + [f"{c}: did not run to its end" for c in unended]
        raise RecordError(
            f"{path}: not every chapter of that build ran to its end ({'; '.join(said)}), so its runs are only "
            "a part of what it runs: fix the chapter and build again"
        )
    return set(ended)


ABOUT = (
    "What the book build ran, each with its chapter: every lessonlib.launch of a lesson with default "
    "arguments that was ok, and every plain command (run_bounded(..., record=True)) that exited 0. The "
    "tests skip these runs when the book test is in the session. Written by `make book-record` "
    "(python -m lessonlib.book.launchrecord _build/lessonlib-launches.jsonl); the book test checks it."
)


def dump(summary):
    """The summary as launches.json's text: sorted, one entry a line, so that a diff shows what changed."""
    launches = ",\n".join(
        "  " + json.dumps({"script": s, "ranks": n, "chapter": c}) for s, n, c in sorted(summary.launches)
    )
    commands = ",\n".join("  " + json.dumps({"command": cmd, "chapter": c}) for cmd, c in sorted(summary.commands))
    return f'{{\n "about": {json.dumps(ABOUT)},\n "launches": [\n{launches}\n ],\n "commands": [\n{commands}\n ]\n}}\n'


def load(path=None):
    """The Summary in `path` (default: launches.json); a RecordError names what is wrong with it."""
    path = Path(SUMMARY if path is None else path)
    try:
        data = json.loads(path.read_text())
        return Summary(
            frozenset((e["script"], e["ranks"], e["chapter"]) for e in data["launches"]),
            frozenset((e["command"], e["chapter"]) for e in data["commands"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecordError(
            f"{path}: not a summary of the book's launches ({type(e).__name__}: {e}); {REWRITE}"
        ) from None


def toc_chapters(book=BOOK):
    """The chapters book/_toc.yml lists, as notebook file names."""
    toc = (Path(book) / "_toc.yml").read_text()
    return {f"{stem}.ipynb" for stem in re.findall(r"^\s*-\s*file:\s*(\S+)", toc, re.M)}


def rewrite(record_path, summary_path=None, chapters=None):
    """Rewrite the summary from a build's record: the entries of the chapters that build executed come from
    the record, those of the chapters it did not execute stay as they were, and those of chapters not in
    `chapters` (default: book/_toc.yml's) go. Returns (the new Summary, the old one)."""
    summary_path = Path(SUMMARY if summary_path is None else summary_path)
    entries = read_record(record_path)
    executed = executed_chapters(entries, record_path)
    chapters = toc_chapters() if chapters is None else set(chapters)
    old = load(summary_path) if summary_path.exists() else Summary()
    new = old.without(executed) | summarise(entries)
    new = new.without(new.chapters() - chapters)
    summary_path.write_text(dump(new))
    return new, old


def drift(committed, built):
    """How the committed summary differs from a build's: (entries it has that the build did not run with
    defaults and success, entries the build ran that it lacks), each a sorted list of readable lines."""

    def lines(summary):
        return {f"{s} at {n} rank(s), in {c}" for s, n, c in summary.launches} | {
            f"`{cmd}`, in {c}" for cmd, c in summary.commands
        }

    mine, theirs = lines(committed), lines(built)
    return sorted(mine - theirs), sorted(theirs - mine)


def main(argv):
    if len(argv) != 1:
        raise SystemExit(f"usage: python -m lessonlib.book.launchrecord _build/{RECORD_FILE} (got {argv})")
    try:
        new, old = rewrite(argv[0])
    except RecordError as e:
        raise SystemExit(str(e)) from None
    gone, added = drift(old, new)
    print(
        f"{_course_path(SUMMARY)}: {len(new.launches)} launches, {len(new.commands)} commands "
        f"({len(added)} added, {len(gone)} removed)"
    )
    for line in added:
        print(f"  + {line}")
    for line in gone:
        print(f"  - {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
