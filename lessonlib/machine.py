"""Facts about this machine that the launcher and the book decide by. A leaf: the standard library only,
and no torch (reading a fact must not touch a GPU driver that a later fork would inherit).

- `nvidia_devices`: whether NVIDIA GPU devices are present (/dev/nvidia0, ...).
- `loopback_interface`: the loopback interface's name ('lo', 'lo0'), where a one-machine launch pins
  gloo and NCCL.
"""

import socket
import sys
from pathlib import Path

IFF_LOOPBACK = 0x8  # an interface's flags (/sys/class/net/NAME/flags): it is a loopback


def nvidia_devices():
    """Whether this machine shows NVIDIA GPU devices (/dev/nvidia0, ...), without importing torch."""
    return sys.platform.startswith("linux") and any(Path("/dev").glob("nvidia[0-9]*"))


def loopback_interface():
    """The name of this machine's loopback interface ('lo' on Linux, 'lo0' on macOS), or None if none is found."""
    if sys.platform.startswith("linux"):
        for flags in sorted(Path("/sys/class/net").glob("*/flags")):
            try:
                if int(flags.read_text(), 16) & IFF_LOOPBACK:
                    return flags.parent.name
            except (OSError, ValueError):
                continue
        return None
    try:
        return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    except OSError:
        return None
