"""Process supervision: finding, watching and killing processes by their mark, for the launcher, the book's
build, the tests and the chapters.

- `marks`: the one marking scheme: a mark in every process's environment, found again in /proc (which
  shows it whatever session a process went to), and killing every process that carries it.
- `bounded`: `run_bounded`, any command bounded, with nothing of it left afterwards; `started`, the same for
  a command that runs in the background while a cell works with it; `sigterm_cleans_up`; `poll_until`, the
  one bounded wait for something to become true.
- `lifeline`: a process that dies with its parent (a rank with its agent, a chapter's executor with the build).
- `owners`: what lessonlib makes outside the repository named with its owner's pid and start time, and the
  sweep, at the next start, of what a dead owner left.

Nothing is imported here: a rank imports `lifeline` alone (the standard library).
"""
