"""Several hosts on one Linux machine: network namespaces joined by a switch (chapter 16).

    with lessonlib.Hosts(2) as net:                    # host0 198.18.0.1, host1 198.18.0.2
        net.run("host1", ["python", "-c", "import socket; print(socket.gethostname())"])
        run = lessonlib.launch("lessons/16_hosts.py", nproc=2, hosts=net)  # a torchrun agent per host

Each host is a network namespace with its own loopback, one interface `eth0` with an address, its own
routes, its own hostname (each command runs in a UTS namespace of its own, named after the host) and
its own `/etc/hosts` (`ip netns exec` puts `/etc/netns/NAMESPACE/hosts` in its place). Every `eth0` is
one end of a veth pair whose other end is a port of a bridge, in a namespace of its own (the switch):
nothing of the network is in this machine's own namespace, so its traffic never leaves the namespaces
made here, and two networks made at once cannot collide, even with the same addresses.

What can be changed while it runs, as on real machines: a host's link rate (`set_rate`, `tc tbf` on
both ends of its cable), its link up or down (`set_link`), its `/etc/hosts` (`write_hosts_file`), and
which TCP ports it may reach (`block_tcp`: tc filters that drop every TCP packet it sends but those to or
from the ports allowed, as a dropping firewall would; no iptables needed).

Cleanup. Before it creates a namespace or a file, `Hosts` tells a keeper process (lessonlib/cluster/_netkeeper.py,
in a session of its own) its name. On leaving the `with` block, normally, by an exception or by Ctrl-C,
and also when this process dies without running any code (a notebook kernel killed), the keeper's input
closes, and it kills every process inside the namespaces, deletes them and removes the files.
When the owner and its keeper are both killed (SIGKILL to both, the out-of-memory killer), nothing runs
to remove them: so every name the keeper is told is also written, after a line naming the owner and the
keeper (pid and start time, lessonlib.processes.owners), to a registry file of the network,
REGISTRY/TOKEN.jsonl, and the next `Hosts` to start removes, as the keeper would have, every network
whose owner and keeper are both gone. (The names stay as they were: a namespace's is free, but a
link's is at most 15 characters, too short for a pid and a start time.)

Needs Linux, iproute2 (`ip`, `tc`), util-linux (`unshare`) and root (CAP_NET_ADMIN and CAP_SYS_ADMIN).
`unavailable()` says which is missing, or None; `Hosts(...)` raises HostsUnavailable with that reason.
"""

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..processes import owners
from . import _netkeeper

MIN_HOSTS, MAX_HOSTS = 2, 4
INTERFACE = "eth0"  # each host's one interface, as on a typical Linux server
RENDEZVOUS_PORT = 29400  # torchrun's c10d default; free in a fresh namespace, which nothing else shares
DEFAULT_NETWORK = "198.18.0.0/24"  # RFC 2544: set aside for benchmarking, never routed on the internet
RESERVED = tuple(
    ipaddress.ip_network(n)
    for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "198.18.0.0/15")  # RFC 5737, RFC 2544
)
MIN_RATE, MAX_RATE = 1, 10_000  # Mbit/s
NAME = re.compile(r"[a-z][a-z0-9-]{0,14}$")
KEEPER = Path(__file__).with_name("_netkeeper.py")
NETNS_ETC = Path("/etc/netns")
REGISTRY = Path("/run/lessonlib/hosts")  # TOKEN.jsonl per network: its owner, its keeper, what they made
CLOSE_BOUND = 30.0  # seconds for the keeper to remove everything
COMMAND_BOUND = 20.0  # seconds for one `ip` or `tc` command

_probe = {}


class HostsUnavailable(RuntimeError):
    """This machine or process cannot make network namespaces; the message says why."""


