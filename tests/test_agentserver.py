"""lessonlib.launcher.fastpath.agentserver: a launch forks its torchrun agent from one server per launching
process, which has imported torch once; a launch with an environment of its own gets a fresh agent; the
server ends with the process that started it. (A killed kernel's server, agent and ranks: tests/test_faults.py.)"""

import os
import re
import subprocess
import sys
import uuid

import pytest

import lessonlib
from conftest import HELPERS
from lessonlib import ROOT
from lessonlib.launcher.fastpath import forkrank
from lessonlib.launcher.fastpath.agentserver import SERVER_MODULE
from lessonlib.processes.marks import marked_processes

pytestmark = pytest.mark.skipif(
    not (forkrank.wanted({}) and sys.platform.startswith("linux")),
    reason="agents are forked only where ranks are (Linux, no NVIDIA devices, LESSONLIB_FRESH_RANKS unset)",
)

LINEAGE = HELPERS / "lineage.py"  # each rank prints its agent's lineage


def lineage(run):
    run.raise_for_status()
    return [r.stdout.strip() for r in run.ranks]


def test_launches_fork_their_agents_from_one_server(monkeypatch):
    monkeypatch.delenv(forkrank.FRESH_VAR, raising=False)
    script = LINEAGE
    runs = [lineage(lessonlib.launch(script, nproc=2, timeout=120, show="none")) for _ in range(2)]
    servers = set()
    for lines in runs:
        agent, server, agent_cmd, server_cmd = re.match(r"(\d+) (\d+) (.*) \| (.*)", lines[0]).groups()
        assert lines[1] == lines[0], "both ranks share one agent"
        assert SERVER_MODULE in agent_cmd and SERVER_MODULE in server_cmd, lines
        servers.add(int(server))
    assert len(servers) == 1, f"each launch started a server of its own: {runs}"
    assert runs[0] != runs[1], "the two launches had one agent"


def test_a_launch_with_an_environment_of_its_own_gets_a_fresh_agent():
    script = LINEAGE
    lines = lineage(lessonlib.launch(script, nproc=2, timeout=120, show="none", env={"SOME_SETTING": "1"}))
    agent_cmd, parent_cmd = re.match(r"\d+ \d+ (.*) \| (.*)", lines[0]).groups()
    assert "lessonlib.launcher._agent_main" in agent_cmd and SERVER_MODULE not in parent_cmd, lines


def test_the_forked_agent_prints_what_a_fresh_one_does(tmp_path, monkeypatch):
    """torchrun's own output (its banner, its warnings) is the same from a forked agent as from a fresh one."""
    script = tmp_path / "quiet.py"
    script.write_text("print('hello')\n")
    outputs = {}
    for fresh in (False, True):
        if fresh:
            monkeypatch.setenv(forkrank.FRESH_VAR, "1")
        run = lessonlib.launch(script, nproc=2, timeout=120, show="none").raise_for_status()
        outputs[fresh] = re.sub(r"\d+", "N", run.launcher_output)
    assert outputs[False] == outputs[True], outputs


def test_the_server_ends_with_the_process_that_started_it(tmp_path):
    tag = uuid.uuid4().hex
    code = (
        "import lessonlib, psutil, os\n"
        f"lessonlib.launch({str(ROOT / 'lessons' / '01_launch.py')!r}, nproc=2, timeout=120, show='none')"
        ".raise_for_status()\n"
        f"print(sum({SERVER_MODULE!r} in ' '.join(c.cmdline()) for c in psutil.Process().children()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "SERVER_TEST_TAG": tag},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "1", "the launch did not go through a server"
    assert marked_processes(tag, var="SERVER_TEST_TAG") == []
