"""How a launch looks, and every word the course says about a run (chapter 1).

In Jupyter or VS Code (an IPython kernel with a front end) the launcher shows one HTML output that it
updates in place: the latest lines of every rank while the run goes on, then the final side-by-side
view. The final view is plain HTML with inline styles, so it also reads well in the static book.
In a terminal, every line is printed as it arrives with a `[rank N]` prefix.

A run that failed is told the same way everywhere (the HTML view, `str(run)`, `LaunchError`,
`python -m lessonlib run`): first one line per rank, how it ended and where it was
(`rank 0: RuntimeError: Timed out ...; at lessons/12_hang.py:57 in epoch_end: dist.barrier()`), then
the details. In the HTML view each traceback or stack is folded under its rank, torch's frames in grey.
Shown paths are short (`torch/distributed/distributed_c10d.py`, `lessons/12_hang.py`); the RunResult
itself keeps every byte the ranks wrote.
"""

import html
import linecache
import re
import sys
import sysconfig
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .spec import ROOT

LIVE_LINES = 12  # lines per rank in the live view
LIVE_EVERY = 0.25  # seconds between live redraws
HTML_CAP = 300  # lines per stream in the final view (first and last halves); the result keeps all
MIN_COLUMN = 24  # characters: the terminal's columns (render_columns) are never narrower
ERROR_CHARS = 160  # an error in a one-line summary is cut here
SOURCE_CHARS = 100  # a source line in a one-line summary is cut here


def in_notebook():
    """True inside a Jupyter/VS Code kernel, where HTML output is rendered."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _cell_number():
    """The IPython cell running now (its execution count), or None outside IPython or off its main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None  # a run panel's background run: no cell is showing it
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "execution_count", None) if shell is not None else None


def make_view(show, script, args, nproc, nnodes):
    if show == "auto":
        show = "html" if in_notebook() else "text"
    return {"html": HtmlLiveView, "text": TextLiveView, "none": NullView}[show](script, args, nproc, nnodes)


def command_line(script, args, nproc, nnodes):
    nodes = f"--nnodes={nnodes} " if nnodes > 1 else ""
    return " ".join(["torchrun", f"{nodes}--nproc_per_node={nproc}", script, *args])


# --------------------------------------------------------------------------- live views


class NullView:
    live = False  # whether it wants each rank's lines while the run goes on
    interval = 0.25  # seconds between the launcher's checks on the run

    def __init__(self, script, args, nproc, nnodes):
        pass

    def lines(self, rank, stream, lines):
        pass

    def tick(self, elapsed):
        pass

    def finish(self, result):
        pass


class TextLiveView(NullView):
    live, interval = True, 0.1

    def lines(self, rank, stream, lines):
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.write("".join(f"[rank {rank}] {short_paths(line)}\n" for line in lines))
        out.flush()

    def finish(self, result):
        for line in result.launcher_output.splitlines():
            sys.stderr.write(f"[torchrun] {short_paths(line)}\n")
        sys.stdout.write(f"[lessonlib] {status_line(result)}\n")
        sys.stdout.flush()
        result._shown_in_cell = _cell_number()  # every line is above: the cell need not show it again


