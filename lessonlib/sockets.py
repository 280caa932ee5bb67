"""The TCP sockets a process holds, read from /proc (Linux): what a rank listens on and talks to (chapter 16).

    own_tcp_sockets()   # [(state, local address, local port, remote address, remote port), ...]

Each rank of chapter 16's lessons reports its own sockets this way: the /proc/PID/net/tcp tables of its
network namespace, narrowed to the sockets its file descriptors hold. The standard library only.
"""

import ipaddress
import os
from pathlib import Path

TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "06": "TIME_WAIT", "0A": "LISTEN", "08": "CLOSE_WAIT"}


def parse_proc_net_tcp(text):
    """Rows of /proc/net/tcp (and tcp6) as (state, local address, local port, remote address, remote port)."""
    rows = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[0] == "sl":
            continue
        (local, remote), state = fields[1:3], fields[3]
        rows.append((TCP_STATES.get(state, state), *_address(local), *_address(remote)))
    return rows


def own_tcp_sockets(pid="self"):
    """The TCP sockets process `pid` holds open (this one by default), as parse_proc_net_tcp's rows: its
    file descriptors' socket inodes looked up in its network namespace's /proc/PID/net/tcp and tcp6."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    text = ""
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            if line.split()[9] in inodes:
                text += line + "\n"
    return parse_proc_net_tcp(text)


def _address(field):
    hexaddr, hexport = field.split(":")
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # four 32-bit words, each in host (little-endian) order
        ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
        ip = ip.ipv4_mapped or ip
    return str(ip), int(hexport, 16)
