"""A free TCP port that stays yours until you are done with it (chapter 1).

Asking the kernel for port 0 and closing the socket is the usual way to find a free port, but the port
is then free for anyone: two launches started at once can pick the same one. `reserve_port` keeps the
socket bound (not listening) with SO_REUSEADDR for as long as the `with` block runs. A server that
also sets SO_REUSEADDR (torch's TCPStore and debugpy do) can still listen on it, while the kernel never
hands that port to another bind that asks for any free port, so concurrent launches cannot collide.
`count=N` holds N consecutive ports, for a script whose rank r listens on PORT + r (chapter 12's
debugger on every rank).
"""

import contextlib
import socket

TRIES = 50  # attempts at finding `count` consecutive free ports before giving up


def _bound(host, port):
    """A socket bound to `port` (0: any free one) that no other socket held, then open to SO_REUSEADDR.

    The bind comes first, without SO_REUSEADDR, so it fails if any socket at all holds the port, another
    reservation's included (two sockets that both set SO_REUSEADDR may bind one port, neither listening).
    SO_REUSEADDR is set afterwards, so that a server that sets it too can still listen there.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def reserve_port(host="127.0.0.1", count=1):
    """Yield a port on `host` that no other bind can take until the block ends; with count=N, the first
    of N consecutive ports, every one of them held."""
    if not isinstance(count, int) or not 1 <= count <= 64:
        raise ValueError(f"count must be a whole number of ports from 1 to 64; got {count!r}")
    for _ in range(TRIES):
        socks = [_bound(host, 0)]
        base = socks[0].getsockname()[1]
        try:
            socks += [_bound(host, base + k) for k in range(1, count)]
        except (OSError, OverflowError):  # one of them is taken, or past 65535: try another base
            for sock in socks:
                sock.close()
            continue
        try:
            yield base
        finally:
            for sock in socks:
                sock.close()
        return
    raise RuntimeError(f"found no {count} consecutive free ports on {host} in {TRIES} tries")
