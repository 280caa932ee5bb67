"""The run folder: how `lessonlib.launch` and the processes it starts talk to each other (chapter 1).

`launch` makes a fresh folder for every run, `lessonlib-run-PID-START-ID-...` in the temporary folder
(FOLDER_PREFIX, the launching process's pid and start time, so that the next launch can sweep a folder
whose launcher died with its agents: lessonlib.processes.owners; then the start of the run's id), and
starts each process of the run with the variables below in its environment (and the run's id as its
mark: lessonlib.processes.marks). Every rank writes into the folder; the launcher reads it back into a
RunResult, then removes it:

    rank{r}.stdout, rank{r}.stderr  rank r's file descriptors 1 and 2 (lessonlib.launcher._rank_main)
    rank{r}.start.json              {"rank", "pid", "time"}: written as the rank starts its script
    rank{r}.exit.json               {"rank", "pid", "start", "end", "exitcode", "nofile"}, with "exc_type",
                                    "message" and "traceback" when the script failed: written as it ends
                                    ("nofile": its RLIMIT_NOFILE then, [soft, hard])
    rank{r}.reports.jsonl           one {"tag", "value"} line per lessonlib.report(tag, value)
    agent{n}.log                    torchrun agent n's own output (its banner, its failure summary)
    torchrun{n}/                    torchrun's log folder (without one it leaves a folder in /tmp per run)

A record is written whole or not at all (a temporary file, then a rename), so the launcher never reads
half of one. Every rank imports this module before its script runs: it needs the standard library only.
"""

import json
import os

FOLDER_PREFIX = "lessonlib-run-"  # the run folder's name in the temporary folder starts so
PREFIX = "LESSONLIB_"  # launch(env=...) refuses names with this prefix: they belong to lessonlib
RUN_DIR_VAR = "LESSONLIB_RUN_DIR"  # the run folder
LAUNCHER_PID_VAR = "LESSONLIB_LAUNCHER_PID"  # the torchrun agent dies with this process (_agent_main)
BACKEND_VAR = "LESSONLIB_BACKEND"  # launch(backend=...): the backend lessonlib.setup() then uses
# A one-machine launch: the address every TCPStore server of the run listens on (the agent binds them
# there: lessonlib.launcher.torchpatches.bind_store_servers), and the variables that pin gloo and NCCL
# to the loopback interface.
STORES_ON_VAR = "LESSONLIB_STORES_ON"
# `python -m lessonlib check` (lessonlib.check): the folder of the probe's records, and its stall bound in
# seconds. Set through launch(env=...), which keeps LESSONLIB_* to itself: hence another prefix.
CHECK_DIR_VAR = "DDPCHECK_DIR"
CHECK_STALL_VAR = "DDPCHECK_STALL"
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
STREAMS = ("stdout", "stderr")


def output_file(run_dir, rank, stream):
    """Where rank `rank` writes its `stream` ('stdout' or 'stderr')."""
    return os.path.join(run_dir, f"rank{rank}.{stream}")


def agent_log(run_dir, node):
    """Where torchrun agent `node` writes its own stdout and stderr."""
    return os.path.join(run_dir, f"agent{node}.log")


def torchrun_log_dir(run_dir, node):
    return os.path.join(run_dir, f"torchrun{node}")


def _record(run_dir, rank, kind):
    return os.path.join(run_dir, f"rank{rank}.{kind}.json")


def _write_json(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # atomic: the launcher never reads half a record


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_start(run_dir, rank, record):
    """A rank starts its script. An exit record of an earlier attempt (torchrun --max-restarts started
    the rank again) goes first: the rank's outcome is its last attempt's."""
    try:
        os.remove(_record(run_dir, rank, "exit"))
    except FileNotFoundError:
        pass
    _write_json(_record(run_dir, rank, "start"), record)


def read_start(run_dir, rank):
    """The rank's start record, or None if it has not started its script."""
    return _read_json(_record(run_dir, rank, "start"))


def write_exit(run_dir, rank, record):
    _write_json(_record(run_dir, rank, "exit"), record)


def read_exit(run_dir, rank):
    """The rank's exit record, or None if it left none (still running, or killed)."""
    return _read_json(_record(run_dir, rank, "exit"))


def _reports_file(run_dir, rank):
    return os.path.join(run_dir, f"rank{rank}.reports.jsonl")


def add_report(run_dir, rank, tag, value):
    with open(_reports_file(run_dir, rank), "a") as f:
        f.write(json.dumps({"tag": tag, "value": value}) + "\n")


def read_reports(run_dir, rank):
    """[(tag, value), ...] in the order the rank reported them."""
    lines = read_text(_reports_file(run_dir, rank)).splitlines()
    return [(item["tag"], item["value"]) for item in map(json.loads, lines)]


def read_text(path):
    """A file of the run as text ('' if it was never written); bytes that are not UTF-8 are replaced."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
