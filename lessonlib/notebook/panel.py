"""A run panel: change a lesson's ranks and options, run it, and watch every rank, in Jupyter (chapter 2).

    panel = lessonlib.panel("lessons/02_collectives.py", nproc=4)
    display(panel)
    run = panel.run()          # or press Run; panel.result holds the last RunResult

The panel is an ipywidgets widget: a ranks box, one control per option of the lesson's own argparse
parser (choices: a dropdown; numbers: a number box; on/off flags: a checkbox; anything else: a text
box), Run and Stop buttons, the equivalent `torchrun` command to copy, a status line, and each
rank's output in a column of its own, live while the run goes on, then in full (the same view as
`lessonlib.launch`). With `plot=fn`, `fn(result)` draws a matplotlib figure after each successful
run, shown under the columns.

Every run is a `lessonlib.launch`, with its guarantees: bounded, each rank apart, a failing rank
named with its error, nothing left running. Settings are checked before anything starts: ranks
outside 1..4, a number outside what the lesson allows, or a value the lesson's own parser rejects
is a message in the panel (and a ValueError from `run()`), and nothing starts.

Two ways to run, two ways to stop:
- `panel.run()` in a cell runs in the kernel's main thread and returns the RunResult. Interrupt the
  kernel to stop it: the launcher kills every process, the panel says so, KeyboardInterrupt follows.
- The Run button starts the run in a background thread, so the kernel stays free for the Stop button
  (which sets an Event the launcher checks), and for an interrupt: while such a run goes on, the
  kernel's idle SIGINT handler stops it instead of ignoring the signal. Widget values are set from
  that thread; no Output widget is written from it (ipywidgets' advice for background threads, and
  what VS Code's renderer handles badly).

The options are read by running the lesson in a fresh process up to its parse_args() call
(lessonlib.notebook._argspec), once per lesson file version.
"""

import base64
import html
import io
import signal
import threading

import ipywidgets as widgets

from ..launcher.core import launch
from ..launcher.request import ranks_problem, resolve_script
from ..paths import ROOT
from ..view.live import HtmlLiveView
from ..view.story import command_line
from .options import LessonOptions, run_argspec

MAX_RANKS = 4  # each rank is a Python process with torch loaded; the panel is for a laptop


def panel(script, nproc=2, args=None, *, timeout=300, plot=None, plot_alt=None):
    """A RunPanel for `script` with `nproc` ranks; `args` set the lesson's controls (e.g. ['--steps', '5']).

    `plot(result)` returns a matplotlib figure drawn from each successful run; `plot_alt(result)` (or a
    string) describes it for readers who cannot see it (the picture's alt text)."""
    return RunPanel(script, nproc=nproc, args=args, timeout=timeout, plot=plot, plot_alt=plot_alt)


# Runs started with the Run button, stopped by a kernel interrupt (see the module docstring).
_background_stops = set()


def _on_sigint(signum, frame):
    for event in list(_background_stops):
        event.set()


