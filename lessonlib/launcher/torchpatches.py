"""torch's TCPStore servers on the loopback address alone, for a launch on one machine (chapter 16).

A one-machine launch puts the rendezvous on 127.0.0.1 and pins gloo to the loopback interface
(GLOO_SOCKET_IFNAME, set by lessonlib.launcher.core), but a TCPStore server listens on every address
of the machine whatever host name it is given: the torchrun agent's rendezvous store, the store it
shares with the ranks, and rank 0's own where the agent's is not shared. On a laptop on a LAN, every
lesson would accept connections from the LAN while it runs. When the launch sets LOOPBACK_VAR, the agent
(lessonlib.launcher._agent_main) replaces torch's TCPStore, where torchrun's modules look it up, by a
subclass whose server listens on a socket bound to 127.0.0.1 (TCPStore's own `master_listen_fd`); clients,
and everything else, are unchanged. Ranks forked from the agent (lessonlib.launcher._forkrank) inherit the
replacement. A fresh rank (a machine with NVIDIA GPUs) does not: importing torch before the lesson does
would make it differ from what a plain torchrun starts; its own store, which only a launch with
max_restarts makes (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), is then torch's.
"""

import os
import socket
import sys

LOOPBACK_VAR = "LESSONLIB_STORES_ON"  # the address every TCPStore server of the run listens on
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # where gloo and NCCL listen (the launcher pins them)
# TCPStore's parameters, in order, as torch 2.14.1 takes them positionally.
PARAMETERS = (
    "host_name",
    "port",
    "world_size",
    "is_master",
    "timeout",
    "wait_for_workers",
    "multi_tenant",
    "master_listen_fd",
    "use_libuv",
)
MODULES = (  # where torchrun, its rendezvous and init_process_group look TCPStore up
    "torch.distributed",
    "torch.distributed.rendezvous",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
)


def listen_socket(address, port):
    """A TCP socket listening on (address, port), port 0 for any; SO_REUSEADDR, as TCPStore's own are."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def install_if_asked():
    """Install the replacement when this run asked for it (LOOPBACK_VAR); a no-op otherwise."""
    address = os.environ.get(LOOPBACK_VAR)
    if not address:
        return
    import importlib

    import torch.distributed as dist

    real = getattr(dist.TCPStore, "_lessonlib_real", dist.TCPStore)

    class TCPStore(real):
        _lessonlib_real = real

        def __init__(self, *args, **kwargs):
            kwargs.update(zip(PARAMETERS, args))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                try:
                    sock = listen_socket(address, int(kwargs.get("port") or 0))
                except OSError as e:
                    # As TCPStore's own server fails: torchrun's rendezvous, when two agents on one machine
                    # both try to host it, catches this and joins the other's store as a client.
                    raise dist.DistNetworkError(f"TCPStore server on {address}:{kwargs.get('port')}: {e}") from e
                kwargs["port"] = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns it from here
            super().__init__(**kwargs)

    TCPStore.__qualname__ = TCPStore.__name__ = "TCPStore"
    TCPStore.__module__ = real.__module__
    for name in MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        if getattr(module, "TCPStore", None) is not None:
            module.TCPStore = TCPStore
