"""Every message chapter 12 quotes is backed: asserted by a cell of the chapter, or looked up in torch.

The chapter runs its failures and asserts what they print; what no run on the page prints (NCCL's words,
a default read in torch's source, an older release's wording) is listed in lessonlib.notebook.ncclmessages
and looked up in the installed torch by tests/test_nccl_messages.py. Here the chapter's own text is read:
each message-like quote between backticks, and each torch setting it names, must be one of the two, so a
quote added without either fails. Also checked here: the defaults and options the chapter states for
torchrun, py-spy and Python's multiprocessing.
"""

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lessonlib import ROOT
from lessonlib.notebook import ncclmessages

CHAPTER = ROOT / "book" / "12_debugging.ipynb"

# A quote that starts so is a command or code, not a message.
COMMANDS = {"torchrun", "python", "py-spy", "sudo", "pkill", "pgrep", "kill", "docker", "if", "torchfrtrace",
            "scp", "ssh", "srun", "grep", "mkdir", "export", "make", "nvidia-smi", "dmesg"}  # fmt: skip
# Quotes of other programs' words, which no torch holds.
NOT_TORCH = {"Out of memory: Killed process N"}  # the Linux kernel's log, for the out-of-memory killer


def _flat(text):
    return re.sub(r"\s+", " ", text).strip()


def chapter_text():
    """(markdown, code) of chapter 12: the prose without its fenced blocks and roles, and every code cell."""
    cells = json.loads(CHAPTER.read_text())["cells"]
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    prose = re.sub(r"```.*?```", "", prose, flags=re.S)  # shell examples
    prose = re.sub(r"\{[\w:-]+\}`[^`]*`", "", prose)  # {ref}`...`, {term}`...`, {glue:text}`...`
    return prose, code


def quoted(prose):
    """Every span between backticks, a line break inside one read as a space."""
    return [_flat(span) for span in re.findall(r"`([^`]+)`", prose)]


def is_code(span):
    words = span.split()
    first = words[0]
    return (
        first in COMMANDS
        or first.startswith(("-", "!", "$"))
        or "/" in first
        or first.endswith(".py")
        or re.match(r"^\w+=", first) is not None  # VAR=value command
        or re.match(r"^[\w.]+\(", span) is not None  # a call
        or " = " in span
    )


def backed_by_code(span, code):
    # A message with its variable parts (ranks, pids, times: N, K, PID, ...) left out: every fixed fragment
    # must be in the chapter's code, as written or escaped for a regular expression.
    flat_code = _flat(code)
    text = re.sub(r"^\w+(Error|Exception|Warning): ", "", span)
    fragments = [f.strip(" .,:") for f in re.split(r"\.\.\.|\b(?:N|K|PID)\b|<[^>]*>", text)]
    fragments = [f for f in fragments if len(f) >= 4]
    return bool(fragments) and all(f in flat_code or re.escape(f) in flat_code for f in fragments)


def registered():
    said = {_flat(q.said) for q in ncclmessages.QUOTES}
    parts = [_flat(p) for m in ncclmessages.MESSAGES for p in m.printed + sum((lk.parts for lk in m.lookups), ())]
    return said, parts


@pytest.mark.unit
def test_every_message_the_chapter_quotes_is_asserted_or_looked_up():
    prose, code = chapter_text()
    said, parts = registered()
    unbacked = []
    for span in quoted(prose):
        if span in said or span in NOT_TORCH:
            continue
        setting = re.fullmatch(r"(TORCH\w*)(=\S*)?", span)
        if setting:  # a torch setting: used by a cell, or looked up in torch
            if setting[1] not in code and setting[1] not in said:
                unbacked.append(span)
            continue
        if len(span.split()) < 3 or is_code(span):
            continue
        if not backed_by_code(span, code) and not any(span.strip(". ") in p for p in parts):
            unbacked.append(span)
    assert not unbacked, (
        "chapter 12 quotes these without asserting them or listing them in lessonlib/notebook/ncclmessages.py "
        f"(QUOTES, with the file of torch that holds each): {unbacked}"
    )


@pytest.mark.unit
def test_every_listed_quote_is_in_the_chapter():
    prose, _ = chapter_text()
    flat = _flat(prose)
    stale = [q.said for q in ncclmessages.QUOTES if _flat(q.said) not in flat]
    assert not stale, f"listed in ncclmessages.QUOTES but no longer in chapter 12: {stale}"


@pytest.mark.unit
def test_the_scanner_catches_an_unbacked_quote():
    code = 'assert "Timed out waiting 4000ms" in error\nassert re.search(r"DataLoader worker \\(pid \\d+\\)", e)'
    assert backed_by_code("Timed out waiting ...ms", code)
    assert backed_by_code("RuntimeError: Timed out waiting 4000ms", code)
    assert not backed_by_code("Heartbeat monitor timed out", code)
    assert is_code("torchrun --nproc_per_node=2 lessons/12_hang.py") and is_code("dist.barrier(timeout=t) now")
    assert not is_code("Connection closed by peer")


@pytest.mark.unit
def test_torchrun_defaults_the_chapter_states(tmp_path, monkeypatch):
    from torch.distributed.launcher.api import LaunchConfig  # noqa: PLC0415

    # LaunchConfig() makes torchrun's torchelastic_* log folder as it is built: in this test's folder, not in /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    from torch.distributed.run import get_args_parser  # noqa: PLC0415

    args = get_args_parser().parse_args(["script.py"])
    assert args.monitor_interval == 0.1  # "every --monitor-interval (0.1 s by default)"
    assert args.role == "default"  # the "default" of "[default1]:"
    assert args.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert args.max_restarts == 0
    if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == 30


# Not unit tests: each starts a process (py-spy; a multiprocessing child).
def test_py_spy_record_follows_subprocesses_only_when_asked():
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        pytest.skip("py-spy is not installed here (it is in requirements.txt)")
    done = subprocess.run([py_spy, "record", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and re.search(r"--subprocesses\s+Profile subprocesses", done.stdout), done.stdout


def _stdin_of_child(queue):
    queue.put((sys.stdin.fileno(), os.path.samestat(os.fstat(sys.stdin.fileno()), os.stat(os.devnull))))


def test_a_multiprocessing_child_reads_dev_null_as_sys_stdin():
    # Why dist.breakpoint's pdb opens /dev/stdin: multiprocessing gives its children /dev/null as sys.stdin,
    # while file descriptor 0 (what /dev/stdin names) stays the parent's.
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_stdin_of_child, args=(queue,))
    child.start()
    fd, is_devnull = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and fd != 0 and is_devnull