def _let_interrupts_stop_background_runs():
    """Make the kernel's idle SIGINT handler stop background runs (it ignores SIGINT otherwise)."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
    except ImportError:
        kernel = None
    # ipykernel puts default_int_handler in place while it handles a message (this click, say) and
    # then restores the handler it saved: make that the one it restores.
    if kernel is not None and hasattr(kernel, "saved_sigint_handler"):
        kernel.saved_sigint_handler = _on_sigint
    elif signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, _on_sigint)


class RunPanel(widgets.VBox):
    """See the module docstring. Attributes: nproc, options ({flag: control}), run_button, stop_button,
    command, status, output, figure, result."""

    def __init__(self, script, nproc=2, args=None, timeout=300, plot=None, plot_alt=None):
        self.path = resolve_script(script)
        self.script = str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else str(self.path)
        self.timeout, self.plot, self.plot_alt = timeout, plot, plot_alt
        self.result, self.running = None, False
        self._stop = threading.Event()
        self._thread = None
        self.lesson_options = LessonOptions.of(self.path, self.script)
        layout = widgets.Layout(width="auto")
        style = {"description_width": "initial"}
        self.nproc = widgets.IntText(
            value=nproc,
            description="ranks",
            layout=widgets.Layout(width="8em"),
            style=style,
            tooltip=f"1 to {MAX_RANKS}",
        )
        self.options = {o.flag: self._control(o, style, layout) for o in self.lesson_options}
        self._apply(args or [])
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = widgets.Button(
            description="Stop",
            button_style="danger",
            icon="stop",
            disabled=True,
            tooltip="Stops a run started with the Run button; for panel.run() in a cell, interrupt the kernel",
        )
        self.command = widgets.HTML()
        self.status = widgets.HTML()
        self.output = widgets.HTML(layout=widgets.Layout(width="100%"))
        self.figure = widgets.HTML(layout=widgets.Layout(display="none"))  # an <img> with alt text
        self.run_button.on_click(lambda _: self._start_in_background())
        self.stop_button.on_click(lambda _: self._stop.set())
        for control in [self.nproc, *self.options.values()]:
            control.observe(lambda _: self._show_command(), names="value")
        self._show_command()
        controls = widgets.HBox(
            [self.nproc, *self.options.values()], layout=widgets.Layout(flex_flow="row wrap", gap="2px 12px")
        )
        super().__init__(
            [
                controls,
                widgets.HBox([self.run_button, self.stop_button]),
                self.command,
                self.status,
                self.output,
                self.figure,
            ]
        )
        self.add_class("lessonlib-panel")

    # ------------------------------------------------------------------ controls

    @staticmethod
    def _control(option, style, layout):
        """The widget for one option (lessonlib.notebook.options.Option): its kind picks it, nothing else."""
        label, tip, value = option.flag, option.help or option.flag, option.initial
        if option.kind in ("switch", "bool"):
            return widgets.Checkbox(value=value, description=label, indent=False, tooltip=tip, layout=layout)
        if option.kind == "choice":
            return widgets.Dropdown(
                options=list(option.choices), value=value, description=label, tooltip=tip, style=style, layout=layout
            )
        width = "14em" if option.kind in ("int", "float") else "24em"
        if option.as_text:  # free text, or a number the lesson may leave unset ("" = not given)
            placeholder = "default" if option.default is None else ""
            return widgets.Text(
                value=value,
                placeholder=placeholder,
                description=label,
                tooltip=tip,
                style=style,
                layout=widgets.Layout(width=width),
            )
        box = widgets.IntText if option.kind == "int" else widgets.FloatText
        return box(value=value, description=label, tooltip=tip, style=style, layout=widgets.Layout(width=width))

    def _values(self):
        return {flag: control.value for flag, control in self.options.items()}

    def _apply(self, args):
        """Set the controls from a list like ['--steps', '5', '--flag']; unknown options are an error."""
        for flag, value in self.lesson_options.apply(args, self._values()).items():
            self.options[flag].value = value

    def settings(self):
        """The lesson options the controls hold, as torchrun would get them (defaults left out)."""
        return self.lesson_options.args(self._values())

    def _show_command(self):
        cmd = command_line(self.script, self.settings(), self.nproc.value, 1)
        self.command.value = (
            f'<div style="font-size:12px">Same run from a terminal: '
            f'<code style="user-select:all">{html.escape(cmd)}</code></div>'
        )

    def _message(self, text, bad=False):
        colour = "#b00020" if bad else "#1b1b1b"
        self.status.value = f'<div style="color:{colour};font-size:12px">{html.escape(text)}</div>' if text else ""

    def check(self):
        """The validated lesson options; on a bad setting, a message in the panel and ValueError."""
        problems = [f"ranks {p}"] if (p := ranks_problem(self.nproc.value, high=MAX_RANKS)) else []
        problems += self.lesson_options.problems(self._values())
        args = self.settings()
        if not problems and self.lesson_options.needs_lesson_check(self._values()):
            # A value only the lesson's own parser can judge (lessonlib.comma_list, ...): ask it.
            code, _, err = run_argspec("check", self.path, args)
            if code != 0:
                said = [ln for ln in err.strip().splitlines() if "error:" in ln]
                problems.append(
                    f"{self.script} rejects these options: "
                    f"{said[-1].split('error:', 1)[1].strip() if said else err.strip()[-500:]}"
                )
        if problems:
            text = "; ".join(problems) + ". Nothing was started."
            self._message(text, bad=True)
            raise ValueError(text)
        return args

    # ------------------------------------------------------------------ running

    def run(self):
        """Run with the current settings in this thread and return the RunResult (also in .result)."""
        if self.running:
            raise RuntimeError("this panel is already running; press Stop or wait for it")
        args = self.check()
        return self._run(args, background=False)

    def _start_in_background(self):
        if self.running:
            return
        try:
            args = self.check()
        except ValueError:
            return  # the panel shows why
        except Exception as e:  # noqa: BLE001 - shown in the panel rather than lost in the kernel log
            self._message(f"could not check the settings: {e}", bad=True)
            return
        _let_interrupts_stop_background_runs()
        self._thread = threading.Thread(target=self._run, args=(args, True), daemon=True, name="lessonlib-panel")
        self.running = True  # before start(): a second click must not start a second run
        self._thread.start()

    def wait(self, timeout=None):
        """Wait for a run started with the Run button; returns its RunResult (None if still running)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return None
        return self.result

    def _run(self, args, background):
        self.running = True
        self._stop.clear()
        self.run_button.disabled = True
        self.stop_button.disabled = not background
        self.figure.layout.display = "none"
        how = "press Stop" if background else "interrupt the kernel"
        self._message(f"running on {self.nproc.value} rank(s), at most {self.timeout:g} s ({how} to end it early)")
        if background:
            _background_stops.add(self._stop)

        def draw(text):
            self.output.value = text

        def finished(result):  # also when an interrupt then ends launch() with KeyboardInterrupt
            self.result = result

        view = HtmlLiveView(self.script, args, self.nproc.value, 1, draw=draw, on_finish=finished)
        try:
            result = launch(
                self.path, nproc=self.nproc.value, args=args, timeout=self.timeout, show=view, stop=self._stop
            )
        except KeyboardInterrupt:
            self._message(
                "interrupted: every process of the run was killed; the columns show what each rank printed until then",
                bad=True,
            )
            raise
        except Exception as e:  # noqa: BLE001
            self._message(f"the run could not start: {e}", bad=True)
            if not background:
                raise
            return None
        finally:
            _background_stops.discard(self._stop)
            self.running = False
            self.run_button.disabled = False
            self.stop_button.disabled = True
        if result.interrupted:
            self._message(
                "stopped: every process of the run was killed; the columns show what each rank printed until then",
                bad=True,
            )
        else:
            self._message("")  # the columns' own head says how the run ended
        if result.ok and self.plot is not None:
            self._draw_plot(result)
        return result

    def _draw_plot(self, result):
        import matplotlib
        import matplotlib.pyplot as plt

        try:
            with matplotlib.rc_context({"interactive": False}):
                fig = self.plot(result)
                buffer = io.BytesIO()
                fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
                plt.close(fig)
        except Exception as e:  # noqa: BLE001 - a broken picture should not hide the run
            self._message(f"the picture failed: {type(e).__name__}: {e}", bad=True)
            return
        alt = self.plot_alt(result) if callable(self.plot_alt) else self.plot_alt
        alt = alt or f"a picture drawn from the run of {command_line(self.script, result.args, result.nproc, 1)}"
        data = base64.b64encode(buffer.getvalue()).decode()
        self.figure.value = (
            f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt, quote=True)}" style="max-width:100%">'
        )
        self.figure.layout.display = None
