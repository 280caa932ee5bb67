"""The book build: the Sphinx extension and the tools that keep the chapters' text honest.

- `rebuild`: the extension named in `_config.yml`: each chapter's dependencies (lessons and lessonlib),
  new or stale chapters executed side by side, each bounded, before MyST-NB renders them from its cache.
- `_execute_notebook`: one chapter executed in a process of its own, as MyST-NB would
  (`python -m lessonlib.book._execute_notebook`).
- `launchrecord`: what the build ran (each launch and recorded command, one JSON line, with its chapter)
  and `launches.json`, its committed summary, from which the tests take the runs they need not repeat
  (`python -m lessonlib.book.launchrecord _build/lessonlib-launches.jsonl` rewrites it).
- `readingmap`: each section's label and reading time, the chapters' reading maps and the Start page's
  short path (`python -m lessonlib.book.readingmap` rewrites them).
"""
