"""A run as HTML: the final view (status line, one line per rank, a column per rank with its tracebacks and
stacks folded, torchrun's own output folded) and the live view's frames (chapter 1).

Plain HTML with inline styles, so it reads the same in Jupyter, in VS Code and in the static book. Each
traceback or stack is folded under its rank, the frames of torch (or any installed package, the
standard library, lessonlib) in grey, the reader's own in full colour; inside it, the frames the reader
need not see (lessonlib.view.tracebacks.fold) are one line each, a closed `<details>` that holds them.
Shown paths are short (lessonlib.view.tracebacks.short_paths); the RunResult keeps every byte the ranks
wrote.
"""

import html

from .story import (
    cause_line,
    every_frame_of,
    exit_text,
    joined,
    printed,
    quiet_groups,
    quiet_text,
    rank_lines,
    status_line,
)
from .tracebacks import CPP_WHERE, ERROR_CHARS, FRAME_LINE, Fold, cut, fold, is_library_path, segments, short_paths

HTML_CAP = 300  # lines per stream in the final view (first and last halves); the result keeps all


def render_html(result):
    """The final view: the status line; if the run failed, one line per rank; each rank that printed
    something in a column, its tracebacks and stacks folded; the ranks that printed nothing on one line;
    torchrun's own output folded."""
    cols = [_column(r.rank, exit_text(r), _rank_body(r), bad=not r.ok) for r in result.ranks if printed(r)]
    quiet = [r for r in result.ranks if not printed(r)]
    icon = "&#10004;" if result.ok else "&#10008;"
    head = f"{icon} {html.escape(short_paths(status_line(result)))}"
    extra = ""
    if result.launcher_output.strip():
        lines = result.launcher_output.splitlines()
        # torchrun's own traceback (its ChildFailedError) goes through the agent's internals: folded too.
        items = [item for kind, chunk in segments(lines) for item in (chunk if kind == "text" else fold(chunk, kind))]
        body = _with_folds(items, "run.launcher_output", lambda _, line: html.escape(short_paths(line)))
        extra = (
            f'<details style="margin-top:4px"><summary style="cursor:pointer">torchrun\'s own output '
            f"({len(lines)} lines, kept apart from the ranks)</summary>"
            f'<div tabindex="0" style="{_SCROLL};{_BOX}">'
            f"{body}</div></details>"
        )
    return _frame(
        head,
        cols,
        summary="" if result.ok else _summary_html(result),
        quiet=_quiet_html([r.rank for r in quiet], quiet_text(quiet_groups(quiet))) if quiet else "",
        extra=extra,
        bad=not result.ok,
        world_size=result.world_size,
    )


def live_html(cmd, recent, counts, elapsed):
    """The live view while a run goes on: each rank's latest lines (`recent`: (stream, line) per rank),
    how many it has printed (`counts`), and one line for the ranks that printed nothing yet."""
    cols, waiting = [], []
    for rank, lines in enumerate(recent):
        if not counts[rank]:
            waiting.append(rank)  # a strip, not an empty column: many lessons print from rank 0 only
            continue
        body = "\n".join(_span(short_paths(line), stream == "stderr") for stream, line in lines)
        cols.append(_column(rank, f"{counts[rank]} lines", _pre(body)))
    head = f"&#9203; running <code>{html.escape(cmd)}</code> &middot; {elapsed:.1f} s"
    who = f"rank {waiting[0]}" if len(waiting) == 1 else f"ranks {joined(waiting)}"
    quiet = _quiet_html(waiting, f"{who}: nothing printed yet") if waiting else ""
    return _frame(head, cols, quiet=quiet, world_size=len(recent))


def _summary_html(result):
    items = []
    if cause := cause_line(result):  # the machine made it fail (a full disk, ...): said first
        items.append(f'<li style="margin:1px 0;list-style:none"><b>{html.escape(short_paths(cause))}</b></li>')
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
        for i, (kind, lines) in enumerate(segments(r.stderr.rstrip("\n").splitlines())):
            if kind == "text":
                shown = _capped([short_paths(line) for line in lines], True)
                blocks.append(_pre((marker + "\n" if i == 0 else "") + shown))
            else:
                if i == 0:
                    blocks.append(_pre(marker))
                blocks.append(_folded(kind, lines, every_frame_of(r.rank)))
    return "".join(blocks)


