"""lessonlib.reserve_port: ports held for a launch, one or several consecutive ones (chapter 1 and 12)."""

import errno
import socket

import pytest

import lessonlib
from lessonlib.launcher.ports import _bound

pytestmark = pytest.mark.unit


def plain_bind(port):
    """Bind without SO_REUSEADDR, as most programs do: the error number, or 0 when the bind succeeded."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return e.errno
    return 0


@pytest.mark.parametrize("count", [1, 2, 4])
def test_every_reserved_port_is_held_until_the_block_ends(count):
    with lessonlib.reserve_port(count=count) as base:
        assert [plain_bind(base + k) for k in range(count)] == [errno.EADDRINUSE] * count
        with socket.socket() as s:  # a server that sets SO_REUSEADDR (TCPStore, debugpy) can still listen
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", base + count - 1))
            s.listen()
    assert [plain_bind(base + k) for k in range(count)] == [0] * count


@pytest.mark.parametrize("count", [1, 3])
def test_a_port_another_reservation_holds_is_never_taken_again(count):
    """Two sockets that both set SO_REUSEADDR before binding may bind one port, neither listening: the
    hazard, shown first. reserve_port's sockets bind first and set SO_REUSEADDR after, so a port that
    another reservation holds refuses them (ports k >= 1 of count=N are bound by number, not by the kernel)."""
    with lessonlib.reserve_port(count=count) as base:
        last = base + count - 1
        with socket.socket() as eager:  # SO_REUSEADDR first, then bind: it gets the held port too
            eager.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            eager.bind(("127.0.0.1", last))
        for port in range(base, base + count):
            with pytest.raises(OSError) as refused:
                _bound("127.0.0.1", port).close()
            assert refused.value.errno == errno.EADDRINUSE


def test_a_bad_count_is_refused():
    for bad in (0, 65, 1.5, "2"):
        with pytest.raises(ValueError, match="count must be a whole number of ports from 1 to 64"):
            with lessonlib.reserve_port(count=bad):
                pass
