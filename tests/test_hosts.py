"""lessonlib.Hosts (chapter 16): real network namespaces, real processes in them, real tc; no mocks.

What is refused before anything is made; what a `with Hosts(...)` block makes and removes, whether it ends
normally, by an exception, by Ctrl-C or by its process being killed; what can be changed while it runs (a
dropping firewall, a pulled cable, a rate limit); and the two launches chapter 16 shows: one machine's
ranks listening on loopback alone, and one agent per host, each rank's gloo on its host's address.

Namespaces cost about 0.1 s to make; a launch on a host costs seconds (its agent server imports torch), so the
tests that change links share one network, and each launch serves several assertions.
"""

import json
import os
import queue
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path

import psutil
import pytest

import lessonlib
from conftest import still_found
from lessonlib import ROOT
from lessonlib.cluster.hosts import NETNS_ETC, Hosts, unavailable
from lessonlib.processes.bounded import poll_until
from lessonlib.sockets import parse_proc_net_tcp

LESSON = "lessons/16_hosts.py"
NETNS_RUN = Path("/run/netns")  # where `ip netns add` names a namespace
GONE_BOUND = 15.0  # seconds for everything of a network to be removed once its owner ends or dies
START_BOUND = 20.0  # seconds for a child to make its network and say so
NOBODY = 65534

pytestmark = pytest.mark.timeout(180)  # a backstop: every wait below has its own, shorter bound

# A server on a host: listens on `address` at N free ports, prints them, and answers each connection with
# its hostname (which is the host's: Hosts.popen runs it under that name).
LISTEN = """
import json, select, socket, sys
socks = [socket.create_server((sys.argv[1], 0)) for _ in range(int(sys.argv[2]))]
print(json.dumps([s.getsockname()[1] for s in socks]), flush=True)
while True:
    for s in select.select(socks, [], [])[0]:
        c, _ = s.accept()
        c.sendall(socket.gethostname().encode())
        c.close()
"""
# A client on a host: for each port, what connecting to it gave within `timeout` seconds: the server's hostname,
# "timed out" (a dropping firewall: no answer at all) or the error's name ("ConnectionRefusedError", ...).
CONNECT = """
import json, socket, sys
address, timeout, ports = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
out = {}
for port in ports:
    try:
        with socket.create_connection((address, int(port)), timeout=timeout) as c:
            out[port] = c.recv(100).decode()
    except TimeoutError:
        out[port] = "timed out"
    except OSError as e:
        out[port] = type(e).__name__
print(json.dumps(out))
"""
# A process that owns a network and is then interrupted or killed (a notebook kernel): it prints the network's
# token once a process runs on host1, then waits.
OWNER = """
import subprocess, time
from lessonlib.cluster.hosts import Hosts
with Hosts(2) as net:
    net.popen("host1", ["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(net.token, flush=True)
    time.sleep(60)
"""
# Two one-machine launches inside a host, each one's "where" reports printed as a JSON line; the second
# starts when a line arrives on stdin (the test has read the first's, so it knows which sockets were whose).
TWO_LAUNCHES = """
import json, sys
import lessonlib
for env in (None, {"GLOO_SOCKET_IFNAME": "eth0"}):
    run = lessonlib.launch("lessons/16_hosts.py", nproc=2, show="none", timeout=60, env=env)
    run.raise_for_status()
    print(json.dumps(run.reports("where")), flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def can_make_hosts():
    if reason := unavailable():
        pytest.skip(reason)


@pytest.fixture(scope="module")
def net():
    """Two hosts shared by the tests below that change a link and put it back, and by the launches."""
    if reason := unavailable():
        pytest.skip(reason)
    with Hosts(2) as net:
        yield net


def leftovers(token):
    """What of the network `token` still exists: namespaces (/run/netns) and /etc/netns folders."""
    return [str(p) for folder in (NETNS_RUN, NETNS_ETC) if folder.is_dir() for p in folder.glob(f"lh{token}-*")]


def wait_gone(token, procs=(), bound=GONE_BOUND):
    """Wait until nothing of network `token` and none of `procs` (psutil.Process) is left; return what is."""

    def left():
        return leftovers(token) + [f"pid {p.pid}: {_cmdline(p.pid)}" for p in procs if _alive(p)]

    return still_found(left, bound)


def _alive(proc):
    try:  # psutil compares the start time too: a pid used again by another process is not this one
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def read_line(proc, bound, what):
    """The next line `proc` prints (its stdout a text pipe), waiting at most `bound` seconds."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(bound):
            proc.kill()
            pytest.fail(f"no {what} within {bound} s")
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr else ""
        pytest.fail(f"{what}: the process ended first (exit {proc.wait(timeout=5)}):\n{err}")
    return line.strip()