def _folded(kind, lines, where):
    """A traceback or stack dump, closed: its summary says what it is; frames of torch (or any installed
    package, the standard library, lessonlib) are grey, the reader's own in full colour, and the frames
    the reader need not see folded, one closed `<details>` each (its line names `where`, what keeps
    them). `lines` as the rank wrote them (their paths say whose a frame is); shown with short paths."""
    last = max((i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith((" ", "\t"))), default=0)
    if kind == "traceback":
        said = cut(short_paths(CPP_WHERE.sub("", lines[last])), ERROR_CHARS)
        title = f"traceback, {len(lines)} lines: {said}"
    else:
        title = f"Python stack when it was stopped, {len(lines)} lines"
    library = False

    def line_html(i, line):
        nonlocal library
        m = FRAME_LINE.match(line)
        if m:
            library = is_library_path(m["file"])
        elif not line.startswith((" ", "\t")):
            library = False  # a heading or the exception: not part of a frame
        shown = short_paths(line)
        if kind == "traceback" and i == last:
            return _span(shown, True)
        if library:
            return f'<span class="lessonlib-lib" style="color:#6b6b6b">{html.escape(shown)}</span>'
        return html.escape(shown)

    return (
        '<details class="lessonlib-traceback" style="margin:2px 6px 4px">'
        '<summary style="cursor:pointer;color:#8a0018;font-family:sans-serif;font-size:11.5px">'
        f'{html.escape(title)}</summary><div style="{_BOX}">{_with_folds(fold(lines, kind), where, line_html)}</div>'
        "</details>"
    )


def _with_folds(items, where, line_html):
    """Lines (str, each shown by `line_html(index, line)`) and Folds as HTML: the lines in `<pre>` blocks,
    each Fold a closed `<details>` whose summary is its one line and which holds its frames, grey."""
    out, run, at = [], [], 0
    for item in items:
        if not isinstance(item, Fold):
            run.append(line_html(at, item))
            at += 1
            continue
        at += len(item.lines)
        if run:
            out.append(f'<pre style="{_PRE_TIGHT}">{chr(10).join(run)}</pre>')
            run = []
        frames = html.escape(short_paths("\n".join(item.lines)))
        out.append(
            f'<details class="lessonlib-fold"><summary style="{_FOLD_SUMMARY}">{html.escape(item.line(where))}'
            f'</summary><pre style="{_PRE_TIGHT};color:#6b6b6b">{frames}</pre></details>'
        )
    if run:
        out.append(f'<pre style="{_PRE_TIGHT}">{chr(10).join(run)}</pre>')
    return "".join(out)


# --------------------------------------------------------------------------- HTML pieces

_PRE = (
    "margin:0;padding:4px 6px;white-space:pre-wrap;word-break:break-word;"
    "font-size:11.5px;line-height:1.35;background:#fbfbfb;color:#1b1b1b"
)
_PRE_TIGHT = _PRE.replace("padding:4px 6px", "padding:0 6px")  # one of the blocks a folded stack is cut into
_BOX = "padding:4px 0;background:#fbfbfb"  # around those blocks: the padding one <pre> would have
_FOLD_SUMMARY = (
    "cursor:pointer;padding:0 6px;white-space:pre-wrap;word-break:break-word;font-family:monospace;"
    "font-size:11.5px;line-height:1.35;color:#4a4a4a"
)
_SCROLL = "max-height:30em;overflow:auto"
_SUMMARY = (
    "list-style:none;margin:0 0 6px;padding:4px 8px;border:1px solid #e3b9bf;border-radius:4px;"
    "background:#fff7f7;color:#1b1b1b;font-family:monospace;font-size:12px;line-height:1.4;"
    "word-break:break-word"
)
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
