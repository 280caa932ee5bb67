"""A free TCP port that stays yours until you are done with it (chapter 1).

Asking the kernel for port 0 and closing the socket is the usual way to find a free port, but the port
is then free for anyone: two launches started at once can pick the same one. `reserve_port` keeps the
socket bound (not listening) with SO_REUSEADDR for as long as the `with` block runs. A server that
also sets SO_REUSEADDR (torch's TCPStore does) can still listen on it, while the kernel never hands
that port to another bind, so concurrent launches cannot collide.
"""

import contextlib
import socket


@contextlib.contextmanager
def reserve_port(host="127.0.0.1"):
    """Yield a port on `host` that no other bind can take until the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        yield sock.getsockname()[1]
    finally:
        sock.close()
