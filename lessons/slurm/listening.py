"""torchrun --standalone --nproc_per_node=1 lessons/slurm/listening.py

The addresses this rank's launcher listens on (chapter 17): each TCP socket its parent process (torchrun's
agent) holds in the LISTEN state, read from /proc (Linux). `::` or `0.0.0.0` is every address of the
machine: anyone who can reach the port can connect, and torch.distributed asks for no password.
"""

import os

from lessonlib.sockets import own_tcp_sockets


def main():
    launcher = os.getppid()
    for state, address, port, _, _ in own_tcp_sockets(launcher):
        if state == "LISTEN":
            print(f"launcher (pid {launcher}) listens on {address} port {port}", flush=True)


if __name__ == "__main__":
    main()
