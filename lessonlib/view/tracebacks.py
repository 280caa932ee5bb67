"""Reading what a rank wrote: tracebacks, faulthandler stack dumps, and the paths in them (chapter 1, 12).

- `short_paths`: an installed package's paths from the package on (torch/distributed/...), the course
  checkout's relative to it (lessons/12_hang.py): what is shown, never what is stored.
- `frames`, `innermost_frame`: the frames of the last traceback, or of a stack dump (the current thread's,
  turned outermost first); the innermost of the reader's own code is where a rank was.
- `stack_dump`: the faulthandler dump in a rank's stderr; `segments`: stderr cut into text, tracebacks and
  stack dumps, in order (the HTML view folds each).
- `fold`, `folded_text`: a traceback or stack dump as the views show it: the reader's own frames, and of
  what that code called into (torch's collective, lessonlib's setup) the first and the innermost frame;
  every other frame (the launcher's and torchrun's below the lesson, the middle of torch's) folded into
  one line, `... 45 frames in lessonlib, torch and Python internals (every frame: run.ranks[1].stderr)`.
  What is stored stays whole: folding is only in what is shown.
- `short_error`: an error on one line, for a summary.
"""

import linecache
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..paths import ROOT

ERROR_CHARS = 160  # an error in a one-line summary is cut here

