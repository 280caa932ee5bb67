"""Lesson code in the chapters: lessonlib.show_code and the markers it reads.

The chapters show lesson code with `lessonlib.show_code(path, region)` (or `pyobject=`) in code cells
whose input the book removes. These tests check every such call in the notebooks resolves, that every
marked region in a lesson is shown by some chapter (an unshown marker is clutter in the lesson), that
errors name the file and what it has, and that the caption and code render the same in the book,
JupyterLab and VS Code. How the book rebuilds when a lesson changes: tests/test_rebuild.py.
"""

import ast
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

import lessonlib
from lessonlib import ROOT
from lessonlib.cli import catalog
from lessonlib.notebook.code import MARKER, Code, regions

NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
LESSONS = catalog.lesson_files()
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")


def show_code_calls():
    """[(notebook name, path, region or None, pyobject or None)] for every show_code call in the chapters."""
    calls = []
    for nb in NOTEBOOKS:
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            for node in ast.walk(ast.parse("".join(cell["source"]))):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "show_code":
                    args = [ast.literal_eval(a) for a in node.args]
                    kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                    calls.append((nb.name, args[0], args[1] if len(args) > 1 else None, kw.get("pyobject")))
    return calls


CALLS = show_code_calls()
# One (path, region) of chapter 1's that is shown (its regions are the course's first example).
CALLS_BY_KIND = {"region": next((p, r) for nb, p, r, _ in CALLS if p == "lessons/01_launch.py" and r)}


@pytest.mark.unit
def test_the_chapters_show_code_with_show_code_not_literalinclude():
    assert CALLS, "no chapter calls lessonlib.show_code"
    stale = [nb.name for nb in NOTEBOOKS if "{literalinclude}" in nb.read_text()]
    assert not stale, f"{stale}: a literalinclude directive shows as raw text in Jupyter; use lessonlib.show_code"


@pytest.mark.unit
def test_every_show_code_cell_hides_its_input_in_the_book():
    bad = []
    for nb in NOTEBOOKS:
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "code" and "show_code(" in "".join(cell["source"]):
                tags = cell["metadata"].get("tags", [])
                if not {"remove-input", "lesson-code"} <= set(tags):
                    bad.append(f"{nb.name} cell {i}: tags {tags}")
    assert not bad, "show_code cells need the tags remove-input and lesson-code:\n" + "\n".join(bad)


@pytest.mark.unit
@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c[0]}:{Path(c[1]).name}:{c[2] or c[3]}")
def test_every_show_code_call_in_the_chapters_resolves(call):
    _, path, region, pyobject = call
    code = lessonlib.show_code(path, region) if region else lessonlib.show_code(path, pyobject=pyobject)
    text = str(code)
    assert text.strip(), f"{path} {region or pyobject}: empty"
    assert text == textwrap.dedent(text), f"{path} {region}: not dedented"
    assert not any(MARKER.match(line) for line in text.splitlines()), f"{path} {region}: a marker line is shown"
    ast.parse(text) if pyobject else None  # a whole function is valid Python on its own


@pytest.mark.unit
def test_every_marked_region_is_shown_by_a_chapter_and_markers_pair_up():
    shown = {(Path(path).name, region) for _, path, region, _ in CALLS if region}
    unused, unpaired = [], []
    for lesson in LESSONS:
        text = lesson.read_text()
        starts = re.findall(r"# \[start: ([\w.-]+)\]", text)
        ends = re.findall(r"# \[end: ([\w.-]+)\]", text)
        if sorted(starts) != sorted(ends) or set(starts) != set(regions(text)):
            unpaired.append(f"{lesson.name}: starts {starts}, ends {ends}")
        unused += [f"{lesson.name}: {name}" for name in starts if (lesson.name, name) not in shown]
    assert not unpaired, "markers must come in [start: x] ... [end: x] pairs:\n" + "\n".join(unpaired)
    assert not unused, "marked regions no chapter shows (remove the markers):\n" + "\n".join(unused)