class HtmlLiveView(NullView):
    live, interval = True, LIVE_EVERY

    def __init__(self, script, args, nproc, nnodes, draw=None, on_finish=None):
        """`draw(html)` shows each state; by default one display output of the cell, updated in place
        (the run panel passes a function that sets its widget's value instead). `on_finish(result)` is
        called once the final view is drawn."""
        self.on_finish = on_finish
        self.cmd = command_line(script, args, nproc, nnodes)
        self.recent = [deque(maxlen=LIVE_LINES) for _ in range(nproc * nnodes)]
        self.counts = [0] * (nproc * nnodes)
        self.changed, self.last_draw, self.elapsed = True, 0.0, 0.0
        if draw is None:
            from IPython.display import HTML, display

            handle = display(HTML(""), display_id=True)
            draw = lambda text: handle.update(HTML(text))  # noqa: E731
        self.draw = draw
        self.draw(self._live_html())

    def lines(self, rank, stream, lines):
        self.recent[rank].extend((stream, line) for line in lines)
        self.counts[rank] += len(lines)
        self.changed = True

    def tick(self, elapsed):
        self.elapsed = elapsed
        now = time.monotonic()
        if self.changed and now - self.last_draw >= LIVE_EVERY:
            self.draw(self._live_html())
            self.changed, self.last_draw = False, now

    def finish(self, result):
        self.draw(render_html(result))
        # The final view is this cell's output already: the RunResult, if the cell returns it, is not
        # shown a second time (RunResult._ipython_display_).
        result._shown_in_cell = _cell_number()
        if self.on_finish is not None:
            self.on_finish(result)

    def _live_html(self):
        cols, waiting = [], []
        for rank, recent in enumerate(self.recent):
            if not self.counts[rank]:
                waiting.append(rank)  # a strip, not an empty column: many lessons print from rank 0 only
                continue
            body = "\n".join(_span(short_paths(line), stream == "stderr") for stream, line in recent)
            cols.append(_column(rank, f"{self.counts[rank]} lines", _pre(body)))
        head = f"&#9203; running <code>{html.escape(self.cmd)}</code> &middot; {self.elapsed:.1f} s"
        who = f"rank {waiting[0]}" if len(waiting) == 1 else f"ranks {_list(waiting)}"
        quiet = _quiet_html(waiting, f"{who}: nothing printed yet") if waiting else ""
        return _frame(head, cols, quiet=quiet, world_size=len(self.recent))


def display_result(result):
    """Show a RunResult as a cell's output (RunResult._ipython_display_), unless the launch's own view
    already shows it in this very cell: `lessonlib.launch(...).raise_for_status()` as a cell's last
    line would otherwise show the same run twice."""
    shown = getattr(result, "_shown_in_cell", None)
    if shown is not None and shown == _cell_number():
        return
    from IPython.display import display

    display({"text/html": render_html(result), "text/plain": render_text(result)}, raw=True)


# --------------------------------------------------------------------------- paths and frames

