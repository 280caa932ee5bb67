"""Show a piece of a lesson file as code, in the book, in Jupyter and in VS Code alike (chapter 1).

    lessonlib.show_code("lessons/02_point_to_point.py", "blocking")      # a marked region
    lessonlib.show_code("lessons/01_launch.py", pyobject="main")         # a whole function or class

A region is the lines between `# [start: NAME]` and `# [end: NAME]`, dedented. The lesson file is the
only copy of the code: the chapters show it from there, never from a pasted copy.

The result is displayed as a Markdown fenced code block. Each front end renders that as highlighted
code: JupyterLab and VS Code with their own highlighters, and the book (MyST-NB turns a Markdown
output into the same node a code block in the text becomes), with Pygments and a copy button like
every other code block. Its plain-text form is the code itself.

Above the code, a caption bar names where it comes from (`lessons/01_launch.py · region read_env`),
and a coloured rule runs down its left side, so that lesson code never reads as one of the notebook's
own cells. Both are HTML in the same Markdown output with inline styles, which JupyterLab and VS Code
render as they are (they have no book CSS); the book's course.css adapts them to its dark mode.
"""

import ast
import html
import re
import textwrap

from ..launcher.request import resolve_script
from ..paths import ROOT

MARKER = re.compile(r"^\s*# \[(start|end): ([\w.-]+)\]\s*$")
ACCENT = "#3b6ea5"  # the rule and the caption's edge: the course's blue, also used for rank columns
_BOX = f"border-left:4px solid {ACCENT};padding-left:6px;margin:4px 0"
_CAPTION = (
    "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;line-height:1.5;"
    "background:#e8eef8;color:#1b2f4a;padding:2px 8px;border-radius:3px 3px 0 0;margin:0"
)


class Code:
    """Source code that displays as a highlighted block; `str(code)` is the code itself.
    With a `caption` (show_code gives the file and region), the block is framed and captioned."""

    def __init__(self, text, language="python", caption=None):
        self.text, self.language, self.caption = text, language, caption

    def _repr_markdown_(self):
        fence = "```"
        while fence in self.text:  # a fence the code cannot close early
            fence += "`"
        block = f"{fence}{self.language}\n{self.text}\n{fence}\n"
        if not self.caption:
            return block
        # An HTML block ends at a blank line, so the fence between the two is Markdown again: a code
        # block that each front end highlights, inside the framed box (CommonMark, hence MyST too).
        return (
            f'<div class="lessonlib-code" style="{_BOX}">\n'
            f'<div class="lessonlib-code-caption" style="{_CAPTION}">{html.escape(self.caption)}</div>\n\n'
            f"{block}\n</div>\n"
        )

    def __str__(self):
        return self.text

    def __repr__(self):
        return self.text


def regions(source):
    """{name: (first line, last line)} of every marked region (0-based, marker lines excluded)."""
    found, open_at = {}, {}
    for i, line in enumerate(source.splitlines()):
        m = MARKER.match(line)
        if not m:
            continue
        kind, name = m.groups()
        if kind == "start":
            open_at[name] = i + 1
        elif name in open_at:
            found[name] = (open_at.pop(name), i - 1)
    return found


def objects(source):
    """{dotted name: (first line, last line)} of every function and class, decorators included (0-based)."""
    return {name: span for name, (span, _) in _objects(source).items()}


def _objects(source):
    """{dotted name: ((first line, last line), 'function' | 'class')}."""
    found = {}

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found[prefix + node.name] = ((first, node.end_lineno - 1), kind)
                if isinstance(node, ast.ClassDef):
                    walk(node.body, f"{prefix}{node.name}.")

    walk(ast.parse(source).body, "")
    return found


def show_code(path, region=None, *, pyobject=None, language="python"):
    """The marked `region` of the file at `path`, or the function/class `pyobject`, as a displayable Code.

    `path` is found as `lessonlib.launch` finds a lesson: relative to the working folder, else to the
    course root (notebooks run in book/). A missing file, region or object is an error that names the
    file and lists what it has. The caption names the file relative to the course root
    (`lessons/01_launch.py · region read_env`, `... · function main`).
    """
    if (region is None) == (pyobject is None):
        raise ValueError(
            "show_code needs exactly one of: a region name (shown between '# [start: NAME]' "
            f"and '# [end: NAME]') or pyobject='function_or_class'; got region={region!r}, "
            f"pyobject={pyobject!r}"
        )
    file = resolve_script(path)
    source = file.read_text()
    lines = source.splitlines()
    if region is not None:
        spans, what, key = regions(source), "region", region
        kinds = dict.fromkeys(spans, "region")
    else:
        found = _objects(source)
        spans, what, key = {k: v[0] for k, v in found.items()}, "function or class", pyobject
        kinds = {k: v[1] for k, v in found.items()}
    if key not in spans:
        have = ", ".join(sorted(spans)) or "none"
        raise ValueError(f"{path} has no {what} {key!r}; it has: {have}")
    first, last = spans[key]
    body = [ln for ln in lines[first : last + 1] if not MARKER.match(ln)]
    shown = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(path)
    return Code(textwrap.dedent("\n".join(body)).strip("\n"), language, caption=f"{shown} · {kinds[key]} {key}")
