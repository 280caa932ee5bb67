"""Chapter 16's claims about plain torchrun across hosts that the page states but does not run: real
network namespaces (lessonlib.Hosts), a real `python -m torch.distributed.run` on each host, no launcher.

- A host whose torchrun starts after a `--nnodes=1:2` job's first round is complete is not left out: the
  running agent sees a node waiting, stops its workers and starts a new round with both hosts (torch
  2.14.1's elastic/agent/server/api.py, `_invoke_run`: "Detected N new nodes ... will restart worker
  group"). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (what lessonlib.launch sets whenever it passes
  --max-restarts) both hosts then finish in a world of 2. With 2.14.1's default, the agents' shared store,
  the new round hangs: the agent that stays rank 0 never publishes MASTER_ADDR for it, and both agents
  fail once the rendezvous's read_timeout (60 s by default; 5 s here) has passed.
- `--local-addr`: without it, the node that becomes the rendezvous's rank 0 publishes its hostname as
  MASTER_ADDR; where the other nodes cannot resolve that name (containers), their ranks cannot reach the
  store. With each node's address passed as --local-addr the same job runs.

Each torchrun runs under `processes.started`, which kills every process it started when its block ends;
the conftest's check then finds none left, and torchrun's log folders are in a temporary folder.
"""

import os
import re
import sys
import tempfile
import time
from contextlib import ExitStack, suppress

import pytest

from lessonlib import ROOT, started
from lessonlib.cluster.hosts import Hosts, unavailable
from lessonlib.processes.bounded import poll_until

BOUND = 60.0  # seconds for any one torchrun of these tests; every wait inside has its own, shorter one
READ_TIMEOUT = 5  # the rendezvous's store operations (torch's default: 60 s)
# A worker that outlives the late host's start-up (~10 s at 0.1 s a step; 16_host_drop.py all-reduces each step).
LONG_TRAINING = ["lessons/16_host_drop.py", "--steps", "100", "--step-time", "0.1"]

pytestmark = pytest.mark.timeout(240)  # a backstop: every wait below has its own, shorter bound


@pytest.fixture(scope="module")
def net():
    if reason := unavailable():
        pytest.skip(reason)
    with Hosts(2) as net:
        yield net


def torchrun(net, host, *options, script):
    """The command line a reader types on `host`: plain torchrun, a c10d rendezvous on host0's address."""
    return [
        *net.prefix(host),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={net.hosts[0].address}:29400",
        "--rdzv-id=ch16",
        *options,
        *script,
    ]


def environment(**extra):
    # LOGLEVEL=INFO: the agents print their rendezvous results ("group_world_size=1") and restarts.
    return {**os.environ, "PYTHONPATH": str(ROOT), "LOGLEVEL": "INFO", **extra}


def wait_all(procs, bound):
    """The exit codes of `procs` (Started) once all have ended or `bound` seconds have passed (None: running)."""
    with suppress(TimeoutError):
        poll_until(lambda: all(p.proc.poll() is not None for p in procs), bound)
    return [p.proc.poll() for p in procs]


def late_host(net, env):
    """host0's torchrun (--nnodes=1:2) alone; host1's once host0's first round is complete and its worker
    runs. Returns (exit codes, outputs, seconds from host1's start to the end)."""
    options = ["--nnodes=1:2", f"--rdzv-conf=last_call_timeout=1,read_timeout={READ_TIMEOUT}"]
    with tempfile.TemporaryDirectory() as logs, ExitStack() as stack:
        first = stack.enter_context(
            started(torchrun(net, "host0", *options, f"--log-dir={logs}/0", script=LONG_TRAINING), BOUND, env=env)
        )
        first.poll_until(lambda: "group_world_size=1" in first.output(), timeout=BOUND)
        t0 = time.monotonic()
        second = stack.enter_context(
            started(torchrun(net, "host1", *options, f"--log-dir={logs}/1", script=LONG_TRAINING), BOUND, env=env)
        )
        codes = wait_all([first, second], BOUND)
        return codes, [first.output(), second.output()], time.monotonic() - t0


