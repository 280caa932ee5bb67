"""Core sections, deep dives and reading times: one style across the book (the Start page).

Every `## ` section of a chapter carries a label on the line right under its heading, in italics:

    ## What torchrun does for you
    *Core · 6 min*

The kind is one of KINDS and is the author's choice. The minutes are estimated from the section's
text (`estimate`: prose at READING_WPM words a minute; code by its lines: what a cell puts on the page
(`shown_lines`: a lesson region or function from `show_code`, a whole file from `show_file`, a diff from
`show_diff`) read line by line at CODE_LINES_PER_MIN, the cell's own lines (the launch, the table, the
plot) skimmed at CELL_LINES_PER_MIN, plus CODE_CELL_MIN for each cell's output; and EXERCISE_MIN to do an
exercise). Each chapter also opens with a reading map (an admonition of class
`reading-map`) listing its sections by kind with the total, made from the labels by `render_map`.
`python -m lessonlib.book.readingmap` writes the minutes and the maps; tests/test_reading_map.py fails
when a label is missing, a map is stale or a stated time is far from the estimate. The Start page
builds its short path from the same labels (`path_rows`), so its times are the chapters' own.
"""

import ast
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..paths import ROOT

BOOK = ROOT / "book"
KINDS = ("Core", "Deep dive", "Exercise")
READING_WPM = 180  # technical prose, read with care
CODE_LINES_PER_MIN = 12  # code shown to be understood, read line by line to know what each line is for
CELL_LINES_PER_MIN = 30  # a cell's own code (launch, table, plot): skimmed
CODE_CELL_MIN = 0.25  # a code cell's output: a table, a picture, each rank's lines
EXERCISE_MIN = 10  # to write and check an exercise's answer, beyond reading it
LABEL = re.compile(r"^\*(Core|Deep dive|Exercise) · (\d+) min\*$")
MAP_CLASS = "reading-map"
CHAPTER = re.compile(r"^\d\d_.*\.ipynb$")


@dataclass(frozen=True, kw_only=True)
class Section:
    chapter: str  # notebook file name without .ipynb
    title: str  # the heading's text, without "## "
    kind: str | None  # from its label; None when it has none
    minutes: int | None  # from its label
    estimate: int  # from its text
    cells: tuple  # indices of its cells in the notebook


def chapters(book=BOOK):
    """The chapter notebooks, by name (NN_topic.ipynb)."""
    return sorted(p for p in Path(book).glob("*.ipynb") if CHAPTER.match(p.name))


def _source(cell):
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def estimate(cells, kind, names=None):
    """Minutes to read `cells` (and to do it, for an exercise), rounded up, at least 1. `names`: the texts
    that the notebook's cells name (`shown_lines`), for a `show_diff(a, b)` of two made in another section."""
    words = sum(len(_source(c).split()) for c in cells if c["cell_type"] == "markdown")
    code = [c for c in cells if c["cell_type"] == "code"]
    names = dict(names or {})
    own = sum(sum(1 for line in _source(c).splitlines() if line.strip()) for c in code)
    shown = sum(shown_lines(_source(c), names) for c in code)
    minutes = words / READING_WPM + own / CELL_LINES_PER_MIN + shown / CODE_LINES_PER_MIN + CODE_CELL_MIN * len(code)
    minutes += EXERCISE_MIN if kind == "Exercise" else 0
    return max(1, math.ceil(minutes))


