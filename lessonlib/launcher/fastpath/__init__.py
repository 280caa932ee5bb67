"""The launcher's fast path: the same agents and ranks, started without importing torch again for each.

- `agentserver`: one server per launching process imports torch once; each launch's torchrun agent is
  forked from it (`python -m lessonlib.launcher.fastpath.agentserver` in `ps`).
- `forkrank`: the agent forks each rank from itself, and the child resets what a fresh interpreter would
  have; `become` turns a fork into what `python -u -m MODULE` would be.

Only `lessonlib.launcher.agents.start_agent` calls into it; its reference path is a fresh process.
"""