@dataclass(frozen=True)
class Host:
    name: str  # its hostname
    address: str  # the address of its eth0
    namespace: str  # the network namespace (`ip netns exec NAMESPACE ...`)
    interface: str = INTERFACE
    port: int = RENDEZVOUS_PORT  # where a rendezvous on this host listens (launch(hosts=...))

    def __str__(self):
        return self.name

    def prefix(self):
        """The command that runs what follows it on this host: in its network namespace, under its hostname."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.name,
        ]


def unavailable():
    """Why this process cannot make hosts here (a sentence), or None when it can. Tried once per process:
    a namespace with a veth pair, a bridge and a rate limit is made and removed."""
    if "reason" not in _probe:
        _probe["reason"] = _why_not()
    return _probe["reason"]


def _why_not():
    if not sys.platform.startswith("linux"):
        return f"network namespaces are a Linux feature; this is {sys.platform}"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (Debian: apt install iproute2 util-linux)"
    if os.geteuid() != 0:
        uid = os.geteuid()
        return f"making network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); this process runs as uid {uid}"
    ns = f"lhprobe{uuid.uuid4().hex[:8]}"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
        ["ip", "-n", ns, "link", "add", "probe2", "type", "bridge"],
        [
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            "probe0",
            "root",
            "tbf",
            "rate",
            "10mbit",
            "burst",
            "64kb",
            "latency",
            "50ms",
        ],
        ["ip", "netns", "exec", ns, "unshare", "--uts", "true"],
    ]
    try:
        for step in steps:
            out = subprocess.run(step, capture_output=True, text=True, timeout=COMMAND_BOUND)
            if out.returncode != 0:
                return f"`{' '.join(step)}` failed: {(out.stderr or out.stdout).strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=COMMAND_BOUND)


def sweep_dead_networks(registry=REGISTRY):
    """Remove every network whose owner and keeper are both gone, as its keeper would have (processes inside
    killed, namespaces deleted, files and folders removed), by its registry file; return the tokens removed.
    A network whose owner or keeper still runs is left to them."""
    swept = []
    for path in sorted(registry.glob("*.jsonl")) if registry.is_dir() else []:
        try:
            lines = path.read_text().splitlines()
            head = json.loads(lines[0])
        except (OSError, ValueError, IndexError):
            continue
        if any(_runs(head.get(who)) for who in ("owner", "keeper")):
            continue
        namespaces, paths = [], []
        for line in lines[1:]:
            try:
                item = json.loads(line)
            except ValueError:  # a line cut short by the owner's death: nothing was made after it
                continue
            (namespaces if "netns" in item else paths).append(item.get("netns") or item.get("path"))
        if not _netkeeper.remove([n for n in namespaces if n], [p for p in paths if p and p != str(path)]):
            owners.remove_path(str(path))
            swept.append(path.stem)
    return swept


def _runs(owner_tag):
    """True while the process a tag ('PID-START') names runs; a missing tag counts as running (left alone)."""
    if not owner_tag:
        return True
    pid, start = owner_tag.split("-")
    return owners.alive(pid, start)


def _rate_problem(rate):
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not MIN_RATE <= rate <= MAX_RATE:
        return f"a rate is in Mbit/s, a number from {MIN_RATE} to {MAX_RATE} (or None: no limit); got {rate!r}"
    return None


def _check(n, names, addresses, rates):
    """The hosts' names, addresses and rates, or a ValueError saying what is wrong and what is allowed."""
    if isinstance(n, bool) or not isinstance(n, int) or not MIN_HOSTS <= n <= MAX_HOSTS:
        raise ValueError(f"n (how many hosts) must be an int from {MIN_HOSTS} to {MAX_HOSTS}; got {n!r}")
    if isinstance(names, str):
        raise ValueError(f"names must be a list of {n} hostnames, e.g. ['alpha', 'beta']; got the string {names!r}")
    names = [f"host{i}" for i in range(n)] if names is None else list(names)
    if len(names) != n or len(set(names)) != n:
        raise ValueError(f"names must be {n} different hostnames; got {names!r}")
    for name in names:
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(
                "a host name is 1 to 15 characters: a lowercase letter, then lowercase letters, digits or '-'; "
                f"got {name!r}"
            )
    if addresses is None:
        net = ipaddress.ip_network(DEFAULT_NETWORK)
        addresses = [str(net.network_address + i + 1) for i in range(n)]
    addresses = list(addresses)
    if len(addresses) != n:
        raise ValueError(f"addresses must be {n} IPv4 addresses, one per host; got {addresses!r}")
    parsed = []
    for a in addresses:
        try:
            ip = ipaddress.IPv4Address(a)
        except ValueError:
            raise ValueError(f"{a!r} is not an IPv4 address") from None
        if not any(ip in r for r in RESERVED) or str(ip).endswith((".0", ".255")):
            raise ValueError(
                f"{a} is not a host address in a range reserved for documentation or benchmarking "
                f"({', '.join(map(str, RESERVED))}): these hosts must never clash with a real network"
            )
        parsed.append(ip)
    if len(set(parsed)) != n:
        raise ValueError(f"two hosts cannot share an address; got {addresses!r}")
    if len({ipaddress.ip_network(f"{ip}/24", strict=False) for ip in parsed}) != 1:
        raise ValueError(f"the hosts share one switch, so their addresses must be in one /24; got {addresses!r}")
    rates = [None] * n if rates is None else list(rates) if isinstance(rates, (list, tuple)) else [rates] * n
    if len(rates) != n:
        raise ValueError(f"rates must be one rate for all hosts or a list of {n}; got {rates!r}")
    for r in rates:
        if problem := _rate_problem(r):
            raise ValueError(problem)
    return names, [str(ip) for ip in parsed], rates


