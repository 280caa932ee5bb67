"""Lesson code in the chapters: lessonlib.show_code, the markers it reads, and the book's dependencies.

The chapters show lesson code with `lessonlib.show_code(path, region)` (or `pyobject=`) in code cells
whose input the book removes. These tests check every such call in the notebooks resolves, that every
marked region in a lesson is shown by some chapter (an unshown marker is clutter in the lesson), that
errors name the file and what it has, and, with real incremental `jupyter-book build`s of a small
book, that the code is highlighted like any code block and that a rebuild executes exactly the
chapters whose code, or lessons, changed.
"""

import ast
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

import lessonlib
from lessonlib.launcher.processes import run_bounded
from lessonlib.notebook.code import MARKER, Code, regions

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
LESSONS = sorted(ROOT.glob("lessons/[0-9][0-9]_*.py"))
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


def _build(book, timeout=240):
    """`jupyter-book build` without --all (an incremental build), in its own session, bounded."""
    done = run_bounded([JUPYTER_BOOK, "build", book, "-W", "-n"], timeout, cwd=book.parent)
    if done.timed_out:
        pytest.fail(f"jupyter-book build did not finish in {timeout} s:\n{done.output[-4000:]}")
    assert done.returncode == 0, done.output[-4000:]
    return done.output


def _notebook(path, kernel, markdown, code, tags=()):
    cells = [
        {"cell_type": "markdown", "id": "m", "metadata": {}, "source": markdown},
        {
            "cell_type": "code",
            "id": "c",
            "metadata": {"tags": list(tags)},
            "outputs": [],
            "execution_count": None,
            "source": code,
        },
    ]
    path.write_text(
        json.dumps({"cells": cells, "metadata": {"kernelspec": kernel}, "nbformat": 4, "nbformat_minor": 5})
    )


@pytest.mark.timeout(600)
def test_a_rebuild_executes_exactly_the_chapters_whose_code_changed(tmp_path):
    """A small book with the course's execution settings (_config.yml's `execute` block, lessonlib.book.rebuild)
    and three chapters: one shows a region of a lesson, one runs another lesson, one uses no lesson.
    Each execution of a chapter is recorded in a file. Incremental builds (no --all), as a reader makes
    them: a cold build executes all three (side by side); nothing changed, or prose edited, executes
    none; a lesson edited executes exactly the chapter that uses it, and its page shows the new code or
    output; a code cell edited executes its chapter only. The shown code is highlighted like any block."""
    config = (ROOT / "_config.yml").read_text()
    assert "lessonlib.book.rebuild" in config, "_config.yml no longer loads lessonlib.book.rebuild"
    execute = re.search(r"^execute:\n(?:[ #].*\n|\n)+", config, re.M).group(0)  # the course's own settings
    assert re.search(r"^\s*execute_notebooks: cache\b", execute, re.M), execute
    (tmp_path / "_config.yml").write_text(
        "title: demo\nonly_build_toc_files: true\n"
        + execute
        + textwrap.dedent("""
        sphinx: {extra_extensions: [lessonlib.book.rebuild], config: {nb_execution_raise_on_error: true}}
    """)
    )
    book = tmp_path / "book"
    (book / "lessons").mkdir(parents=True)
    (book / "_toc.yml").write_text(
        "format: jb-book\nroot: index\nchapters:\n  - file: shows\n  - file: runs\n  - file: plain\n"
    )
    (book / "index.md").write_text("# index\n")
    shown = book / "lessons" / "demo.py"
    shown.write_text('def f():\n    # [start: shown]\n    value = "FIRST"\n    # [end: shown]\n    return value\n')
    run = book / "lessons" / "other.py"
    run.write_text('print("OUTPUT ONE")\n')
    record = tmp_path / "executions.txt"
    kernel = json.loads((ROOT / "book" / "01_launch.ipynb").read_text())["metadata"]["kernelspec"]
    note = f"open({str(record)!r}, 'a').write('{{}}\\n')\n"
    _notebook(
        book / "shows.ipynb",
        kernel,
        "# shows",
        note.format("shows") + 'import lessonlib\nlessonlib.show_code("lessons/demo.py", "shown")',
        tags=["remove-input", "lesson-code"],
    )
    _notebook(
        book / "runs.ipynb",
        kernel,
        "# runs",
        note.format("runs") + "import subprocess, sys\n"
        'print(subprocess.run([sys.executable, "lessons/other.py"], capture_output=True, text=True, '
        "timeout=60).stdout)",
    )
    _notebook(book / "plain.ipynb", kernel, "# plain", note.format("plain") + "print(6 * 7)")
    html = tmp_path / "_build" / "html"

    def build():
        """Build; return the chapters executed, in sorted order, and the log."""
        record.write_text("")
        log = _build(book)
        return sorted(record.read_text().split()), log

    executed, log = build()
    assert executed == ["plain", "runs", "shows"], log[-3000:]
    report = json.loads((tmp_path / "_build" / "lessonlib-execution.json").read_text())
    assert report["jobs"] >= 2 and len(report["executed"]) == 3, report  # side by side
    page = (html / "shows.html").read_text()
    assert (
        '<span class="n">value</span> <span class="o">=</span> <span class="s2">&quot;FIRST&quot;</span>' in page
        or '<span class="n">value</span> <span class="o">=</span> <span class="s2">"FIRST"</span>' in page
    ), "the shown region is not a Pygments-highlighted code block:\n" + page[page.find("cell_output") :][:800]
    assert "def f" not in page  # only the region, without the function around it
    assert "OUTPUT ONE" in (html / "runs.html").read_text()

    assert build()[0] == [], "a rebuild with nothing changed executed chapters"

    nb = json.loads((book / "shows.ipynb").read_text())
    nb["cells"][0]["source"] = "# shows, its prose edited"
    (book / "shows.ipynb").write_text(json.dumps(nb))
    assert build()[0] == [], "a prose edit executed chapters"
    assert "its prose edited" in (html / "shows.html").read_text()

    shown.write_text(shown.read_text().replace("FIRST", "SECOND"))
    assert build()[0] == ["shows"], "editing the lesson a chapter shows should execute that chapter alone"
    assert "SECOND" in (html / "shows.html").read_text() and "FIRST" not in (html / "shows.html").read_text()

    run.write_text('print("OUTPUT TWO")\n')
    assert build()[0] == ["runs"], "editing the lesson a chapter runs should execute that chapter alone"
    assert "OUTPUT TWO" in (html / "runs.html").read_text()

    nb = json.loads((book / "plain.ipynb").read_text())
    nb["cells"][1]["source"] = nb["cells"][1]["source"].replace("6 * 7", "6 * 8")
    (book / "plain.ipynb").write_text(json.dumps(nb))
    assert build()[0] == ["plain"], "editing a chapter's code should execute that chapter alone"
    assert "48" in (html / "plain.html").read_text()


@pytest.mark.unit
def test_a_chapter_that_uses_lessonlib_depends_on_all_of_it():
    """An edit to any lessonlib module re-executes every chapter that imports lessonlib (and no other)."""
    from lessonlib.book.rebuild import dependencies

    modules = {p.resolve() for p in (ROOT / "lessonlib").rglob("*.py")}
    chapter = ROOT / "book" / "02_collectives.ipynb"
    found = set(dependencies(chapter.read_text(), chapter.parent))
    assert modules <= found, sorted(modules - found)
    assert ROOT / "lessons" / "02_collectives.py" in found
    plain = json.dumps({"cells": [{"cell_type": "code", "source": "print(1)", "metadata": {}, "outputs": []}]})
    assert dependencies(plain, ROOT / "book") == []
