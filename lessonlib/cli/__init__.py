"""The command line, `python -m lessonlib run/list`, and the lesson catalog it reads (chapter 1).

- `catalog`: every lesson and what its docstring says: its command (the first line), how it runs
  (torchrun, a script that spawns its own processes, one process), at how many ranks, what it shows;
  the chapters' titles. The tests read the lessons from it too.
- `main`: the runner: `run` is `lessonlib.launch(..., show="text")` from a shell, `list` prints the catalog.

`list` and `--help` read files only (docstrings with ast, chapter titles with json): they import neither
torch nor the launcher.
"""