# A path's prefix up to an installed package: /work/main/.venv/lib/python3.11/site-packages/torch/x.py
# is shown as torch/x.py. Any environment's, not only this one's (a rank may run another interpreter).
_SITE_PREFIX = re.compile(r"/[^\s\"'<>()\[\]]*?/(?:site|dist)-packages/")
_ROOT_PREFIX = str(ROOT) + "/"
_STDLIB = tuple({sysconfig.get_paths()[k] + "/" for k in ("stdlib", "platstdlib")})
_LESSONLIB = _ROOT_PREFIX + "lessonlib/"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<function>.+?)\s*$')
_STACK_HEAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# gloo's errors start with where in its C++ sources they were raised, on torch's build machine.
_CPP_WHERE = re.compile(r"\[/[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


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
            m = _FRAME.match(line)
            if m:
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                source = nxt.strip() if nxt.startswith("    ") and not _FRAME.match(nxt) else ""
                found.append(Frame(m["file"], int(m["line"]), m["function"], source))
        return found
    blocks, current = [], None
    for line in text.splitlines():
        if _STACK_HEAD.match(line):
            current = (line.startswith("Current"), [])
            blocks.append(current)
        elif current is not None and (m := _FRAME.match(line)):
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


def _cut(text, n):
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def short_error(error):
    """An error on one line, for a summary: its first line, gloo's C++ location dropped, and if still
    long, its first sentence ("Connection closed by peer [127.0.0.1]:48876") or its first ERROR_CHARS."""
    first = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
    first = short_paths(_CPP_WHERE.sub("", first))
    end = first.find(". ", 30)
    if len(first) > ERROR_CHARS and 0 < end < ERROR_CHARS:
        return first[:end]
    return _cut(first, ERROR_CHARS)


def _code_only(source):
    # A source line without its trailing comment (PEP 8's two spaces before the #), for a one-line summary.
    return source.split("  # ", 1)[0].rstrip()


# --------------------------------------------------------------------------- a run, one line per rank


@dataclass(frozen=True)
class RankLine:
    """How one rank ended, and where it was, in one line."""

    rank: int
    what: str  # "exit 0", "RuntimeError: ...", "hung: ..."
    tag: str = ""  # "root cause", "left early: look here first"
    frame: Frame | None = None

    @property
    def where(self):
        if self.frame is None:
            return ""
        f = self.frame
        code = _cut(_code_only(f.source), SOURCE_CHARS)
        return f"at {short_paths(f.file)}:{f.line} in {f.function}" + (f": {code}" if code else "")

    def __str__(self):
        tag = f" ({self.tag})" if self.tag else ""
        return f"rank {self.rank}{tag}: {self.what}" + (f"; {self.where}" if self.where else "")


def rank_line(result, r):
    """The RankLine of rank output `r` of `result`."""
    cause, left_early = result.root_cause, result.left_early
    # When every failure only says a peer went away and a rank left early, the first to fail is a victim.
    tag = ("first to fail" if left_early else "root cause") if cause is not None and r is cause else ""
    if r.status == "ok":
        early = r.rank in left_early
        what = "exit 0, before the others failed" if early else "exit 0"
        return RankLine(r.rank, what, "left early: look here first" if early else "")
    if r.status == "not started":
        return RankLine(r.rank, "never started its script")
    if r.status == "hung":
        what = f"hung: still running at the {result.timeout:g} s timeout, then killed"
    elif r.status == "interrupted":
        what = "interrupted: still running when the run was stopped, then killed"
    elif r.status == "terminated" and r.error == "killed by SIGTERM":
        what = "stopped by torchrun (SIGTERM) after another rank failed"
    elif r.status == "terminated":
        what = "stopped" + (f" ({r.error})" if r.error else f", exit code {r.exitcode}")
    elif r.error.startswith("killed by "):
        what = f"{r.error} (exit {r.exitcode})"
    else:
        what = short_error(r.error) or f"exit code {r.exitcode}"
    stack = r.traceback or stack_dump(r.stderr)
    return RankLine(r.rank, what, tag, innermost_frame(stack) if stack else None)


def rank_lines(result):
    """One RankLine per rank, in rank order."""
    return [rank_line(result, r) for r in result.ranks]


def status_line(result):
    cmd = command_line(result.script, result.args, result.nproc, result.nnodes)
    if result.ok:
        ranks = f"{result.world_size} rank" + ("" if result.world_size == 1 else "s")
        return f"ok: {cmd} ({ranks}, {result.wall_time:.2f} s)"
    if result.timed_out:
        what = f"timed out after {result.timeout:g} s"
    elif result.interrupted:
        what = "interrupted"
    else:
        what = f"failed on rank(s) {_list(result.failed_ranks)}"
    cause = result.root_cause
    error = short_error(cause.error) if cause else ""
    why = f"; first failure: rank {cause.rank}" + (f" ({error})" if error else "") if cause else ""
    return f"{what}: {cmd} ({result.wall_time:.2f} s){why}"


def failure_line(result):
    """One line: what went wrong, naming the rank and its error (the last line `python -m lessonlib run`
    prints)."""
    cause = result.root_cause
    first = ""
    if cause is not None:
        first = f"rank {cause.rank} failed first" + (
            f" with {short_error(cause.error)}" if cause.error else f", exit code {cause.exitcode}"
        )
    if result.timed_out:
        stuck = [r.rank for r in result.ranks if r.status == "hung"]
        line = f"{result.script} timed out after {result.timeout:g} s (--timeout)"
        if stuck:
            line += f"; rank(s) {_list(stuck)} were still running and were killed"
        return line + (f"; before that, {first}" if first else "")
    if result.interrupted:
        return f"{result.script} was interrupted" + (f"; before that, {first}" if first else "")
    line = f"{result.script} failed on rank(s) {_list(result.failed_ranks)} of {result.world_size}"
    return line + (f": {first}" if first else "")


def describe_failure(result, details=True):
    """What went wrong, for a person: a headline, one line per rank, then (with `details`) the root
    cause's traceback and the stacks of the ranks that were stopped. RunResult.describe_failure and
    LaunchError's message."""
    if result.ok:
        return f"{result.script}: all {result.world_size} ranks exited 0"
    stopped = result.timed_out or result.interrupted
    what = f"timed out after {result.timeout:g} s" if result.timed_out else "was interrupted"
    if stopped and not [r for r in result.ranks if r.status != "not started"]:
        return short_paths(
            f"{result.script} {what} before any rank had started its script (torchrun was still starting; "
            f"everything was killed). torchrun said:\n{_tail(result.launcher_output, 30)}"
        )
    stuck = [r for r in result.ranks if r.status in ("hung", "interrupted")]
    if stopped:
        head = f"{result.script} {what}" + (
            f"; rank(s) {_list(r.rank for r in stuck)} were still running and were killed:" if stuck else ":"
        )
    else:
        head = f"{result.script} failed on rank(s) {_list(result.failed_ranks)} of {result.world_size}:"
    lines = [head, *(f"  {line}" for line in rank_lines(result))]
    early = result.left_early
    if early:
        lines.append(
            f"Rank(s) {_list(early)} exited 0 before the first failure, while the others still called "
            "collectives: a rank that leaves early reads as 'Connection closed by peer' on the others. "
            "Look there first."
        )
    if not details:
        return short_paths("\n".join(lines))
    cause = result.root_cause
    if stopped:
        if stuck:
            lines.append("Their Python stacks at that moment:")
        for r in stuck:
            lines += [f"--- rank {r.rank} stack ---", stack_dump(r.stderr) or _tail(r.stderr, 30) or "(none printed)"]
        if cause is not None:
            lines += [f"Before that, rank {cause.rank} failed:", cause.traceback or cause.error]
        return short_paths("\n".join(lines))
    if cause is None:
        lines += ["No rank recorded an error; torchrun said:", _tail(result.launcher_output, 30)]
        return short_paths("\n".join(lines))
    start = result.ranks_start
    when = f" at +{cause.end - start:.2f} s" if cause.end and start else ""
    lines.append(
        f"First failure (root cause): rank {cause.rank} exited {cause.exitcode}{when}"
        + (f" with {cause.error}" if cause.error else "")
    )
    lines += [
        f"--- rank {cause.rank} traceback ---",
        cause.traceback or _tail(cause.stderr, 30) or "(no traceback: see its stderr)",
    ]
    for r in result.ranks:
        stack = stack_dump(r.stderr) if r.status == "terminated" else ""
        if stack and r is not cause:
            lines += [f"--- rank {r.rank} stack (where it was when it was stopped) ---", stack]
    return short_paths("\n".join(lines))


def stack_dump(stderr):
    """The faulthandler dump in a rank's stderr (from its first 'Thread 0x' line), or '' if none."""
    hits = [i for i in (stderr.find("Thread 0x"), stderr.find("Current thread 0x")) if i >= 0]
    if not hits:
        return ""
    # The frames below the lesson (runpy, lessonlib.launcher._rank_main) are the launcher's, not the lesson's.
    lines = [
        ln
        for ln in stderr[min(hits) :].splitlines()
        if "<frozen runpy>" not in ln and "lessonlib/launcher/_rank_main.py" not in ln
    ]
    return "\n".join(lines).rstrip()


def _quiet_groups(ranks):
    """[(ranks, how they ended)] of the ranks that printed nothing, grouped by how they ended."""
    groups = {}
    for r in ranks:
        groups.setdefault(_exit_text(r), []).append(r.rank)
    return [(rs, how) for how, rs in groups.items()]


def _quiet_text(groups):
    parts = []
    for ranks, how in groups:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_list(ranks)}"
        parts.append(f"{who} printed nothing ({how})")
    return "; ".join(parts)


