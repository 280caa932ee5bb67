"""How a launch looks: live while it runs, then each rank side by side (chapter 1).

In Jupyter or VS Code (an IPython kernel with a front end) the launcher shows one HTML output that it
updates in place: the latest lines of every rank while the run goes on, then the final side-by-side
view. The final view is plain HTML with inline styles, so it also reads well in the static book.
In a terminal, every line is printed as it arrives with a `[rank N]` prefix.
"""

import html
import sys
import time
from collections import deque

LIVE_LINES = 12  # lines per rank in the live view
LIVE_EVERY = 0.25  # seconds between live redraws
HTML_CAP = 300  # lines per stream in the final view (first and last halves); the result keeps all


def in_notebook():
    """True inside a Jupyter/VS Code kernel, where HTML output is rendered."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def make_view(show, script, args, nproc, nnodes):
    if show == "auto":
        show = "html" if in_notebook() else "text"
    return {"html": HtmlLiveView, "text": TextLiveView, "none": NullView}[show](script, args, nproc, nnodes)


def command_line(script, args, nproc, nnodes):
    nodes = f"--nnodes={nnodes} " if nnodes > 1 else ""
    return " ".join(["torchrun", f"{nodes}--nproc_per_node={nproc}", script, *args])


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
        out.write("".join(f"[rank {rank}] {line}\n" for line in lines))
        out.flush()

    def finish(self, result):
        for line in result.launcher_output.splitlines():
            sys.stderr.write(f"[torchrun] {line}\n")
        sys.stdout.write(f"[lessonlib] {status_line(result)}\n")
        sys.stdout.flush()


class HtmlLiveView(NullView):
    live, interval = True, LIVE_EVERY

    def __init__(self, script, args, nproc, nnodes, draw=None):
        """`draw(html)` shows each state; by default one display output of the cell, updated in place
        (the run panel passes a function that sets its widget's value instead)."""
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

    def _live_html(self):
        cols = []
        for rank, recent in enumerate(self.recent):
            body = "\n".join(_span(line, stream == "stderr") for stream, line in recent)
            cols.append(_column(f"rank {rank}", f"{self.counts[rank]} lines", body))
        head = f"&#9203; running <code>{html.escape(self.cmd)}</code> &middot; {self.elapsed:.1f} s"
        return _frame(head, cols)


def status_line(result):
    cmd = command_line(result.script, result.args, result.nproc, result.nnodes)
    if result.ok:
        return f"ok: {cmd} ({result.world_size} ranks, {result.wall_time:.2f} s)"
    if result.timed_out:
        what = f"timed out after {result.timeout:g} s"
    elif result.interrupted:
        what = "interrupted"
    else:
        what = f"failed on rank(s) {', '.join(map(str, result.failed_ranks))}"
    cause = result.root_cause
    why = f"; first failure: rank {cause.rank}" + (f" ({cause.error})" if cause.error else "") if cause else ""
    return f"{what}: {cmd} ({result.wall_time:.2f} s){why}"


def render_text(result):
    parts = [status_line(result)]
    for r in result.ranks:
        parts.append(f"--- rank {r.rank} ({_exit_text(r)}) ---")
        parts.extend(f"[rank {r.rank}] {line}" for line in r.stdout.splitlines())
        parts.extend(f"[rank {r.rank}:stderr] {line}" for line in r.stderr.splitlines())
    return "\n".join(parts)


def render_html(result):
    cols = []
    for r in result.ranks:
        body = _capped(r.stdout, False)
        if r.stderr.strip():
            body += ("\n" if body else "") + _span("── stderr ──", True) + "\n" + _capped(r.stderr, True)
        cols.append(_column(f"rank {r.rank}", _exit_text(r), body or _QUIET, bad=not r.ok))
    icon = "&#10004;" if result.ok else "&#10008;"
    head = f"{icon} {html.escape(status_line(result))}"
    extra = ""
    if result.launcher_output.strip():
        n = len(result.launcher_output.splitlines())
        extra = (
            f'<details style="margin-top:4px"><summary style="cursor:pointer">torchrun\'s own output '
            f"({n} lines, kept apart from the ranks)</summary>"
            f'<pre tabindex="0" style="{_PRE}">{html.escape(result.launcher_output)}</pre></details>'
        )
    return _frame(head, cols, extra, bad=not result.ok)


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
    "margin:0;padding:4px 6px;white-space:pre-wrap;word-break:break-word;max-height:30em;"
    "overflow:auto;font-size:11.5px;line-height:1.35;background:#fbfbfb;color:#1b1b1b"
)
# What a rank that printed nothing shows, so that its column does not look like a rendering fault.
_QUIET = '<span class="lessonlib-quiet" style="color:#595959;font-style:italic">(this rank printed nothing)</span>'
_CELL = "border:1px solid #ccc;padding:2px 8px;text-align:left;font-family:monospace"


def _exit_text(r):
    if r.status == "ok":
        return "exit 0"
    code = f"exit {r.exitcode}" if r.exitcode is not None else "no exit code"
    return f"{r.status}, {code}" if r.status != "failed" else code


def _span(text, err):
    text = html.escape(text)
    return f'<span style="color:#b00020">{text}</span>' if err else text


def _capped(text, err):
    lines = text.rstrip("\n").splitlines()
    if len(lines) > HTML_CAP:
        half = HTML_CAP // 2
        skipped = len(lines) - HTML_CAP
        lines = lines[:half] + [f"... {skipped} more lines (all of them are in run.ranks[i]) ..."] + lines[-half:]
    return "\n".join(_span(line, err) for line in lines)


def _column(title, subtitle, body, bad=False):
    colour = "#fde8e8" if bad else "#e8eef8"
    return (
        f'<div style="border:1px solid #c8c8c8;border-radius:4px;overflow:hidden;min-width:0">'
        f'<div style="background:{colour};color:#1b1b1b;padding:2px 6px;font-family:sans-serif;font-size:12px">'
        f"<b>{html.escape(title)}</b> &middot; {html.escape(subtitle)}</div>"
        f'<pre tabindex="0" style="{_PRE}">{body}</pre></div>'
    )


def _frame(head, cols, extra="", bad=False):
    n = max(1, min(len(cols), 4))
    colour = "#b00020" if bad else "#1b5e20"
    return (
        f'<div class="lessonlib-run" style="font-size:12px">'
        f'<div style="font-family:sans-serif;margin-bottom:4px;color:{colour}">{head}</div>'
        f'<div style="display:grid;grid-template-columns:repeat({n},minmax(0,1fr));gap:6px">'
        f"{''.join(cols)}</div>{extra}</div>"
    )