@contextmanager
def listening(net, host, n):
    """A LISTEN server on `host`'s address at `n` free ports (their numbers), killed on leaving."""
    address = net[host].address
    proc = net.popen(host, [sys.executable, "-S", "-c", LISTEN, address, n], stdout=subprocess.PIPE, text=True)
    try:
        yield json.loads(read_line(proc, 10, f"ports of the server on {host}"))
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # Hosts.popen starts it in a session of its own
        proc.wait(timeout=10)
        proc.stdout.close()


def listening_addresses(pid, host):
    """The addresses of the LISTEN sockets on `host`, as process `pid` sees them (empty until it has entered the
    host's namespace, and once it has ended). Read from /proc here, not through a command run on the host
    (`ip netns exec` and a process for each look): too slow to see a rank that lives a fraction of a second."""
    try:
        # `ip netns exec` enters the namespace a few ms after it starts; before, /proc/PID/net is this machine's.
        if os.stat(f"/proc/{pid}/ns/net").st_ino != (NETNS_RUN / host.namespace).stat().st_ino:
            return set()
        text = "".join(Path(f"/proc/{pid}/net/{table}").read_text() for table in ("tcp", "tcp6"))
    except OSError:
        return set()
    return {address for state, address, *_ in parse_proc_net_tcp(text) if state == "LISTEN"}


def connect(net, host, address, ports, timeout=1.0):
    """From `host`, what connecting to each of `ports` at `address` gives (CONNECT), keyed by port."""
    out = net.run(host, [sys.executable, "-S", "-c", CONNECT, address, timeout, *ports], timeout=len(ports) * 5 + 10)
    assert out.returncode == 0, out.output
    return {int(port): said for port, said in json.loads(out.stdout).items()}


def start_owner():
    """A child that makes Hosts(2) and runs `sleep 60` on host1 (OWNER): (its Popen, the token, the sleep and
    the keeper as psutil.Process)."""
    child = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        token = read_line(child, START_BOUND, "token from the child that makes the hosts")
        keeper = [p for p in psutil.Process(child.pid).children() if "_netkeeper" in str(_cmdline(p.pid))]
        assert len(keeper) == 1, f"the child's keeper: {keeper}"

        def sleeping():
            out = subprocess.run(
                ["ip", "netns", "pids", f"lh{token}-host1"], capture_output=True, text=True, timeout=10
            )
            return [p for p in map(int, out.stdout.split()) if _cmdline(p) == ["sleep", "60"]]

        sleeps = poll_until(sleeping, 10, interval=0.05, what=f"`sleep 60` in namespace lh{token}-host1")
        return child, token, [psutil.Process(p) for p in sleeps] + keeper
    except BaseException:
        child.kill()  # its keeper then removes its hosts
        child.communicate(timeout=10)
        raise


def _cmdline(pid):
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


