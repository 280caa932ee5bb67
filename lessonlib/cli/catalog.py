"""The lesson catalog: every lesson and what its docstring says, and the chapters' titles (chapter 1).

A lesson's docstring's first line is the command that runs it, as pasted (`torchrun --nproc_per_node=2
lessons/01_launch.py`); the catalog reads it, with ast, and so do the tests: which lessons exist, how each
runs and at how many ranks come from here. The standard library only.
"""

import ast
import json
import re
from pathlib import Path

from ..paths import ROOT, chapter_files, lesson_files

__all__ = ["lesson_files", "checkers", "docstring", "command_of", "summary_of", "kind_of", "nproc_of", "chapter_titles"]


def checkers(root=ROOT):
    """The exercise checkers: lessons named NN_exercise_*.py (a reference answer and the wrong ones it rejects)."""
    return [p for p in lesson_files(root) if p.name[3:].startswith("exercise_")]


def docstring(path):
    """The module docstring of a Python file, or '' if it has none. Raises SyntaxError."""
    return ast.get_docstring(ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))) or ""


def command_of(path):
    """The command on the first line of a lesson's docstring ('' if none)."""
    doc = docstring(path).strip()
    return doc.splitlines()[0] if doc else ""


def summary_of(path):
    """The docstring's first paragraph after the command, on one line: what the lesson shows."""
    paragraphs = re.split(r"\n\s*\n", docstring(path).strip())[1:]
    text = " ".join(paragraphs[0].split()) if paragraphs else ""
    return "" if text.startswith("Options:") else text


def kind_of(command):
    """'torchrun' (torchrun --nproc_per_node=N ...), 'spawn' (python ... --world-size N: the script
    starts its own processes) or 'single' (python ...: one process); '' for anything else."""
    if command.startswith("torchrun "):
        return "torchrun"
    if command.startswith("python "):
        return "spawn" if "--world-size" in command.split() else "single"
    return ""


def nproc_of(command):
    """The world size a lesson's command runs it at: N of --nproc_per_node=N or of --world-size N (a
    script that starts its own processes), 1 for `python x.py`; None when the command names none."""
    if kind_of(command) == "single":
        return 1
    m = re.search(r"--nproc[_-]per[_-]node[= ](\d+)|--world-size[= ](\d+)", command)
    return int(m.group(1) or m.group(2)) if m else None


def chapter_titles(root=ROOT):
    """{chapter number: (title, notebook file name)}, from each notebook's first markdown heading."""
    titles = {}
    for notebook in chapter_files(root):
        title = notebook.stem[3:].replace("_", " ")
        try:
            cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
        except (OSError, json.JSONDecodeError):
            cells = []
        for cell in cells:
            if cell.get("cell_type") == "markdown":
                m = re.search(r"^#\s+(.+?)\s*$", "".join(cell.get("source", "")), re.M)
                if m:
                    title = m.group(1).replace("`", "")
                    break
        titles.setdefault(int(notebook.name[:2]), (title, notebook.name))
    return titles
