"""How a launch looks while it runs: the live views (chapter 1).

In Jupyter or VS Code (an IPython kernel with a front end) the launcher shows one HTML output that it
updates in place: the latest lines of every rank while the run goes on, then the final side-by-side
view (lessonlib.view.html). In a terminal, every line is printed as it arrives with a `[rank N]` prefix,
but a traceback or stack dump is held until it has ended (the next line, or HOLD_QUIET seconds without
one), then printed folded (lessonlib.view.tracebacks.fold).
The launcher calls a view's `lines`, `tick` and `finish`; `NullView` shows nothing (show="none").

A view never writes onto the RunResult: the cell whose view showed a run is noted here (`shown_in_cell`),
so that the same run, returned as the cell's value, is not shown twice (`display_result`).
"""

import sys
import threading
import time
import weakref
from collections import deque

from .html import live_html, render_html
from .story import EVERY_FRAME, command_line, every_frame_of, render_text, status_line
from .tracebacks import fold, segments, short_paths

LIVE_LINES = 12  # lines per rank in the live view
LIVE_EVERY = 0.25  # seconds between live redraws
HOLD_QUIET = 0.5  # seconds without a line that end a traceback or stack the text view holds back


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


# The IPython cell whose launch view showed each run, by the run's id: {id(result): (weak reference, cell)}.
# A RunResult is a dataclass that compares by value (so is not hashable): a weak reference tells a live
# result from a new one that got the same id.
_shown = {}


def note_shown(result, cell):
    """Remember that the view in `cell` (an execution count, or None) showed `result`."""
    for key in [k for k, (ref, _) in _shown.items() if ref() is None]:
        del _shown[key]
    _shown[id(result)] = (weakref.ref(result), cell)


def shown_in_cell(result):
    """The cell whose launch view showed `result`, or None."""
    ref, cell = _shown.get(id(result), (None, None))
    return cell if ref is not None and ref() is result else None


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

    def __init__(self, script, args, nproc, nnodes, every_frame=EVERY_FRAME):
        """`every_frame`: what a fold line names as keeping every frame (story.EVERY_FRAME, formatted with
        what=ranks[1].stderr or launcher_output), or None to print every frame (`python -m lessonlib run
        --all-frames`)."""
        self.every_frame = every_frame
        self.held = {}  # (rank, stream): (lines of a traceback or stack that may go on, when the last came)
        self.elapsed = 0.0  # the run's seconds at the last tick

    def lines(self, rank, stream, lines):
        if self.every_frame is None or stream != "stderr":
            self._write(rank, stream, lines)
            return
        held, _ = self.held.pop((rank, stream), ([], 0.0))
        parts = segments(held + lines)
        # The last part may go on: a traceback or stack (its next frame, a chained exception, another
        # thread), or blank lines after one. Held back; everything before it is printed now.
        keep = 0
        if parts and parts[-1][0] != "text":
            keep = 1
        elif len(parts) > 1 and parts[-2][0] != "text" and not "".join(parts[-1][1]).strip():
            keep = 2
        for kind, chunk in parts[: len(parts) - keep]:
            self._write(rank, stream, chunk if kind == "text" else self._folded(kind, chunk, rank))
        if keep:
            self.held[rank, stream] = ([ln for _, chunk in parts[-keep:] for ln in chunk], self.elapsed)

    def tick(self, elapsed):
        self.elapsed = elapsed
        for key in [k for k, (_, last) in self.held.items() if elapsed - last >= HOLD_QUIET]:
            self._release(*key)

    def _release(self, rank, stream):
        held, _ = self.held.pop((rank, stream))
        for kind, chunk in segments(held):
            self._write(rank, stream, chunk if kind == "text" else self._folded(kind, chunk, rank))

    def _folded(self, kind, chunk, rank=None):
        """A traceback or stack of rank `rank` (None: torchrun's own output), folded, as lines."""
        if rank is None:
            where = self.every_frame.format(what="launcher_output")
        else:
            where = every_frame_of(rank, self.every_frame)
        return [item if isinstance(item, str) else item.line(where) for item in fold(chunk, kind)]

    def _write(self, rank, stream, lines):
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.write("".join(f"[rank {rank}] {short_paths(line)}\n" for line in lines))
        out.flush()

    def finish(self, result):
        for key in list(self.held):
            self._release(*key)
        for kind, chunk in segments(result.launcher_output.splitlines()):
            for line in chunk if kind == "text" or self.every_frame is None else self._folded(kind, chunk):
                sys.stderr.write(f"[torchrun] {short_paths(line)}\n")
        sys.stdout.write(f"[lessonlib] {status_line(result)}\n")
        sys.stdout.flush()
        note_shown(result, _cell_number())  # every line is above: the cell need not show it again


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

    def _live_html(self):
        return live_html(self.cmd, self.recent, self.counts, self.elapsed)

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
        note_shown(result, _cell_number())
        if self.on_finish is not None:
            self.on_finish(result)


def display_result(result):
    """Show a RunResult as a cell's output (RunResult._ipython_display_), unless the launch's own view
    already shows it in this very cell: `lessonlib.launch(...).raise_for_status()` as a cell's last
    line would otherwise show the same run twice."""
    shown = shown_in_cell(result)
    if shown is not None and shown == _cell_number():
        return
    from IPython.display import display

    display({"text/html": render_html(result), "text/plain": render_text(result)}, raw=True)
