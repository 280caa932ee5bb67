"""A Sphinx extension for the book: a chapter depends on the lesson files it shows or launches.

A chapter shows lesson code with `lessonlib.show_code("lessons/X.py", ...)` and runs lessons with
`lessonlib.launch("lessons/X.py", ...)` and friends, from code cells. Sphinx cannot see that, so an
incremental `jupyter-book build` would keep a chapter's old outputs after its lesson changed. This
extension reads each notebook as Sphinx reads it and notes as its dependencies every lesson file its
cells name and lessonlib's own modules (each chapter runs them): editing any of them makes Sphinx
read, and MyST-NB execute, that chapter again.

Enabled in _config.yml (`sphinx: extra_extensions: [lessonlib.bookdeps]`).
"""

import json
import re
from pathlib import Path

from .launcher import ROOT

LESSON_PATH = re.compile(r"""["']((?:\.\./)?lessons/[\w./-]+\.py)["']""")


def dependencies(notebook_text, folder):
    """Files a notebook's code cells depend on: the lessons they name, found from the notebook's
    folder or the course root (as the launcher finds them), plus lessonlib's modules when they use it."""
    try:
        cells = json.loads(notebook_text).get("cells", [])
    except ValueError:
        return []
    code = "\n".join("".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code")
    found = set()
    for name in LESSON_PATH.findall(code):
        for base in (Path(folder), Path(folder).parent, ROOT):
            path = (base / name).resolve()
            if path.is_file():
                found.add(path)
                break
    if "lessonlib" in code:
        found.update(p.resolve() for p in (ROOT / "lessonlib").glob("*.py"))
    return sorted(found)


def _note(app, docname, source):
    path = Path(app.env.doc2path(docname))
    if path.suffix != ".ipynb":
        return
    for dep in dependencies(source[0], path.parent):
        app.env.note_dependency(str(dep))


def setup(app):
    app.connect("source-read", _note)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