def test_a_late_host_joins_and_both_finish_in_a_world_of_2_with_a_store_per_round(net):
    codes, (out0, out1), _ = late_host(net, environment(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    said = f"host0:\n{out0[-3000:]}\nhost1:\n{out1[-3000:]}"
    assert codes == [0, 0], said
    assert "Detected 1 new nodes from group_rank=0; will restart worker group" in out0, said
    assert re.search(r"rank \d on host0: 100 steps done in a world of 2", out0), said
    assert re.search(r"rank \d on host1: 100 steps done in a world of 2", out1), said
    # A change of membership is not a failure: torchrun's default --max-restarts=0 did not stop it.
    assert re.search(r"max_restarts\s+: 0\n", out0), said


def test_with_the_default_shared_store_the_late_hosts_round_hangs_until_read_timeout(net):
    env = environment()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    codes, (out0, out1), seconds = late_host(net, env)
    said = f"host0:\n{out0[-3000:]}\nhost1:\n{out1[-3000:]}"
    assert codes == [1, 1], said
    assert "Detected 1 new nodes from group_rank=0; will restart worker group" in out0, said
    timeout = f"DistStoreError: wait timeout after {READ_TIMEOUT * 1000}ms"
    # host1 waits for round 1's MASTER_ADDR, which host0 (rank 0 again, its store kept) never writes;
    # host0 waits for host1's role in round 1, which host1 writes only after that.
    # host1's own wait ends the same way, unless host0 gave up a moment earlier and took its store along
    # (which comes first depends on the machine's load).
    closed = "DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed."
    assert re.search(timeout + r", keys: /torch\.rendezvous\.ch16\.1/MASTER_ADDR", out1) or closed in out1, said
    assert re.search(timeout + r", keys: /torch\.rendezvous\.ch16\.1/torchelastic/role_info/", out0), said
    assert "steps done" not in out0 + out1, said
    assert READ_TIMEOUT < seconds < READ_TIMEOUT + 30, f"ended {seconds:.1f} s after host1 started\n{said}"


@pytest.mark.parametrize("local_addr", [False, True], ids=["hostname", "local-addr"])
def test_where_hostnames_do_not_resolve_local_addr_is_what_the_ranks_reach(net, local_addr):
    # Each host knows its own name only, as containers do: the other's name does not resolve.
    for h in net:
        net.write_hosts_file(h, f"127.0.0.1\tlocalhost\n{h.address}\t{h.name}\n")
    try:
        with tempfile.TemporaryDirectory() as logs, ExitStack() as stack:
            runs = [
                stack.enter_context(
                    started(
                        torchrun(
                            net,
                            h,
                            "--nnodes=2",
                            *([f"--local-addr={h.address}"] if local_addr else []),
                            f"--log-dir={logs}/{h.name}",
                            script=["lessons/16_hosts.py", "--pg-timeout", "3"],
                        ),
                        BOUND,
                        env=environment(),
                    )
                )
                for h in net
            ]
            codes = wait_all(runs, BOUND)
            outputs = [r.output() for r in runs]
    finally:
        for h in net:
            net.write_hosts_file(h, net.default_hosts_file())
    said = "\n".join(f"{h.name}:\n{out[-3000:]}" for h, out in zip(net, outputs))
    if local_addr:
        assert codes == [0, 0], said
        assert all("all-reduce of rank+1 over 2 ranks = 3, as expected" in out for out in outputs), said
        assert "master_addr=198.18.0." in outputs[0], said
    else:
        assert codes == [1, 1], said
        # Rank 0's node published its hostname; the other node's rank cannot turn it into an address.
        published = re.search(r"master_addr=(host\d)", outputs[0])[1]
        other = outputs[1 - int(published[-1])]
        assert f"The client socket has timed out after 3000ms while trying to connect to ({published}," in other, said
        assert "Temporary failure in name resolution" in other or "Name or service not known" in other, said
