""".vscode/launch.json works with this repository (chapter 12).

The file parses as plain JSON; every configuration has what VS Code needs for its type; every module,
script and compound member it names exists; the attach ports follow the lesson's rule (rank r listens
on --debugpy-port + r). Then the launch configurations run for real, their module and args under
debugpy (`python -m debugpy --listen ...`, where VS Code goes through debugpy's launcher), with a small
Debug Adapter Protocol client standing in for VS Code:

- "torchrun: this file, 1 rank", with a lesson as the file: torchrun runs under debugpy, and the rank
  it starts is announced as a child session (debugpy's subProcess); the client attaches to it, a
  breakpoint in the lesson stops the rank, `rank` is evaluated there, and the run then exits 0. So a
  launch configuration of torchrun debugs the ranks too, not only the agent.
- "torchrun: 12_debug_one_rank, 2 ranks waiting for a debugger" (on a free port instead of 5678):
  each rank says it listens on its port, the client attaches to each (the "attach to rank r"
  configurations' request), and the run exits 0 once both have a debugger.

Every run is bounded (lessonlib.run_bounded: everything it started is killed afterwards).
"""

import importlib.util
import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

import lessonlib
from lessonlib import ROOT, run_bounded
from lessonlib.processes.bounded import poll_until

LAUNCH_JSON = ROOT / ".vscode" / "launch.json"
LESSON = ROOT / "lessons" / "12_debug_one_rank.py"
TIMEOUT = 120  # seconds per run; a run that waits for a debugger that never comes ends here
NEEDS = {"launch": ("module", "program"), "attach": ("connect", "processId")}  # one of these per request


def load():
    return json.loads(LAUNCH_JSON.read_text())


def config(name):
    found = [c for c in load()["configurations"] if c["name"] == name]
    assert len(found) == 1, f"{LAUNCH_JSON}: {len(found)} configurations named {name!r}"
    return found[0]


def expand(value, file):
    """VS Code's variables, as it substitutes them when it starts a configuration."""
    return value.replace("${workspaceFolder}", str(ROOT)).replace("${file}", str(file))


def module_file(name):
    """The file of module `name` (a.b.c), found without importing it (importing torch takes seconds)."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.origin, f"no package {top}"
    path = Path(spec.origin).parent.joinpath(*rest) if rest else Path(spec.origin)
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


@pytest.mark.unit
def test_launch_json_is_plain_json_with_what_vscode_needs():
    data = load()  # json.loads: no comments, no trailing commas
    assert data.get("version") == "0.2.0", data.get("version")
    names = [c["name"] for c in data["configurations"]]
    assert len(set(names)) == len(names), f"duplicate names: {names}"
    for c in data["configurations"]:
        assert c.get("type") == "debugpy" and c.get("request") in NEEDS, c
        assert any(key in c for key in NEEDS[c["request"]]), f"{c['name']}: needs one of {NEEDS[c['request']]}"
        if "module" in c:
            assert module_file(c["module"]).is_file(), f"{c['name']}: no module {c['module']}"
        for arg in c.get("args", []):
            if arg.endswith(".py") and "${" not in arg:
                assert (ROOT / expand(c.get("cwd", ""), "")).joinpath(arg).is_file(), f"{c['name']}: no {arg}"
        if "cwd" in c:
            assert Path(expand(c["cwd"], "")).is_dir(), c["cwd"]
    for compound in data.get("compounds", []):
        missing = set(compound["configurations"]) - set(names)
        assert compound["configurations"] and not missing, f"{compound['name']}: no configuration {missing}"


@pytest.mark.unit
def test_attach_ports_are_the_waiting_ranks_ports():
    """The lesson's rule: rank r listens on --debugpy-port + r; each 'attach to rank r' connects there."""
    args = config("torchrun: 12_debug_one_rank, 2 ranks waiting for a debugger")["args"]
    base = int(args[args.index("--debugpy-port") + 1])
    nproc = int(re.search(r"--nproc_per_node=(\d+)", " ".join(args)).group(1))
    assert "port + rank" in LESSON.read_text(), "the lesson no longer listens on --debugpy-port + rank"
    attach = [c for c in load()["configurations"] if c["request"] == "attach"]
    assert {c["name"]: c["connect"]["port"] for c in attach} == {f"attach to rank {r}": base + r for r in range(nproc)}
    assert all(c["connect"]["host"] == "127.0.0.1" for c in attach), attach
    compound = load()["compounds"][0]["configurations"]
    assert sorted(compound) == sorted(c["name"] for c in attach), compound


