"""What a rank sees of its own process as it starts, reported for tests/test_forkrank.py to compare a rank
forked from the torchrun agent (lessonlib.launcher.fastpath.forkrank) with a fresh `python` one."""

import atexit
import os
import random
import signal
import sys
import warnings

at_start = {
    "lessonlib modules": sorted(
        m for m in sys.modules if m.startswith("lessonlib.") and m != "lessonlib.launcher._rank_main"
    ),
    "argv": sys.argv[1:],
    "path[0] is the script's folder": sys.path[0] == os.path.dirname(os.path.abspath(__file__)),
    "path": sys.path,
    "working folder": os.getcwd(),
    "signals": {
        s.name: repr(signal.getsignal(s))
        for s in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE, signal.SIGUSR2)
    },
    "stdout write_through": sys.stdout.write_through,
    "torchrun variables": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS")},
    "inductor cache variable": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    "session leader": os.getsid(0) == os.getpid(),
}
import numpy  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401 - as a training rank's first optimizer step imports it

# The filters torch and torch._dynamo add as they load: a forked rank has them from its first line.
at_start["filters"] = [(f[0], str(f[1] and f[1].pattern), f[2].__name__, str(f[3])) for f in warnings.filters]

import lessonlib  # noqa: E402

ctx = lessonlib.setup(device="cpu")
own, parent = (" ".join(psutil.Process(pid).cmdline()) for pid in (os.getpid(), os.getppid()))
at_start.update(
    {
        "intra-op threads": torch.get_num_threads(),
        "parent is the agent": any(
            m in parent for m in ("lessonlib.launcher._agent_main", "lessonlib.launcher.fastpath.agentserver")
        ),
        "command line": next(
            m
            for m in (
                "lessonlib.launcher.fastpath.agentserver",
                "lessonlib.launcher._agent_main",
                "lessonlib.launcher._rank_main",
            )
            if m in own
        ),
    }
)
draws = {"torch": torch.rand(1).item(), "numpy": float(numpy.random.rand()), "random": random.random()}
gathered = [None] * ctx.world_size
torch.distributed.all_gather_object(gathered, draws)
if ctx.rank == 0:
    at_start["seeds differ across ranks"] = {k: len({g[k] for g in gathered}) == ctx.world_size for k in draws}
lessonlib.report("state", at_start)
out = open(os.path.join(os.environ["FRESH_STATE_DIR"], f"unclosed{ctx.rank}.txt"), "w")  # noqa: SIM115
out.write("written, never closed: flushed when the interpreter ends")
atexit.register(print, "atexit ran")
lessonlib.teardown()
sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
