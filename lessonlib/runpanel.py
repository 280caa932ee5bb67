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
(lessonlib._argspec), once per lesson file version.
"""

import base64
import html
import io
import json
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import ipywidgets as widgets

from .display import HtmlLiveView, command_line
from .launcher import launch
from .launchspec import ROOT, resolve_script

MAX_RANKS = 4  # each rank is a Python process with torch loaded; the panel is for a laptop
SPEC_TIMEOUT = 60  # seconds to read a lesson's options (it imports torch)
_specs = {}  # (path, mtime) -> options


def panel(script, nproc=2, args=None, *, timeout=300, plot=None, plot_alt=None):
    """A RunPanel for `script` with `nproc` ranks; `args` set the lesson's controls (e.g. ['--steps', '5']).

    `plot(result)` returns a matplotlib figure drawn from each successful run; `plot_alt(result)` (or a
    string) describes it for readers who cannot see it (the picture's alt text)."""
    return RunPanel(script, nproc=nproc, args=args, timeout=timeout, plot=plot, plot_alt=plot_alt)


def _run_argspec(mode, path, args=()):
    """Run lessonlib._argspec in a fresh process, bounded; (exit code, its JSON or None, stderr)."""
    with tempfile.TemporaryDirectory(prefix="lessonlib-argspec-") as folder:
        out = Path(folder) / "out.json"
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "lessonlib._argspec", mode, str(path), str(out), *args],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=SPEC_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"reading the options of {path} took over {SPEC_TIMEOUT} s") from None
        data = json.loads(out.read_text()) if out.exists() else None
        return proc.returncode, data, proc.stderr


def lesson_options(path):
    """The lesson's argparse options, as lessonlib._argspec.describe gives them ([] without argparse)."""
    path = Path(path)
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _specs:
        source = path.read_text()
        if "ArgumentParser" not in source:
            _specs[key] = []  # no parser: nothing to read, and the lesson must not be run to find out
        else:
            code, data, err = _run_argspec("describe", path)
            if code != 0 or data is None:
                raise RuntimeError(f"could not read the options of {path} (exit {code}):\n{err[-2000:]}")
            _specs[key] = data["options"]
    return _specs[key]


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
        self.specs = {o["flag"]: o for o in lesson_options(self.path) if o["flag"]}
        layout = widgets.Layout(width="auto")
        style = {"description_width": "initial"}
        self.nproc = widgets.IntText(
            value=nproc,
            description="ranks",
            layout=widgets.Layout(width="8em"),
            style=style,
            tooltip=f"1 to {MAX_RANKS}",
        )
        self.options = {flag: self._control(spec, style, layout) for flag, spec in self.specs.items()}
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
    def _control(spec, style, layout):
        label, tip = spec["flag"], spec["help"] or spec["flag"]
        default, kind = spec["default"], spec["kind"]
        if kind == "switch":
            return widgets.Checkbox(value=False, description=label, indent=False, tooltip=tip, layout=layout)
        if kind == "bool":
            return widgets.Checkbox(value=bool(default), description=label, indent=False, tooltip=tip, layout=layout)
        if kind == "choice":
            choices = [str(c) for c in spec["choices"]]
            value = str(default) if str(default) in choices else choices[0]
            return widgets.Dropdown(
                options=choices, value=value, description=label, tooltip=tip, style=style, layout=layout
            )
        if kind in ("int", "float") and (default is None or isinstance(default, (int, float))):
            box = widgets.IntText if kind == "int" else widgets.FloatText
            if default is None:  # an optional number: a text box, empty means "not given"
                return widgets.Text(
                    value="",
                    placeholder="default",
                    description=label,
                    tooltip=tip,
                    style=style,
                    layout=widgets.Layout(width="14em"),
                )
            return box(value=default, description=label, tooltip=tip, style=style, layout=widgets.Layout(width="14em"))
        text = "" if default is None else ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return widgets.Text(
            value=text,
            placeholder="default" if default is None else "",
            description=label,
            tooltip=tip,
            style=style,
            layout=widgets.Layout(width="24em"),
        )

    def _apply(self, args):
        """Set the controls from a list like ['--steps', '5', '--flag']; unknown options are an error."""
        args = [str(a) for a in args]
        i = 0
        while i < len(args):
            flag, value = args[i], None
            if "=" in flag:
                flag, value = flag.split("=", 1)
            negated = flag.startswith("--no-") and "--" + flag[5:] in self.specs
            spec = self.specs.get("--" + flag[5:] if negated else flag)
            if spec is None:
                have = ", ".join(self.specs) or "none"
                raise ValueError(f"{self.script} has no option {flag!r}; its options: {have}")
            control = self.options[spec["flag"]]
            if spec["kind"] in ("switch", "bool"):
                control.value = not negated if spec["kind"] == "bool" else True
            else:
                if value is None:
                    i += 1
                    if i >= len(args):
                        raise ValueError(f"option {flag} needs a value")
                    value = args[i]
                control.value = type(control.value)(value) if not isinstance(control, widgets.Dropdown) else value
            i += 1

    def settings(self):
        """The lesson options the controls hold, as torchrun would get them (defaults left out)."""
        args = []
        for flag, spec in self.specs.items():
            value, default = self.options[flag].value, spec["default"]
            if spec["kind"] == "switch":
                args += [flag] if value else []
            elif spec["kind"] == "bool":
                args += [] if value == bool(default) else [flag if value else "--no-" + flag[2:]]
            elif isinstance(value, str):
                shown = (
                    ""
                    if default is None
                    else ",".join(map(str, default))
                    if isinstance(default, list)
                    else str(default)
                )
                args += [] if value.strip() in ("", shown) else [flag, value.strip()]
            elif value != default:
                args += [flag, str(value)]
        return args

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
        problems = []
        n = self.nproc.value
        if not 1 <= n <= MAX_RANKS:
            problems.append(
                f"ranks must be from 1 to {MAX_RANKS} (each rank is a whole Python process with torch loaded); got {n}"
            )
        for flag, spec in self.specs.items():
            value = self.options[flag].value
            if spec["kind"] in ("int", "float") and isinstance(value, str):  # optional number: "" = not given
                if not value.strip():
                    continue
                try:
                    value = (int if spec["kind"] == "int" else float)(value.strip())
                except ValueError:
                    problems.append(
                        f"{flag} must be a{'n integer' if spec['kind'] == 'int' else ' number'} "
                        f"(or empty for the lesson's default); got {value!r}"
                    )
                    continue
            if spec["kind"] == "int" and "low" in spec and not spec["low"] <= value <= spec["high"]:
                problems.append(f"{flag} must be from {spec['low']} to {spec['high']}; got {value}")
        args = self.settings()
        custom = [
            f
            for f, s in self.specs.items()
            if s["kind"] == "text" or s["kind"] in ("int", "float") and isinstance(self.options[f], widgets.Text)
        ]
        if not problems and any(f in args for f in custom):
            # A value only the lesson's own parser can judge (lessonlib.comma_list, ...): ask it.
            code, _, err = _run_argspec("check", self.path, args)
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

        view = HtmlLiveView(self.script, args, self.nproc.value, 1, draw=draw)
        finish = view.finish

        def finished(result):
            finish(result)
            self.result = result

        view.finish = finished
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
