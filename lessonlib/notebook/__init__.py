"""The notebook side: what a chapter's cells call besides `launch`.

- `panel`: the run panel (ipywidgets): a lesson's ranks and options as controls, Run and Stop.
- `options`: a lesson's options as data (parse, apply, check), with no widget; `_argspec` reads them
  from the lesson's own argument parser in a child process.
- `code`: `show_code`, a lesson's marked region or function as highlighted code.
- `plots`: `plot_ranks`, what each rank holds, one row per rank.
- `scriptdiff`: the Start page's diffs from a one-process script to DDP, then AMP.
- `glue`: a number the prose states, taken from this execution (MyST-NB's `{glue:text}` role).
- `ncclmessages`: chapter 12's table of what NCCL prints and the other torch messages it quotes, each
  looked up in the installed torch (tests/test_nccl_messages.py).
- `gpucapture`: what `make gpu-check` saw on a GPU machine (book/captured/gpu_check.json), labelled.
- `table`: `show_table`, a list of dicts as a table (HTML in a notebook, aligned text in a terminal).

Nothing is imported here: `lessonlib.panel`, `show_code`, `plot_ranks` and `show_table` import their module on
first use.
"""
