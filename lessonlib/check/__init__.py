"""`python -m lessonlib check -- SCRIPT [ARGS]`: the course's checks, run on a reader's own DDP script.

- `command`: the command: launch the script with the probe in every rank, bounded; print the findings.
- `probe`: what every rank loads before the script (torch's functions wrapped, one JSON line per event).
- `findings`: the ranks' records compared after the run; each finding names the chapter section that
  shows the mistake running.

Nothing is imported here: a rank imports `probe` alone.
"""