@pytest.mark.unit
def test_region_and_function_are_dedented_without_marker_lines(tmp_path):
    lesson = tmp_path / "demo.py"
    lesson.write_text(
        textwrap.dedent('''\
        import torch


        @torch.no_grad()
        def step(x):
            """Doubles."""
            # [start: body]
            y = x * 2
            return y
            # [end: body]


        class Model:
            def forward(self, x):
                return x
    ''')
    )
    assert str(lessonlib.show_code(lesson, "body")) == "y = x * 2\nreturn y"
    func = str(lessonlib.show_code(lesson, pyobject="step"))
    assert func.startswith("@torch.no_grad()\ndef step(x):") and func.endswith("return y")
    assert "[start" not in func
    assert str(lessonlib.show_code(lesson, pyobject="Model.forward")) == "def forward(self, x):\n    return x"
    md = lessonlib.show_code(lesson, "body")._repr_markdown_()
    assert "\n\n```python\ny = x * 2\nreturn y\n```\n\n</div>\n" in md, md
    assert Code("s = '```'")._repr_markdown_().startswith("````python\n")  # a fence the code cannot close
    assert Code("x = 1")._repr_markdown_() == "```python\nx = 1\n```\n"  # no caption, no frame


@pytest.mark.unit
def test_lesson_code_is_captioned_with_its_file_and_region():
    region = lessonlib.show_code("lessons/01_launch.py", CALLS_BY_KIND["region"][1])
    assert region.caption == f"lessons/01_launch.py · region {CALLS_BY_KIND['region'][1]}"
    assert (
        lessonlib.show_code("lessons/01_launch.py", pyobject="main").caption == "lessons/01_launch.py · function main"
    )
    assert str(region) == region.text  # the plain-text form is the code alone
    assert "lessons/01_launch.py · region" in region._repr_markdown_()


def _rendered(md):
    """The Markdown as JupyterLab and VS Code (markdown-it, CommonMark) and the book (MyST, docutils) make it."""
    from docutils.core import publish_string
    from markdown_it import MarkdownIt
    from myst_parser.parsers.docutils_ import Parser

    myst = publish_string(md, parser=Parser(), writer_name="html5", settings_overrides={"output_encoding": "unicode"})
    return {"commonmark": MarkdownIt("commonmark").render(md), "myst": myst}


def test_the_caption_and_frame_render_around_highlighted_code_everywhere():
    """The caption bar, then the code as a code block (highlighted by each front end), both inside the
    framed box; the essentials inline, since JupyterLab and VS Code have no book CSS."""
    code = lessonlib.show_code("lessons/01_launch.py", pyobject="main")
    for where, page in _rendered(code._repr_markdown_()).items():
        box = page.index('<div class="lessonlib-code" style="border-left:4px solid')
        caption = page.index('class="lessonlib-code-caption" style="', box)
        block = page.index("<pre", caption)
        closed = page.index("</div>", page.index("</pre>", block))
        assert box < caption < block < closed, f"{where}: caption, code and frame out of order:\n{page[box:][:600]}"
        assert "lessons/01_launch.py · function main</div>" in page, where
        assert "def main" in re.sub(r"<[^>]+>", "", page[block:closed]), where  # tokens or not, the code


@pytest.mark.unit
def test_a_missing_file_region_or_function_is_a_clear_error(tmp_path):
    lesson = tmp_path / "demo.py"
    lesson.write_text("# [start: a]\nx = 1\n# [end: a]\n# [start: b]\ny = 2\n# [end: b]\n\n\ndef f():\n    pass\n")
    with pytest.raises(FileNotFoundError, match=r"lessons/nope\.py.*not found"):
        lessonlib.show_code("lessons/nope.py", "a")
    with pytest.raises(ValueError, match=r"demo\.py has no region 'c'; it has: a, b"):
        lessonlib.show_code(lesson, "c")
    with pytest.raises(ValueError, match=r"demo\.py has no function or class 'g'; it has: f"):
        lessonlib.show_code(lesson, pyobject="g")
    with pytest.raises(ValueError, match="exactly one of"):
        lessonlib.show_code(lesson)
    with pytest.raises(ValueError, match="exactly one of"):
        lessonlib.show_code(lesson, "a", pyobject="f")