def shown_lines(source, names=None):
    """The non-blank lines of code a cell shows the reader: `show_code(path, region)` or
    `show_code(path, pyobject=...)`, `show_file(path)`, and `show_diff(a, b)` where `a` and `b` were made
    by `read(path)` or `split_changes(path, path)` in a cell before (in `names`, which this function
    fills). Only literal paths are followed; a call it cannot resolve counts nothing."""
    from ..notebook import scriptdiff
    from ..notebook.code import show_code

    names, count = ({} if names is None else names), 0
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return count

    def literal(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    def call_name(node):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            fn, args = call_name(node.value), [literal(a) for a in node.value.args]
            try:
                if fn == "split_changes" and len(args) >= 2 and None not in args[:2]:
                    made = scriptdiff.split_changes(args[0], args[1])
                elif fn == "read" and args and args[0]:
                    made = (scriptdiff.read(args[0]),)
                else:
                    continue
            except (OSError, ValueError):
                continue
            target = node.targets[0]
            targets = target.elts if isinstance(target, ast.Tuple) else [target]
            names.update({t.id: text for t, text in zip(targets, made) if isinstance(t, ast.Name)})
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn, args = call_name(node), [literal(a) for a in node.args]
        kwargs = {k.arg: literal(k.value) for k in node.keywords}
        try:
            if fn == "show_code" and args and args[0]:
                shown = show_code(args[0], *(args[1:2] or [None]), pyobject=kwargs.get("pyobject")).text
            elif fn == "show_file" and args and args[0]:
                shown = scriptdiff.read(args[0], docstring=True).text
            elif fn == "show_diff" and len(node.args) == 2 and all(isinstance(a, ast.Name) for a in node.args):
                first, second = (names.get(a.id) for a in node.args)
                if first is None or second is None:
                    continue
                shown = scriptdiff.unified(first, second)
            else:
                continue
        except (OSError, ValueError):
            continue
        count += sum(1 for line in shown.splitlines() if line.strip())
    return count


def _names(nb):
    """What a notebook's code cells name (`read`, `split_changes`), for a diff shown in another section."""
    names = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            shown_lines(_source(cell), names)
    return names


def sections(path):
    """The `## ` sections of one notebook, in order, with their labels and estimates."""
    nb = json.loads(Path(path).read_text())
    found, current = [], None
    for i, cell in enumerate(nb["cells"]):
        lines = _source(cell).splitlines()
        head = next((j for j, line in enumerate(lines) if line.startswith("## ")), None)
        if cell["cell_type"] == "markdown" and head is not None:
            label = LABEL.match(lines[head + 1].strip()) if head + 1 < len(lines) else None
            current = {"title": lines[head][3:].strip(), "label": label, "cells": [i]}
            found.append(current)
        elif current is not None:
            current["cells"].append(i)
    names = _names(nb)
    out = []
    for s in found:
        kind = s["label"].group(1) if s["label"] else None
        cells = [nb["cells"][i] for i in s["cells"]]
        out.append(
            Section(
                chapter=Path(path).stem,
                title=s["title"],
                kind=kind,
                minutes=int(s["label"].group(2)) if s["label"] else None,
                estimate=estimate(cells, kind, names),
                cells=tuple(s["cells"]),
            )
        )
    return out


def _name(title):
    """A heading as the map names it: italic, with its code spans kept."""
    return f"*{title}*"


def render_map(secs):
    """The reading-map admonition's Markdown for a chapter's labelled sections."""
    by_kind = {k: [s for s in secs if s.kind == k] for k in KINDS}
    core = sum(s.minutes for s in by_kind["Core"])
    total = sum(s.minutes for s in secs)
    whole = "chapter" if secs and CHAPTER.match(f"{secs[0].chapter}.ipynb") else "page"
    lines = [
        f":::{{admonition}} Reading map: the core in {core} min, the whole {whole} in {total} min",
        f":class: {MAP_CLASS}",
    ]
    names = {"Core": "Core", "Deep dive": "Deep dives", "Exercise": "Exercises"}
    for kind in KINDS:
        if by_kind[kind]:
            items = ", ".join(f"{_name(s.title)} ({s.minutes} min)" for s in by_kind[kind])
            lines.append(f"- **{names[kind]}**: {items}.")
    lines.append("\nThe core is what a DDP job needs; a deep dive shows how or why, and can wait. Times are estimates.")
    lines.append(":::")
    return "\n".join(lines)


def map_cell(nb):
    """Index of the chapter's reading-map cell, or None."""
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown" and f":class: {MAP_CLASS}" in _source(cell):
            return i
    return None


def write(path, kinds=None):
    """Set every label's minutes to the estimate (and its kind, from `kinds` {title: kind}, where given),
    and write the reading map as the chapter's second cell. Returns True when the file changed."""
    path = Path(path)
    before = path.read_text()
    nb = json.loads(before)
    names = _names(nb)
    for s in sections(path):
        kind = (kinds or {}).get(s.title, s.kind)
        if kind not in KINDS:
            raise ValueError(f"{path.name}: section {s.title!r} needs a kind, one of {KINDS}; it has {kind!r}")
        cells = [nb["cells"][i] for i in s.cells]
        label = f"*{kind} · {estimate(cells, kind, names)} min*"
        lines = _source(nb["cells"][s.cells[0]]).split("\n")
        head = next(j for j, line in enumerate(lines) if line.startswith("## "))
        if head + 1 < len(lines) and LABEL.match(lines[head + 1].strip()):
            lines[head + 1] = label
        else:
            lines[head + 1 : head + 1] = [label, ""] if head + 1 < len(lines) and lines[head + 1].strip() else [label]
        _set_source(nb["cells"][s.cells[0]], "\n".join(lines))
    # Estimates depend on the labels' words only negligibly; read the sections again for the map.
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    text = render_map(sections(path))
    i = map_cell(nb)
    if i is None:
        nb["cells"].insert(1, {"cell_type": "markdown", "id": f"reading-map-{path.stem[:2]}", "metadata": {}})
        i = 1
    _set_source(nb["cells"][i], text)
    after = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    path.write_text(after)
    return after != before


def _set_source(cell, text):
    lines = text.split("\n")
    cell["source"] = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def problems(path):
    """What is wrong with a chapter's labels and map, as sentences (empty when all is well)."""
    out = []
    secs = sections(path)
    for s in secs:
        if s.kind is None:
            out.append(f"{s.chapter}: section {s.title!r} has no label '*KIND · N min*' under its heading")
        elif abs(s.minutes - s.estimate) > max(2, 0.3 * s.estimate):
            out.append(f"{s.chapter}: section {s.title!r} says {s.minutes} min, its text reads in about {s.estimate}")
    if any(s.kind is None for s in secs):
        return out
    nb = json.loads(Path(path).read_text())
    i = map_cell(nb)
    if i is None:
        out.append(f"{Path(path).stem}: no reading map (an admonition of class {MAP_CLASS})")
    elif _source(nb["cells"][i]).strip() != render_map(secs).strip():
        out.append(f"{Path(path).stem}: the reading map does not match the section labels")
    return out


def path_rows(steps, book=BOOK):
    """The Start page's path: for each (chapter stem, section title prefix), the section found and its
    minutes; a missing section or one that is not core is a ValueError."""
    rows = []
    for stem, prefix in steps:
        found = [s for s in sections(Path(book) / f"{stem}.ipynb") if s.title.startswith(prefix)]
        if len(found) != 1:
            raise ValueError(f"{stem}: {len(found)} sections start with {prefix!r}, the path needs exactly one")
        if found[0].kind != "Core":
            raise ValueError(f"{stem}: {found[0].title!r} is {found[0].kind}, and the short path takes core only")
        rows.append(found[0])
    return rows


def main(argv):
    """Write every chapter's label minutes and reading map; print what changed."""
    for path in chapters():
        if write(path):
            print(f"updated {path.name}")
    bad = [p for path in chapters() for p in problems(path)]
    print("\n".join(bad) or "every chapter's labels and map agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