class Dap:
    """A Debug Adapter Protocol client over TCP: what VS Code speaks to debugpy."""

    def __init__(self, port, deadline):
        self.deadline, self.seq, self.buf = deadline, 0, b""
        refused = []

        def connected():  # the debugger may not listen yet
            try:
                return socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError as e:
                refused[:] = [e]
                return None

        self.sock = poll_until(
            connected, max(0.0, deadline - time.monotonic()), 0.2, lambda: f"a debugger on port {port} ({refused})"
        )
        self.sock.settimeout(max(0.1, deadline - time.monotonic()))

    def request(self, command, **arguments):
        self.seq += 1
        body = json.dumps({"seq": self.seq, "type": "request", "command": command, "arguments": arguments}).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def _receive(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("the debug adapter closed the connection")
        self.buf += chunk

    def message(self):
        while b"\r\n\r\n" not in self.buf:
            self._receive()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"Content-Length:\s*(\d+)", head, re.I).group(1))
        while len(self.buf) < length:
            self._receive()
        body, self.buf = self.buf[:length], self.buf[length:]
        return json.loads(body)

    def wait(self, event=None, response=None):
        """The next event named `event`, or the response to request number `response` (which must succeed)."""
        while time.monotonic() < self.deadline:
            m = self.message()
            if event and m.get("event") == event:
                return m
            if response and m.get("type") == "response" and m.get("request_seq") == response:
                assert m["success"], m
                return m
        raise TimeoutError(f"no {event or 'response'} before the deadline")

    def attach(self, breakpoints=None, **arguments):
        """initialize, attach, (setBreakpoints,) configurationDone: VS Code's attach sequence."""
        self.wait(response=self.request("initialize", adapterID="debugpy", clientID="test", pathFormat="path"))
        attached = self.request("attach", justMyCode=False, **arguments)
        self.wait(event="initialized")
        for path, lines in (breakpoints or {}).items():
            self.request("setBreakpoints", source={"path": str(path)}, breakpoints=[{"line": n} for n in lines])
        self.wait(response=self.request("configurationDone"))
        self.wait(response=attached)


def in_thread(fn):
    """Run fn in a thread; returns a dict that holds its result or its exception once the thread ends."""
    out = {}

    def body():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    out["thread"] = thread
    return out


def debugpy_command(c, port, file, wait):
    """The command VS Code runs for launch configuration `c`: its module and args under debugpy."""
    sub = str(c.get("subProcess", True)).lower()
    head = [sys.executable, "-m", "debugpy", "--listen", f"127.0.0.1:{port}", "--configure-subProcess", sub]
    return head + (["--wait-for-client"] if wait else []) + ["-m", c["module"], *(expand(a, file) for a in c["args"])]


def own_tmp(tmp_path):
    """This process's environment with a TMPDIR of the test's: torchrun's torchelastic_* log folder lands
    there, not in /tmp for good, as it would for a reader's run without --log-dir."""
    return {**os.environ, "TMPDIR": str(tmp_path)}


@pytest.mark.timeout(TIMEOUT + 30)
def test_one_rank_configuration_debugs_the_rank_under_torchrun(tmp_path):
    c = config("torchrun: this file, 1 rank")
    line = next(i for i, text in enumerate(LESSON.read_text().splitlines(), 1) if "dist.all_reduce(tensor)" in text)
    deadline = time.monotonic() + TIMEOUT

    def vscode(port):
        agent = Dap(port, deadline)
        agent.attach(subProcess=True)  # the torchrun agent's session
        child = agent.wait(event="debugpyAttach")["body"]  # the rank, announced as a child process
        rank = Dap(port, deadline)
        rank.attach({LESSON: [line]}, subProcessId=child["subProcessId"], subProcess=True)
        stopped = rank.wait(event="stopped")["body"]
        frames = rank.wait(response=rank.request("stackTrace", threadId=stopped["threadId"]))["body"]["stackFrames"]
        value = rank.wait(response=rank.request("evaluate", expression="rank", frameId=frames[0]["id"]))
        rank.request("setBreakpoints", source={"path": str(LESSON)}, breakpoints=[])
        rank.wait(response=rank.request("continue", threadId=stopped["threadId"]))
        return stopped["reason"], frames[0]["name"], frames[0]["line"], value["body"]["result"]

    with lessonlib.reserve_port() as port:
        client = in_thread(lambda: vscode(port))
        done = run_bounded(
            debugpy_command(c, port, LESSON, wait=True), TIMEOUT, cwd=expand(c["cwd"], LESSON), env=own_tmp(tmp_path)
        )
    client["thread"].join(5)
    assert "error" not in client, f"{client.get('error')!r}\n{done.output[-3000:]}"
    assert client["result"] == ("breakpoint", "step_mean", line, "0"), client["result"]
    assert done.returncode == 0 and not done.timed_out, done.output[-3000:]
    assert "3 steps on 1 ranks" in done.output, done.output[-3000:]


@pytest.mark.timeout(TIMEOUT + 30)
def test_ranks_wait_for_a_debugger_on_their_ports_and_go_on_once_attached(tmp_path):
    c = config("torchrun: 12_debug_one_rank, 2 ranks waiting for a debugger")
    nproc = int(re.search(r"--nproc_per_node=(\d+)", " ".join(c["args"])).group(1))
    deadline = time.monotonic() + TIMEOUT

    def vscode(base):  # the compound 'attach to ranks 0 and 1', on this test's ports
        for r in range(nproc):
            Dap(base + r, deadline).attach(connect={"host": "127.0.0.1", "port": base + r})
        return nproc

    with lessonlib.reserve_port(count=nproc + 1) as agent_port:
        base = agent_port + 1
        c = {**c, "args": [str(base) if a == "5678" else a for a in c["args"]]}
        client = in_thread(lambda: vscode(base))
        done = run_bounded(
            debugpy_command(c, agent_port, LESSON, wait=False),
            TIMEOUT,
            cwd=expand(c["cwd"], LESSON),
            env=own_tmp(tmp_path),
        )
    client["thread"].join(5)
    assert "error" not in client, f"{client.get('error')!r}\n{done.output[-3000:]}"
    for r in range(nproc):
        assert f"rank {r}: debugpy listening on 127.0.0.1:{base + r}, waiting" in done.output, done.output[-3000:]
        assert f"rank {r}: debugger attached" in done.output, done.output[-3000:]
    assert done.returncode == 0 and not done.timed_out, done.output[-3000:]
