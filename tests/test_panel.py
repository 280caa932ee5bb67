"""The run panel, driven from a real Jupyter kernel: set values, run, read the result, stop, interrupt.

One kernel (the course's kernelspec, as a reader's notebook gets it) runs every test of this module in
turn, through jupyter_client, the way a front end talks to it: code cells, widget clicks from code
(`button.click()` calls the same handlers a click in the browser does), and a real kernel interrupt.
The lessons run under real torchrun and gloo; no widget or torch.distributed piece is mocked. The
panel in a browser is covered by tests/test_browser.py.
"""

import json

import pytest

from lessonlib import ROOT
from lessonlib.processes.bounded import poll_until

jupyter_client = pytest.importorskip("jupyter_client")

KERNEL = json.loads((ROOT / "book" / "01_launch.ipynb").read_text())["metadata"]["kernelspec"]["name"]
CELL_TIMEOUT = 180


class Kernel:
    def __init__(self):
        self.km = jupyter_client.KernelManager(kernel_name=KERNEL)
        self.km.start_kernel(cwd=str(ROOT / "book"))  # where a chapter runs
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code, timeout=CELL_TIMEOUT, allow_error=False):
        """Execute a cell; returns (what it printed, the error name or None)."""
        out, error = [], []

        def hook(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                error.append(f"{content['ename']}: {content['evalue']}\n" + "\n".join(content["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        if reply["content"]["status"] != "ok" and not allow_error:
            pytest.fail(f"cell failed:\n{code}\n{''.join(error)}")
        return "".join(out), (error[0] if error else None)

    def value(self, expression):
        """A JSON value computed in the kernel."""
        out, _ = self.run(f"import json as _j; print(_j.dumps({expression}))")
        return json.loads(out.strip().splitlines()[-1])

    def stop(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    k.run("import lessonlib, time")
    yield k
    k.stop()


def wait_for(kernel, expression, timeout=90):
    """Poll a boolean expression in the kernel until it holds."""
    poll_until(lambda: kernel.value(expression), timeout, 0.5, f"{expression} to be true in the kernel")


@pytest.mark.timeout(300)
def test_set_ranks_and_options_run_and_read_the_result(kernel):
    kernel.run('p = lessonlib.panel("lessons/01_launch.py", nproc=2)')
    options = kernel.value("{f: type(w).__name__ for f, w in p.options.items()}")
    assert options == {
        "--steps": "IntText",
        "--fail-rank": "IntText",
        "--stall-rank": "IntText",
        "--stall-seconds": "FloatText",
        "--pg-timeout": "Text",
    }, options
    kernel.run("p.nproc.value = 3; p.options['--steps'].value = 3")
    assert kernel.value("p.settings()") == ["--steps", "3"]
    assert "torchrun --nproc_per_node=3 lessons/01_launch.py --steps 3" in kernel.value("p.command.value")
    kernel.run("r = p.run()")
    assert kernel.value("[r.ok, r.world_size, r.args, p.result is r]") == [True, 3, ["--steps", "3"], True]
    html = kernel.value("p.output.value")
    assert html.count("<b>rank ") == 3 and "lessonlib-run" in html, html[:500]
    for rank in range(3):
        assert f"rank {rank}" in kernel.value(f"r.ranks[{rank}].stdout"), f"rank {rank} printed nothing"
    assert "ok: torchrun --nproc_per_node=3 lessons/01_launch.py --steps 3" in html
    assert kernel.value("p.status.value") == ""  # the columns' head says it; no second status line


@pytest.mark.timeout(300)
def test_plot_draws_a_picture_with_alt_text_from_each_run(kernel):
    kernel.run(
        "import matplotlib.pyplot as plt\n"
        "def steps_figure(run):\n"
        "    fig, ax = plt.subplots()\n"
        "    ax.bar(range(run.world_size), [len(r.stdout.splitlines()) for r in run.ranks])\n"
        "    return fig\n"
        'v = lessonlib.panel("lessons/01_launch.py", nproc=2, plot=steps_figure, '
        'plot_alt=lambda run: f"lines printed by each of {run.world_size} ranks")\n'
        "v.run()"
    )
    figure = kernel.value("v.figure.value")
    assert (
        figure.startswith('<img src="data:image/png;base64,iVBOR')
        and 'alt="lines printed by each of 2 ranks"' in figure
    )
    assert kernel.value("v.figure.layout.display") is None  # shown
    assert kernel.value("len(plt.get_fignums())") == 0  # closed after drawing: not shown a second time


@pytest.mark.timeout(300)
def test_options_come_from_the_lessons_parser(kernel):
    kernel.run('b = lessonlib.panel("lessons/07_buckets.py", nproc=2, args=["--steps", "4"])')
    kinds = kernel.value("{f: type(w).__name__ for f, w in b.options.items()}")
    assert kinds == {"--layers": "IntText", "--width": "IntText", "--bucket-cap-mb": "Text", "--steps": "IntText"}
    assert kernel.value("b.settings()") == ["--steps", "4"]
    # A dropdown for choices, a checkbox for a flag.
    kernel.run('e = lessonlib.panel("lessons/11_torchrun.py", nproc=2)')
    assert kernel.value("type(e.options['--dataset']).__name__") == "Dropdown"
    assert kernel.value("list(e.options['--dataset'].options)") == ["digits", "mnist"]
    kernel.run('c = lessonlib.panel("lessons/03_eval.py", nproc=2)')
    assert kernel.value("type(c.options['--log-every-batch']).__name__") == "Checkbox"
    kernel.run("c.options['--log-every-batch'].value = True")
    assert kernel.value("c.settings()") == ["--log-every-batch"]


def test_a_script_without_argparse_gets_the_ranks_control_alone(kernel, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('no options here')\n")
    kernel.run(f"g = lessonlib.panel({str(script)!r}, nproc=1)")
    assert kernel.value("[g.options, g.settings(), g.nproc.value]") == [{}, [], 1]


@pytest.mark.timeout(300)
def test_bad_values_are_a_message_and_nothing_starts(kernel):
    kernel.run('q = lessonlib.panel("lessons/07_buckets.py", nproc=2)')
    kernel.run("q.nproc.value = 0")
    _, error = kernel.run("q.run()", allow_error=True)
    assert error and error.startswith("ValueError: ranks must be from 1 to 4"), error
    assert "Nothing was started" in kernel.value("q.status.value")
    assert kernel.value("q.result") is None
    kernel.run("q.nproc.value = 2; q.options['--steps'].value = 99")
    _, error = kernel.run("q.run()", allow_error=True)
    assert error and "--steps must be from 2 to 20; got 99" in error, error
    # A value only the lesson's own parser can judge: it is asked, and its message shown.
    kernel.run("q.options['--steps'].value = 3; q.options['--bucket-cap-mb'].value = 'lots'")
    _, error = kernel.run("q.run()", allow_error=True)
    assert error and "lessons/07_buckets.py rejects these options" in error and "--bucket-cap-mb" in error, error
    assert kernel.value("q.result") is None
    # The Run button with a bad value starts nothing and says why.
    kernel.run("q.run_button.click()")
    assert kernel.value("[q.running, q.result]") == [False, None]
    assert "rejects these options" in kernel.value("q.status.value")


@pytest.mark.timeout(300)
def test_a_failing_rank_is_named_in_the_panel(kernel):
    kernel.run('f = lessonlib.panel("lessons/01_launch.py", nproc=2, args=["--fail-rank", "1"])')
    kernel.run("r = f.run()")
    assert kernel.value("[r.ok, 1 in r.failed_ranks, r.root_cause.rank]") == [False, True, 1]
    head = kernel.value("f.output.value")
    assert "failed on rank(s)" in head and "first failure: rank 1 (RuntimeError" in head, head[:800]
    # The same view as a launch's: one line per rank before the columns, the traceback folded.
    assert head.index('class="lessonlib-summary"') < head.index('class="lessonlib-columns"'), head[:800]
    assert "<b>rank 1</b> <b" in head and "(root cause)" in head and 'class="lessonlib-traceback"' in head


STALL = 120  # seconds rank 1 of _stalling_panel's run stalls
STOP_BOUND = STALL // 2  # a run that ends within it, interrupted, was ended by Stop, not by the stall's end


def _stalling_panel(kernel, name):
    kernel.run(
        f'{name} = lessonlib.panel("lessons/01_launch.py", nproc=2, '
        f'args=["--stall-rank", "1", "--stall-seconds", "{STALL}"])'
    )


@pytest.mark.timeout(300)
def test_stop_button_kills_a_run_started_with_the_run_button(kernel):
    _stalling_panel(kernel, "s")
    kernel.run("s.run_button.click()")
    assert kernel.value("[s.running, s.stop_button.disabled, s.run_button.disabled]") == [True, False, True]
    wait_for(kernel, "'busy for' in s.output.value")  # the ranks are running, rank 1 stalls
    kernel.run(f"s.stop_button.click(); res = s.wait({STOP_BOUND})")
    assert kernel.value("res is not None"), f"the run went on {STOP_BOUND} s after Stop"
    assert kernel.value("[res.interrupted, res.ok, s.running, s.result is res]") == [True, False, False, True]
    assert "stopped: every process of the run was killed" in kernel.value("s.status.value")
    # The autouse leak check (tests/conftest.py) fails this test if any process of the run survived:
    # the kernel inherits this test session's marker, and so does every process it launches.


@pytest.mark.timeout(300)
def test_a_kernel_interrupt_stops_a_background_run(kernel):
    _stalling_panel(kernel, "t")
    kernel.run("t.run_button.click()")
    wait_for(kernel, "'busy for' in t.output.value")
    kernel.km.interrupt_kernel()  # the kernel is idle: ipykernel would ignore SIGINT
    wait_for(kernel, "not t.running", timeout=30)
    assert kernel.value("[t.result.interrupted, t.result.ok]") == [True, False]


@pytest.mark.timeout(300)
def test_a_kernel_interrupt_stops_panel_run_in_a_cell(kernel):
    _stalling_panel(kernel, "u")
    msg_id = kernel.kc.execute("u.run()")
    poll_until(  # the cell is busy: watch its output files, not the kernel
        lambda: kernel.km.is_alive() and _cell_progress(kernel, msg_id), 90, 1, "the panel to show rank 1 stalled"
    )
    kernel.km.interrupt_kernel()
    reply = kernel.kc.get_shell_msg(timeout=60)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kernel.kc.get_shell_msg(timeout=60)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert kernel.value("[u.running, u.result.interrupted]") == [False, True]
    assert "interrupted: every process of the run was killed" in kernel.value("u.status.value")


def _cell_progress(kernel, msg_id):
    """True once the running cell's panel shows the stalled rank (widget updates arrive on iopub)."""
    while True:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.2)
        except Exception:  # queue.Empty
            return False
        data = msg["content"].get("data", {}) if msg["msg_type"] == "comm_msg" else {}
        value = data.get("state", {}).get("value", "")
        if isinstance(value, str) and "busy for" in value:
            return True
