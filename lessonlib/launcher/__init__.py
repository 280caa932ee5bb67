"""Launching: what runs a lesson under torchrun and brings back what each rank did (chapter 1).

- `core`: `launch` itself, from the checked request to the finished RunResult.
- `request`: the request checked before anything starts (ranks, timeout, script, backend, hosts).
- `result`: `RunResult`, `RankOutput` and `LaunchError`, the data and verdicts of a finished run;
  `status`: `RunStatus`, how each rank ended.
- `runfolder`: the run folder's protocol (variables and file names) between the launcher and its ranks.
- `faults`: the machine's faults in one line: a TMPDIR missing, a temporary folder read-only or full
  (before anything starts), a disk that filled, too many open files, a rank likely OOM-killed (after).
- `agents`: `start_agent`, the one way a launch starts its torchrun agent: a fresh process, or the same
  agent forked from a server that imported torch once (`fastpath`: the agent server, forked ranks).
- `torchpatches`: every change made inside torch, each guarded against a torch that changed.
- `watch`: a run's ranks while it runs; their stacks, then every process of the run killed by its mark.
- `ports`: a free port for a rendezvous, held until used.
- `_agent_main`, `_rank_main`: what torchrun's agent and each rank run (`python -m`).

How a run looks is lessonlib.view's; processes are found and killed by lessonlib.processes.
Nothing is imported here: a rank imports `_rank_main` and `runfolder` alone, and pays for nothing else.
"""
