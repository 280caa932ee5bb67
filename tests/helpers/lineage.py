"""Each rank prints its parent's (the agent's) pid, the agent's parent's pid, the agent's command line
and the agent's parent's command line (tests/test_agentserver.py)."""

import os

import psutil

agent = psutil.Process(os.getppid())
print(agent.pid, agent.ppid(), " ".join(agent.cmdline()), "|", " ".join(agent.parent().cmdline()), flush=True)