# A path's prefix up to an installed package: /work/main/.venv/lib/python3.11/site-packages/torch/x.py
# is shown as torch/x.py. Any environment's, not only this one's (a rank may run another interpreter).
_SITE_PREFIX = re.compile(r"/[^\s\"'<>()\[\]]*?/(?:site|dist)-packages/")
_ROOT_PREFIX = str(ROOT) + "/"
_STDLIB = tuple({sysconfig.get_paths()[k] + "/" for k in ("stdlib", "platstdlib")})
_LESSONLIB = _ROOT_PREFIX + "lessonlib/"
FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<function>.+?)\s*$')
STACK_HEAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# gloo's errors start with where in its C++ sources they were raised, on torch's build machine.
CPP_WHERE = re.compile(r"\[/[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


def short_paths(text):
    """`text` with installed packages' paths from the package on (torch/distributed/...) and the course
    checkout's relative to it (lessons/12_hang.py): what is shown, never what is stored."""
    return _SITE_PREFIX.sub("", text).replace(_ROOT_PREFIX, "")


def is_library_path(path):
    """True for a frame that is not the reader's code: an installed package (torch), the standard
    library, Python's own (<frozen runpy>), or lessonlib, which starts every rank."""
    if path.startswith("<") or _SITE_PREFIX.search(path) or path.startswith("lessonlib/"):
        return True
    return path.startswith(_STDLIB) or path.startswith(_LESSONLIB)


@dataclass(frozen=True)
class Frame:
    """One frame of a traceback or a stack dump: its file as written there, line, function and source."""

    file: str
    line: int
    function: str
    source: str = ""

    @property
    def own(self):
        return not is_library_path(self.file)


def frames(text):
    """The frames of the last traceback in `text`, or of a faulthandler stack dump, outermost first.

    A traceback lists the outermost frame first, with each frame's source line below it; a stack dump
    (`Current thread 0x...`, innermost first, no source) is turned round and its source read from the
    file. With several threads, the current one's (or else the first with a frame of the reader's own)."""
    text = text or ""
    at = text.rfind("Traceback (most recent call last):")
    if at >= 0:
        found, lines = [], text[at:].splitlines()
        for i, line in enumerate(lines):
            m = FRAME_LINE.match(line)
            if m:
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                source = nxt.strip() if nxt.startswith("    ") and not FRAME_LINE.match(nxt) else ""
                found.append(Frame(m["file"], int(m["line"]), m["function"], source))
        return found
    blocks, current = [], None
    for line in text.splitlines():
        if STACK_HEAD.match(line):
            current = (line.startswith("Current"), [])
            blocks.append(current)
        elif current is not None and (m := FRAME_LINE.match(line)):
            current[1].append(Frame(m["file"], int(m["line"]), m["function"], _source_of(m["file"], int(m["line"]))))
        elif current is not None and not line.startswith((" ", "\t")):
            current = None
    if not blocks:
        return []
    best = sorted(blocks, key=lambda b: (not b[0], not any(f.own for f in b[1])))[0]
    return best[1][::-1]


def innermost_frame(text):
    """The innermost frame of the reader's own code in a traceback or stack dump (chapter 12's "where
    did this rank wait"), else the innermost frame of any kind; None without frames."""
    found = frames(text)
    own = [f for f in found if f.own]
    return (own or found or [None])[-1]


def _source_of(file, line):
    # A stack dump names the file only; a lesson's path is relative to where its ranks ran (the course root).
    for path in (Path(file), ROOT / file):
        text = linecache.getline(str(path), line)
        if text:
            return text.strip()
    return ""


def cut(text, n):
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def short_error(error):
    """An error on one line, for a summary: its first line, gloo's C++ location dropped, and if still
    long, its first sentence ("Connection closed by peer [127.0.0.1]:48876") or its first ERROR_CHARS."""
    first = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
    first = short_paths(CPP_WHERE.sub("", first))
    end = first.find(". ", 30)
    if len(first) > ERROR_CHARS and 0 < end < ERROR_CHARS:
        return first[:end]
    return cut(first, ERROR_CHARS)


def code_only(source):
    # A source line without its trailing comment (PEP 8's two spaces before the #), for a one-line summary.
    return source.split("  # ", 1)[0].rstrip()


def stack_dump(stderr):
    """The faulthandler dump in a rank's stderr (from its first 'Thread 0x' line), or '' if none. Whole:
    a view folds the frames below the lesson (folded_text)."""
    hits = [i for i in (stderr.find("Thread 0x"), stderr.find("Current thread 0x")) if i >= 0]
    return stderr[min(hits) :].rstrip() if hits else ""


def segments(lines):
    """Split stderr lines into ('text' | 'traceback' | 'stack', lines) runs, in order."""
    out, i, n = [], 0, len(lines)

    def add(kind, chunk):
        if kind == "text" and out and out[-1][0] == "text":
            out[-1][1].extend(chunk)
        else:
            out.append((kind, list(chunk)))

    def blank_then(j, test):
        k = j
        while k < n and not lines[k].strip():
            k += 1
        return k if k < n and test(lines[k]) else None

    while i < n:
        line = lines[i]
        if line.startswith("Traceback (most recent call last):"):
            j = i + 1
            while j < n:
                if lines[j].startswith((" ", "\t")):
                    j += 1
                    continue
                j += 1  # the exception's own line ends the traceback...
                k = blank_then(j, lambda s: s.startswith(CHAINED))
                k = blank_then(k + 1, lambda s: s.startswith("Traceback")) if k is not None else None
                if k is None:
                    break
                j = k + 1  # ...unless another one, chained to it, follows
            add("traceback", lines[i:j])
            i = j
        elif STACK_HEAD.match(line):
            j = i + 1
            while j < n:
                if lines[j].startswith((" ", "\t")):
                    j += 1
                    continue
                k = blank_then(j, STACK_HEAD.match)
                if k is None:
                    break
                j = k + 1  # the next thread of the same dump
            add("stack", lines[i:j])
            i = j
        else:
            add("text", [line])
            i += 1
    return out


# --------------------------------------------------------------------------- folding what is not the reader's

FOLD_INDENT = "  "  # a fold line sits where the frames it stands for would


@dataclass(frozen=True)
class Fold:
    """Consecutive frames a view shows as one line: their lines as written, how many frames, whose."""

    lines: tuple
    frames: int
    owners: str  # "lessonlib, torch and Python"

    def line(self, where):
        """The one line shown for them; `where` names what keeps every frame (run.ranks[1].stderr)."""
        return f"{FOLD_INDENT}... {self.frames} frames in {self.owners} internals (every frame: {where})"


def owner(path):
    """Whose code a library frame's file is: 'lessonlib', an installed package's name ('torch'), or
    'Python' (the standard library, <frozen runpy>)."""
    if path.startswith(("lessonlib/", _LESSONLIB)):
        return "lessonlib"
    site = _SITE_PREFIX.search(path)
    if site:
        return path[site.end() :].split("/", 1)[0].removesuffix(".py")
    return "Python"


def _owners(files):
    found = {owner(f) for f in files}
    names = [n for n in ("lessonlib",) if n in found]
    names += sorted(found - {"lessonlib", "Python"}) + [n for n in ("Python",) if n in found]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _kept(files):
    """Which frames of one unbroken run (outermost first) a view shows: the reader's own; of each stretch of
    library frames that the reader's code called, its first and its innermost; with no frame of the
    reader's, the innermost alone. The library frames that called the reader's code are not kept."""
    own = [not is_library_path(f) for f in files]
    if not any(own):
        return [i == len(files) - 1 for i in range(len(files))]
    keep, seen_own = list(own), False
    for i, is_own in enumerate(own):
        if is_own:
            seen_own = True
        elif seen_own and (own[i - 1] or i == len(own) - 1 or own[i + 1]):
            keep[i] = True  # the first library frame the reader's code called, or the innermost of them
    return keep


def fold(lines, kind):
    """The lines of one traceback or stack dump (`kind` 'traceback' or 'stack', as segments() says; as the
    rank wrote them: their paths tell whose a frame is) with what the reader need not see folded: a list of
    lines (str) and Folds (two frames or more each; a single frame is shown, not folded). A traceback
    lists the outermost frame first, each with its source lines; a stack dump the innermost first, each
    thread's frames apart."""
    units = []  # (file of a frame, or None for any other line; its lines)
    for line in lines:
        m = FRAME_LINE.match(line)
        if m:
            units.append((m["file"], [line]))
        elif (
            kind == "traceback" and units and units[-1][0] is not None and line.startswith((" ", "\t")) and line.strip()
        ):
            units[-1][1].append(line)  # its source line, the carets under it, "[Previous line repeated ...]"
        else:
            units.append((None, [line]))
    out, i = [], 0
    while i < len(units):
        if units[i][0] is None:
            out.extend(units[i][1])
            i += 1
            continue
        j = i
        while j < len(units) and units[j][0] is not None:
            j += 1
        run = units[i:j]
        files = [f for f, _ in run]
        keep = _kept(files) if kind == "traceback" else _kept(files[::-1])[::-1]
        k = 0
        while k < len(run):
            e = k
            while e < len(run) and not keep[e]:
                e += 1
            if e - k >= 2:
                out.append(Fold(tuple(x for _, ls in run[k:e] for x in ls), e - k, _owners(files[k:e])))
            else:
                out.extend(x for _, ls in run[k:e] for x in ls)
            if e < len(run):
                out.extend(run[e][1])
            k = e + 1
        i = j
    return out


def folded_text(text, where):
    """`text` (a rank's stderr, a traceback, torchrun's output) as the text views show it: the lines of
    every traceback and stack dump in it folded (fold), each Fold as its one line naming `where`."""
    shown = []
    for kind, lines in segments((text or "").splitlines()):
        items = lines if kind == "text" else fold(lines, kind)
        shown += [item.line(where) if isinstance(item, Fold) else item for item in items]
    return shown
