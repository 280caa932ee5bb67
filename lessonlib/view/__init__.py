"""Showing a run: everything the course draws or says about a launch, split by what it renders (chapter 1).

- `live`: the views the launcher drives while a run goes on (HTML in a notebook, prefixed lines in a
  terminal, none), and what a cell shows of a finished run.
- `story`: the words: the status line, one line per rank, the failure story, `str(run)`, the terminal's
  columns.
- `tracebacks`: reading what ranks wrote: tracebacks, faulthandler stack dumps, their frames, short paths.
- `html`: the final HTML view and its pieces.

The views read a RunResult and never change it. Nothing is imported here.
"""