def _printed(r):
    return bool(r.stdout.strip() or r.stderr.strip())


def render_text(result):
    """`str(run)`: the status line, one line per rank if it failed, then each rank's lines, prefixed."""
    parts = [status_line(result)]
    if not result.ok:
        parts += [f"  {line}" for line in rank_lines(result)]
    quiet = [r for r in result.ranks if not _printed(r)]
    for r in result.ranks:
        if r in quiet:
            continue
        parts.append(f"--- rank {r.rank} ({_exit_text(r)}) ---")
        parts.extend(f"[rank {r.rank}] {line}" for line in r.stdout.splitlines())
        parts.extend(f"[rank {r.rank}:stderr] {line}" for line in r.stderr.splitlines())
    if quiet:
        parts.append(_quiet_text(_quiet_groups(quiet)))
    return short_paths("\n".join(parts))


def render_columns(result, width):
    """Each rank's output in a column of its own, as many columns per row as fit in `width` characters
    (`python -m lessonlib run --columns`); the ranks that printed nothing on one line below."""
    sep = " | "
    shown = [r for r in result.ranks if _printed(r)]
    quiet = [r for r in result.ranks if not _printed(r)]
    n = len(shown)
    per_row = max(1, min(n, (width + len(sep)) // (MIN_COLUMN + len(sep))))
    col = max(8, (width - len(sep) * (per_row - 1)) // per_row)
    blocks = []
    for start in range(0, n, per_row):
        cells = []
        for r in shown[start : start + per_row]:
            lines = [f"rank {r.rank} ({_exit_text(r)})", "-" * col]
            for text in short_paths(r.stdout).splitlines():
                lines += _wrap(text, col)
            if r.stderr.strip():
                lines.append("-- stderr --")
                for text in short_paths(r.stderr).splitlines():
                    lines += _wrap(text, col)
            cells.append(lines)
        height = max(len(c) for c in cells)
        rows = []
        for i in range(height):
            parts = [(c[i] if i < len(c) else "").ljust(col) for c in cells]
            rows.append(sep.join(parts).rstrip())
        blocks.append("\n".join(rows))
    if quiet:
        blocks.append("\n".join(_wrap(_quiet_text(_quiet_groups(quiet)), width)))
    return "\n\n".join(blocks)


def _wrap(line, width):
    line = line.expandtabs(4).rstrip()
    return [line[i : i + width] for i in range(0, len(line), width)] or [""]


def _exit_text(r):
    if r.status == "ok":
        return "exit 0"
    code = f"exit {r.exitcode}" if r.exitcode is not None else "no exit code"
    return f"{r.status}, {code}" if r.status != "failed" else code


def _list(items):
    return ", ".join(str(i) for i in items)


def _tail(text, n):
    return "\n".join(text.rstrip("\n").splitlines()[-n:])


# --------------------------------------------------------------------------- the HTML view


def render_html(result):
    """The final view: the status line; if the run failed, one line per rank; each rank that printed
    something in a column, its tracebacks and stacks folded; the ranks that printed nothing on one line;
    torchrun's own output folded."""
    cols = [_column(r.rank, _exit_text(r), _rank_body(r), bad=not r.ok) for r in result.ranks if _printed(r)]
    quiet = [r for r in result.ranks if not _printed(r)]
    icon = "&#10004;" if result.ok else "&#10008;"
    head = f"{icon} {html.escape(short_paths(status_line(result)))}"
    extra = ""
    if result.launcher_output.strip():
        n = len(result.launcher_output.splitlines())
        extra = (
            f'<details style="margin-top:4px"><summary style="cursor:pointer">torchrun\'s own output '
            f"({n} lines, kept apart from the ranks)</summary>"
            f'<pre tabindex="0" style="{_PRE};{_SCROLL}">{html.escape(short_paths(result.launcher_output))}</pre>'
            "</details>"
        )
    return _frame(
        head,
        cols,
        summary="" if result.ok else _summary_html(result),
        quiet=_quiet_html([r.rank for r in quiet], _quiet_text(_quiet_groups(quiet))) if quiet else "",
        extra=extra,
        bad=not result.ok,
        world_size=result.world_size,
    )


def _summary_html(result):
    items = []
    for line in rank_lines(result):
        tag = f' <b style="color:#b00020">({html.escape(line.tag)})</b>' if line.tag else ""
        where = f'<span style="color:#3d3d3d">; {html.escape(line.where)}</span>' if line.where else ""
        items.append(
            f'<li style="margin:1px 0"><b>rank {line.rank}</b>{tag}: {html.escape(short_paths(line.what))}{where}</li>'
        )
    return f'<ul class="lessonlib-summary" aria-label="how each rank ended" style="{_SUMMARY}">{"".join(items)}</ul>'


def _rank_body(r):
    """A rank's column: its stdout, then its stderr, each traceback or stack dump in it folded."""
    blocks = [_pre(_capped(short_paths(r.stdout).rstrip("\n").splitlines(), False))] if r.stdout.strip() else []
    if r.stderr.strip():
        marker = _span("── stderr ──", True)
        # Split the stored text, whose paths tell torch's frames from the reader's; shorten what is shown.
        for i, (kind, lines) in enumerate(_segments(r.stderr.rstrip("\n").splitlines())):
            if kind == "text":
                shown = _capped([short_paths(line) for line in lines], True)
                blocks.append(_pre((marker + "\n" if i == 0 else "") + shown))
            else:
                if i == 0:
                    blocks.append(_pre(marker))
                blocks.append(_folded(kind, lines))
    return "".join(blocks)


def _segments(lines):
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
                k = blank_then(j, lambda s: s.startswith(_CHAINED))
                k = blank_then(k + 1, lambda s: s.startswith("Traceback")) if k is not None else None
                if k is None:
                    break
                j = k + 1  # ...unless another one, chained to it, follows
            add("traceback", lines[i:j])
            i = j
        elif _STACK_HEAD.match(line):
            j = i + 1
            while j < n:
                if lines[j].startswith((" ", "\t")):
                    j += 1
                    continue
                k = blank_then(j, _STACK_HEAD.match)
                if k is None:
                    break
                j = k + 1  # the next thread of the same dump
            add("stack", lines[i:j])
            i = j
        else:
            add("text", [line])
            i += 1
    return out


def _folded(kind, lines):
    """A traceback or stack dump, closed: its summary says what it is; frames of torch (or any installed
    package, the standard library, lessonlib) are grey, the reader's own in full colour. `lines` as the
    rank wrote them (their paths say whose a frame is); shown with short paths."""
    last = max((i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith((" ", "\t"))), default=0)
    if kind == "traceback":
        said = _cut(short_paths(_CPP_WHERE.sub("", lines[last])), ERROR_CHARS)
        title = f"traceback, {len(lines)} lines: {said}"
    else:
        title = f"Python stack when it was stopped, {len(lines)} lines"
    body, library = [], False
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m:
            library = is_library_path(m["file"])
        elif not line.startswith((" ", "\t")):
            library = False  # a heading or the exception: not part of a frame
        shown = short_paths(line)
        if kind == "traceback" and i == last:
            body.append(_span(shown, True))
        elif library:
            body.append(f'<span class="lessonlib-lib" style="color:#6b6b6b">{html.escape(shown)}</span>')
        else:
            body.append(html.escape(shown))
    return (
        '<details class="lessonlib-traceback" style="margin:2px 6px 4px">'
        '<summary style="cursor:pointer;color:#8a0018;font-family:sans-serif;font-size:11.5px">'
        f"{html.escape(title)}</summary>{_pre(chr(10).join(body))}</details>"
    )


def show_table(rows, columns=None, title=None):
    """Show a list of dicts as a table: HTML in a notebook, aligned text in a terminal (chapter 1)."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    if in_notebook():
        from IPython.display import HTML, display

        head = "".join(f'<th style="{_CELL}">{html.escape(str(c))}</th>' for c in columns)
        body = "".join(
            "<tr>" + "".join(f'<td style="{_CELL}">{html.escape(str(row.get(c, "")))}</td>' for c in columns) + "</tr>"
            for row in rows
        )
        cap = f"<caption>{html.escape(title)}</caption>" if title else ""
        display(HTML(f'<table style="border-collapse:collapse">{cap}<tr>{head}</tr>{body}</table>'))
    else:
        widths = [max(len(str(c)), *(len(str(row.get(c, ""))) for row in rows)) for c in columns]
        lines = [title] if title else []
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(columns, widths)))
        lines += ["  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)) for row in rows]
        print("\n".join(lines))


# --------------------------------------------------------------------------- HTML pieces

_PRE = (
    "margin:0;padding:4px 6px;white-space:pre-wrap;word-break:break-word;"
    "font-size:11.5px;line-height:1.35;background:#fbfbfb;color:#1b1b1b"
)
_SCROLL = "max-height:30em;overflow:auto"
_SUMMARY = (
    "list-style:none;margin:0 0 6px;padding:4px 8px;border:1px solid #e3b9bf;border-radius:4px;"
    "background:#fff7f7;color:#1b1b1b;font-family:monospace;font-size:12px;line-height:1.4;"
    "word-break:break-word"
)
_CELL = "border:1px solid #ccc;padding:2px 8px;text-align:left;font-family:monospace"
# Columns at least 22em wide (264 px at the view's 12 px): at 4 ranks in a narrow page they wrap onto
# another row rather than shrink to a few characters each; min() keeps one column within a narrow cell.
_GRID = "display:grid;grid-template-columns:repeat(auto-fit,minmax(min(22em,100%),1fr));gap:6px;overflow-x:auto"


def _span(text, err):
    text = html.escape(text)
    return f'<span style="color:#b00020">{text}</span>' if err else text


def _pre(body):
    return f'<pre style="{_PRE}">{body}</pre>'


def _capped(lines, err):
    if len(lines) > HTML_CAP:
        half = HTML_CAP // 2
        skipped = len(lines) - HTML_CAP
        lines = lines[:half] + [f"... {skipped} more lines (all of them are in run.ranks[i]) ..."] + lines[-half:]
    return "\n".join(_span(line, err) for line in lines)


def _column(rank, subtitle, body, bad=False):
    colour = "#fde8e8" if bad else "#e8eef8"
    return (
        f'<div class="lessonlib-rank" data-rank="{rank}" '
        f'style="border:1px solid #c8c8c8;border-radius:4px;overflow:hidden;min-width:0">'
        f'<div style="background:{colour};color:#1b1b1b;padding:2px 6px;font-family:sans-serif;font-size:12px">'
        f"<b>rank {rank}</b> &middot; {html.escape(subtitle)}</div>"
        f'<div class="lessonlib-output" tabindex="0" style="{_SCROLL};background:#fbfbfb">{body}</div></div>'
    )


def _quiet_html(ranks, text):
    """The one line that stands for the ranks with nothing to show, instead of an empty column each."""
    ranks = ",".join(str(rank) for rank in sorted(ranks))
    return (
        f'<div class="lessonlib-quiet" data-ranks="{ranks}" style="margin-top:4px;color:#4a4a4a;'
        f'font-family:sans-serif;font-style:italic">{html.escape(text)}</div>'
    )


def _frame(head, cols, *, summary="", quiet="", extra="", bad=False, world_size=None):
    colour = "#b00020" if bad else "#1b5e20"
    size = f' data-world-size="{world_size}"' if world_size is not None else ""
    grid = f'<div class="lessonlib-columns" style="{_GRID}">{"".join(cols)}</div>' if cols else ""
    return (
        f'<div class="lessonlib-run"{size} style="font-size:12px">'
        f'<div style="font-family:sans-serif;margin-bottom:4px;color:{colour}">{head}</div>'
        f"{summary}{grid}{quiet}{extra}</div>"
    )