class Hosts:
    """`n` hosts (2 to 4) on one switch; see the module's docstring. Use it as a context manager.
    `Hosts.unavailable()` says why hosts cannot be made here, or None."""

    unavailable = staticmethod(unavailable)

    def __init__(self, n=2, *, names=None, addresses=None, rates=None):
        self._names, self._addresses, self._rates = _check(n, names, addresses, rates)
        self.token = uuid.uuid4().hex[:8]
        self.switch = f"lh{self.token}-switch"
        self.hosts = [
            Host(name, address, f"lh{self.token}-{name}") for name, address in zip(self._names, self._addresses)
        ]
        self._keeper = None
        self.registry = None  # REGISTRY/TOKEN.jsonl once started
        self._procs = []
        self._lock = threading.Lock()
        self.closed = False

    # --- lifetime ---------------------------------------------------------------------------------------

    def __enter__(self):
        return self.start()

    def start(self):
        """Make the hosts (what entering the `with` block does), for a notebook whose cells cannot share a
        `with` block; then call close(). If this process dies first, the keeper removes them (if the keeper
        is killed with it, the next Hosts to start does)."""
        if self._keeper is not None:
            raise RuntimeError("these hosts are started already")
        if reason := unavailable():
            raise HostsUnavailable(reason)
        sweep_dead_networks()
        self._keeper = subprocess.Popen(
            [sys.executable, "-S", str(KEEPER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            self._register()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def keep(self, path):
        """Put `path` (a file or folder, made after this call) in the keeper's care: it is removed with
        the hosts, even when this process dies first (chapter 17's cluster keeps its folder this way)."""
        self._live()
        self._tell_keeper(path=str(path))

    def _tell_keeper(self, **item):
        """Tell the keeper (and the registry) of a namespace or a path, before it is made."""
        line = json.dumps(item) + "\n"
        with open(self.registry, "a") as f:
            f.write(line)
        self._keeper.stdin.write(line)
        self._keeper.stdin.flush()

    def _register(self):
        """The network's registry file, whole or not at all: a first line naming the owner (this process) and
        the keeper; the keeper is told of the file first, so it removes it last."""
        self.registry = REGISTRY / f"{self.token}.jsonl"
        REGISTRY.mkdir(parents=True, exist_ok=True)
        head = {"owner": owners.tag(), "keeper": owners.tag(self._keeper.pid)}
        tmp = self.registry.with_suffix(".tmp")
        tmp.write_text(json.dumps(head) + "\n")
        os.replace(tmp, self.registry)
        self._tell_keeper(path=str(self.registry))

    def _build(self):
        self._tell_keeper(netns=self.switch)
        _cmd("ip", "netns", "add", self.switch)
        _cmd("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _cmd("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            self._tell_keeper(netns=host.namespace)
            _cmd("ip", "netns", "add", host.namespace)
            _cmd("ip", "-n", host.namespace, "link", "set", "lo", "up")
            port = self._port(host)
            veth = ["veth", "peer", "name", port, "netns", self.switch]  # the cable: eth0 here, `port` on the switch
            _cmd("ip", "link", "add", INTERFACE, "netns", host.namespace, "type", *veth)
            _cmd("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
            _cmd("ip", "-n", host.namespace, "link", "set", INTERFACE, "up")
            _cmd("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _cmd("ip", "-n", self.switch, "link", "set", port, "up")
            folder = NETNS_ETC / host.namespace
            self._tell_keeper(path=str(folder))
            folder.mkdir(parents=True, exist_ok=True)
            self.write_hosts_file(host, self.default_hosts_file())
            self._queues(host, self._rates[i])

    def close(self):
        """Remove everything (also what the keeper alone would remove); return the keeper's report. Idempotent."""
        if self.closed or self._keeper is None:
            self.closed = True
            return None
        self.closed = True
        with self._lock:
            procs, self._procs = self._procs, []
        from ..processes.bounded import kill_session

        for proc in procs:
            kill_session(proc)
        from ..launcher.agents import forget_hosts  # lessonlib.launch's agent servers on these hosts

        forget_hosts([h.prefix() for h in self.hosts])
        try:  # communicate() closes the keeper's input: it removes everything now
            out, _ = self._keeper.communicate(timeout=CLOSE_BOUND)
        except subprocess.TimeoutExpired:
            self._keeper.kill()
            out, _ = self._keeper.communicate()
        report = json.loads(out.splitlines()[-1]) if out.strip() else {"left": ["the keeper did not report"]}
        if report["left"]:
            raise RuntimeError(f"could not remove: {', '.join(report['left'])}")
        return report

    # --- the hosts ------------------------------------------------------------------------------------

    def __getitem__(self, key):
        return self._host(key)

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self):
        return len(self.hosts)

    def _host(self, host):
        if isinstance(host, Host) and host in self.hosts:
            return host
        for h in self.hosts:
            if host in (h.name, self.hosts.index(h)):
                return h
        raise ValueError(f"no host {host!r} here; the hosts are {', '.join(h.name for h in self.hosts)}")

    def _port(self, host):
        return f"p-{self._host(host).name}"[:15]

    def _live(self):
        if self.closed or self._keeper is None:
            raise RuntimeError("these hosts are gone: use them inside their `with` block")

    def prefix(self, host):
        """The command that runs what follows it on `host` (Host.prefix)."""
        return self._host(host).prefix()

    def run(self, host, argv, timeout=30, *, env=None, input=None):
        """Run `argv` on `host`, bounded (lessonlib.processes.bounded.run_bounded); returns its Finished."""
        from ..processes.bounded import run_bounded

        self._live()
        return run_bounded([*self.prefix(host), *map(str, argv)], timeout, env=env, input=input)

    def popen(self, host, argv, **kwargs):
        """Start `argv` on `host` in a session of its own (subprocess.Popen's keyword arguments); it is
        killed, with everything it started, when these hosts are closed, if it has not ended before."""
        self._live()
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen([*self.prefix(host), *map(str, argv)], start_new_session=True, **kwargs)
        with self._lock:
            self._procs.append(proc)
        return proc

    # --- what can change while it runs ----------------------------------------------------------------

    def default_hosts_file(self):
        """Every host's name with its address, as a cluster's DNS or /etc/hosts would have them."""
        return "127.0.0.1\tlocalhost\n" + "".join(f"{h.address}\t{h.name}\n" for h in self.hosts)

    def write_hosts_file(self, host, text):
        """Make `text` the /etc/hosts of `host` (for commands started from now on)."""
        self._live()
        path = NETNS_ETC / self._host(host).namespace / "hosts"
        path.write_text(text)

    def set_rate(self, host, mbit):
        """Limit `host`'s link to `mbit` Mbit/s each way (tc tbf on both ends of its cable); None lifts the limit."""
        self._live()
        if problem := _rate_problem(mbit):
            raise ValueError(problem)
        for ns, dev in self._ends(host):
            tc = ("ip", "netns", "exec", ns, "tc", "qdisc")
            _cmd(
                *tc, "del", "dev", dev, "parent", "1:1", "handle", "10:"
            )  # tc replaces a qdisc by one of its kind only
            _cmd(*tc, "add", "dev", dev, "parent", "1:1", "handle", "10:", *_shaper(mbit))

    def set_link(self, host, up):
        """Plug `host`'s cable in (True) or pull it (False)."""
        self._live()
        _cmd("ip", "-n", self._host(host).namespace, "link", "set", INTERFACE, "up" if up else "down")

    def block_tcp(self, host, allow=()):
        """Drop every TCP packet `host` sends but those to or from the ports in `allow`, silently, as a firewall
        that drops would: a connection to a port not allowed waits for an answer that never comes. (tc on the
        host's eth0: a u32 filter sends such packets to a queue of length 0.) Traffic inside one host is not
        affected, nor is traffic already queued."""
        self._live()
        ns = self._host(host).namespace
        self.unblock_tcp(host)
        for port in allow:
            for field in ("sport", "dport"):
                _tc_filter(ns, "1", "match", "ip", field, str(int(port)), "0xffff", "flowid", "1:1")
        _tc_filter(ns, "2", "match", "ip", "protocol", "6", "0xff", "flowid", "1:2")

    def unblock_tcp(self, host):
        """Remove block_tcp's filters."""
        self._live()
        ns = self._host(host).namespace
        _cmd("ip", "netns", "exec", ns, "tc", "filter", "del", "dev", INTERFACE, "parent", "1:")

    def _ends(self, host):
        host = self._host(host)
        return ((host.namespace, INTERFACE), (self.switch, self._port(host)))

    def _queues(self, host, mbit):
        """Each end of `host`'s cable: an htb qdisc whose class 1:1 (every packet, unless a filter says otherwise)
        is the link, tbf-limited or not, and whose class 1:2 is a queue of length 0, where block_tcp sends what
        it drops. (This kernel has htb, tbf and u32, but neither the prio qdisc nor tc's drop action.)"""
        for ns, dev in self._ends(host):
            tc = ("ip", "netns", "exec", ns, "tc")
            _cmd(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
            for cls in ("1:1", "1:2"):
                _cmd(
                    *tc,
                    "class",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "1:",
                    "classid",
                    cls,
                    "htb",
                    "rate",
                    f"{MAX_RATE * 4}mbit",
                )
            _cmd(*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *_shaper(mbit))
            _cmd(*tc, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "pfifo", "limit", "0")


def _shaper(mbit):
    """The qdisc of a link at `mbit` Mbit/s: tbf, with a burst of at least one 64 KiB GSO packet (else 1 ms of
    traffic) and at most 100 ms of queue; or, unlimited, a plain FIFO."""
    if mbit is None:
        return ["pfifo", "limit", "1000"]
    burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.001))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"]


def _tc_filter(ns, prio, *match):
    _cmd(
        "ip",
        "netns",
        "exec",
        ns,
        "tc",
        "filter",
        "add",
        "dev",
        INTERFACE,
        "parent",
        "1:",
        "protocol",
        "ip",
        "prio",
        prio,
        "u32",
        *match,
    )


def _cmd(*argv):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_BOUND)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {(out.stderr or out.stdout).strip()}")
    return out.stdout