# --------------------------------------------------------------------------- refused before anything is made


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(n=1), "an int from 2 to 4"),
        (dict(n=5), "an int from 2 to 4"),
        (dict(n=True), "an int from 2 to 4"),
        (dict(n=2, names=["a", "a"]), "2 different hostnames"),
        (dict(n=2, names=["host0", "Host_0"]), "lowercase letter, then lowercase letters, digits or '-'"),
        (dict(n=2, names=["host0", "h" * 16]), "1 to 15 characters"),
        (dict(n=2, addresses=["198.18.0.1", "198.18.0.1"]), "cannot share an address"),
        (dict(n=2, addresses=["10.0.0.1", "10.0.0.2"]), "reserved for documentation or benchmarking"),
        (dict(n=2, addresses=["198.18.0.1", "198.18.1.1"]), "in one /24"),
        (dict(n=2, rates=0), "a number from 1 to 10000"),
        (dict(n=2, rates="fast"), "a number from 1 to 10000"),
        (dict(n=2, rates=20000), "a number from 1 to 10000"),
        (dict(n=3, rates=[10, 20]), "a list of 3"),
    ],
)
def test_bad_input_is_refused_saying_what_is_allowed(kwargs, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        Hosts(**kwargs)


@pytest.mark.unit
def test_launch_refuses_closed_hosts_and_torchrun_options_it_sets_itself():
    closed = Hosts(2)  # never started: nothing made
    closed.close()
    with pytest.raises(ValueError, match="closed: launch inside its `with` block"):
        lessonlib.launch(LESSON, nproc=1, hosts=closed, show="none")
    with pytest.raises(ValueError, match="the launcher sets the others"):
        lessonlib.launch(LESSON, nproc=1, torchrun_args=["--nproc-per-node=3"], show="none")
    with pytest.raises(ValueError, match="must be a list of '--option=value' strings"):
        lessonlib.launch(LESSON, nproc=1, torchrun_args="--nnodes=2", show="none")


@pytest.mark.parametrize("module", ["hosts", "slurm"])  # chapter 17's cluster asks Hosts first
def test_without_root_unavailable_names_root(module):
    if os.geteuid() != 0:
        pytest.skip("runs as root to drop to an unprivileged user; this test process is not root")
    # The child drops to nobody itself, after starting as root: the interpreter may be where nobody cannot read.
    code = (
        f"import os; from lessonlib.cluster.{module} import unavailable; "
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); print(unavailable())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "needs root" in out.stdout and f"uid {NOBODY}" in out.stdout, out.stdout


# --------------------------------------------------------------------------- made, used and removed


def test_hosts_are_made_reachable_and_removed(can_make_hosts):
    with Hosts(3) as net:
        token = net.token
        namespaces = [net.switch, *(h.namespace for h in net)]
        assert all((NETNS_RUN / ns).exists() for ns in namespaces), os.listdir(NETNS_RUN)
        for h in net:
            hosts_file = (NETNS_ETC / h.namespace / "hosts").read_text()
            for other in net:
                assert f"{other.address}\t{other.name}\n" in hosts_file, f"{h.name}'s /etc/hosts:\n{hosts_file}"
            named = net.run(h, ["hostname"], timeout=10)
            assert named.stdout.strip() == h.name, named.output
        with listening(net, "host2", 1) as (port,):
            sleeper = net.popen("host2", ["sleep", "60"])  # left running: closing the hosts must end it
            assert connect(net, "host0", net["host2"].address, [port], timeout=5) == {port: "host2"}
    assert sleeper.poll() is not None, "a process started with Hosts.popen outlived its hosts"
    assert leftovers(token) == []


def test_an_exception_in_the_block_removes_everything_and_propagates(can_make_hosts):
    with pytest.raises(RuntimeError, match="raised inside"):
        with Hosts(2) as net:
            token = net.token
            assert leftovers(token)
            raise RuntimeError("raised inside the with block")
    assert leftovers(token) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_an_interrupted_or_killed_owner_leaves_nothing(can_make_hosts, sig):
    """Ctrl-C: the block's exit removes everything. SIGKILL (a notebook kernel killed): no code of the owner
    runs, and the keeper, whose input closed, removes everything, the processes inside the hosts included."""
    child, token, procs = start_owner()
    try:
        os.kill(child.pid, sig)
        child.wait(timeout=GONE_BOUND)
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in child.stderr.read()
        assert wait_gone(token, procs) == []
    finally:
        child.kill()
        child.communicate(timeout=10)


# --------------------------------------------------------------------------- changed while it runs


def test_block_tcp_drops_all_but_the_allowed_ports(net):
    with listening(net, "host0", 2) as (allowed, other):
        address = net["host0"].address
        net.block_tcp("host1", allow=[allowed])
        try:
            # Dropped, not refused: the connection waits for an answer that never comes.
            assert connect(net, "host1", address, [allowed, other]) == {allowed: "host0", other: "timed out"}
        finally:
            net.unblock_tcp("host1")
        assert connect(net, "host1", address, [allowed, other]) == {allowed: "host0", other: "host0"}


def test_a_pulled_cable_cuts_the_host_off(net):
    with listening(net, "host0", 1) as (port,):
        address = net["host0"].address
        net.set_link("host1", False)
        try:
            assert connect(net, "host1", address, [port])[port] != "host0"
        finally:
            net.set_link("host1", True)
        assert connect(net, "host1", address, [port], timeout=5) == {port: "host0"}


def test_set_rate_puts_a_token_bucket_on_both_ends_of_the_cable(net):
    def shapers():
        host = net.run("host1", ["tc", "qdisc", "show", "dev", "eth0"], timeout=10)
        switch = subprocess.run(
            ["ip", "netns", "exec", net.switch, "tc", "qdisc", "show"], capture_output=True, text=True, timeout=10
        )
        return [line for line in host.stdout.splitlines() + switch.stdout.splitlines() if "tbf" in line]

    assert shapers() == []
    net.set_rate("host1", 20)
    try:
        lines = shapers()
        assert len(lines) == 2 and all("rate 20Mbit" in line for line in lines), lines
    finally:
        net.set_rate("host1", None)
    assert shapers() == []


# --------------------------------------------------------------------------- launches


def launches_on(net, host):
    """Run TWO_LAUNCHES on `host`; for each launch, its "where" reports and the addresses that any LISTEN socket
    of the host had while it ran (looked at every 10 ms)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env["PYTHONPATH"] = str(ROOT)
    runs = []
    with tempfile.TemporaryFile("w+") as err:
        child = net.popen(
            host,
            [sys.executable, "-c", TWO_LAUNCHES],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in child.stdout], daemon=True).start()
        deadline = time.monotonic() + 150

        def said():
            err.seek(0)
            return f"(exit {child.poll()}):\n{err.read()}"

        def next_run(seen):
            seen |= listening_addresses(child.pid, host)
            try:
                return json.loads(lines.get_nowait())
            except queue.Empty:
                if child.poll() is not None:
                    pytest.fail(f"the launches on {host} did not end well {said()}")
                return None

        try:
            for _ in range(2):
                seen = set()
                left = max(0.0, deadline - time.monotonic())
                run = poll_until(partial(next_run, seen), left, 0.01, lambda: f"the launches on {host} {said()}")
                runs.append((run, seen))
                child.stdin.write("next\n")
                child.stdin.flush()
            assert child.wait(timeout=30) == 0
        finally:
            with suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
    return runs


def test_one_machine_launch_listens_on_loopback_alone(net):
    """Inside host0, whose hostname resolves to its eth0 address, a plain launch's ranks (gloo) and stores listen
    on 127.0.0.1 only. The control, GLOO_SOCKET_IFNAME=eth0, shows gloo on eth0's address: the check can fail."""
    host = net["host0"]
    (pinned, pinned_seen), (control, control_seen) = launches_on(net, host)
    assert [(rank, where["gloo listens on"]) for rank, where in pinned] == [(0, ["127.0.0.1"]), (1, ["127.0.0.1"])]
    assert all(where["resolves to"] == host.address for _, where in pinned), pinned
    assert pinned_seen == {"127.0.0.1"}, f"LISTEN sockets on {host} during the launch: {pinned_seen}"
    assert [where["gloo listens on"] for _, where in control] == [[host.address]] * 2
    assert host.address in control_seen, f"LISTEN sockets on {host} during the control launch: {control_seen}"


def test_one_agent_per_host(net):
    run = lessonlib.launch(LESSON, nproc=1, hosts=net, timeout=60, show="none")
    run.raise_for_status()
    where = [(rank, w["host"], w["gloo listens on"]) for rank, w in run.reports("where")]
    assert where == [(0, "host0", [net["host0"].address]), (1, "host1", [net["host1"].address])]
