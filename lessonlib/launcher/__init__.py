"""The launcher side: what runs a lesson under torchrun and shows each rank's output.

- `core`: `launch` itself, from the checked request to the finished RunResult.
- `spec`: the request checked before anything starts (ranks, timeout, script, backend), `ROOT`.
- `result`: `RunResult` and `RankOutput`, the data and verdicts of a finished run.
- `display`: all text about a run: the live views (HTML and terminal), the failure story, tables.
- `processes`: finding, watching and killing a run's processes by their marker; `run_bounded`.
- `terminal`: `python -m lessonlib run/list`, the terminal runner.
- `ports`: a free port for a rendezvous; the loopback interface's name.
- `hosts`: `Hosts`, several machines on one: network namespaces on a switch (chapter 16); `_netkeeper`
  removes them when their owner is done or dies; `_loopback`, a one-machine run's stores on 127.0.0.1.
- `_runfolder`: the run folder's protocol (variables and file names) between launcher and ranks.
- `_agent_main`, `_rank_main`: what torchrun's agent and each rank run (`python -m`).
- `_agentserver`, `_forkrank`: agents and ranks forked from a process that imported torch once.
- `_lifeline`: a process that dies with its parent.

Nothing is imported here: a rank imports `_rank_main` and `_runfolder` alone, and pays for nothing else.
"""
