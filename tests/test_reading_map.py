"""Core sections, deep dives and reading times (lessonlib.book.readingmap): one style across the book.

Every `## ` section of every chapter has a label `*Core · N min*`, `*Deep dive · N min*` or
`*Exercise · N min*` under its heading, N close to what its text and code take to read; every chapter
opens with a reading map made from those labels. The first test reads the real chapters; the others
specify the module on small notebooks written here.
"""

import json
import re
from pathlib import Path

import pytest

from lessonlib import ROOT
from lessonlib.book import readingmap
from lessonlib.notebook import scriptdiff


@pytest.mark.unit
@pytest.mark.parametrize("chapter", [*readingmap.chapters(), readingmap.BOOK / "start.ipynb"], ids=lambda p: p.stem)
def test_every_section_is_labelled_and_the_map_agrees(chapter):
    bad = readingmap.problems(chapter)
    assert not bad, "\n".join(bad) + "\n(python -m lessonlib.book.readingmap rewrites the minutes and the maps)"


@pytest.mark.unit
def test_every_chapter_has_a_core():
    for chapter in readingmap.chapters():
        kinds = {s.kind for s in readingmap.sections(chapter)}
        assert "Core" in kinds, f"{chapter.name} has no core section"


def notebook(tmp_path, *markdown, code_cells=0, name="99_test.ipynb"):
    cells = [
        {"cell_type": "markdown", "id": f"m{i}", "metadata": {}, "source": text} for i, text in enumerate(markdown)
    ]
    cells += [
        {"cell_type": "code", "id": f"c{i}", "metadata": {}, "source": "x = 1", "outputs": [], "execution_count": None}
        for i in range(code_cells)
    ]
    path = tmp_path / name
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


@pytest.mark.unit
def test_estimate_counts_prose_code_and_the_time_an_exercise_takes():
    prose = {"cell_type": "markdown", "source": "word " * (readingmap.READING_WPM * 3)}
    code = {"cell_type": "code", "source": "x = 1"}
    assert readingmap.estimate([prose], "Core") == 3
    assert readingmap.estimate([prose, code, code], "Core") == 4
    assert readingmap.estimate([prose], "Exercise") == 3 + readingmap.EXERCISE_MIN
    assert readingmap.estimate([], "Core") == 1  # never 0


@pytest.mark.unit
def test_code_is_counted_by_the_lines_a_cell_shows_not_by_the_cell():
    """A cell that shows a 200-line script is not read in the time of a cell that prints one number."""
    region = readingmap.shown_lines('lessonlib.show_code("lessons/01_launch.py", "read_env")')
    lines = (ROOT / "lessons" / "01_launch.py").read_text().splitlines()
    first, last = lines.index("# [start: read_env]"), lines.index("# [end: read_env]")
    assert region == sum(1 for line in lines[first + 1 : last] if line.strip()) > 3
    whole = readingmap.shown_lines('scriptdiff.show_file("lessons/train_one.py")')
    on_disk = (ROOT / "lessons" / "train_one.py").read_text().splitlines()
    assert whole == sum(1 for line in on_disk if line.strip())
    names = {}
    assert (
        readingmap.shown_lines(
            'a, b, c = scriptdiff.split_changes("lessons/train_one.py", "lessons/train_ddp.py")', names
        )
        == 0
    )
    diff = readingmap.shown_lines("scriptdiff.show_diff(a, b)", names)
    a, b, _ = scriptdiff.split_changes("lessons/train_one.py", "lessons/train_ddp.py")
    assert diff == sum(1 for line in scriptdiff.unified(a, b).splitlines() if line.strip()) > 20
    assert readingmap.shown_lines("scriptdiff.show_diff(x, y)", names) == 0  # names it cannot resolve count nothing
    assert readingmap.shown_lines("print(1)") == 0
    cell = {"cell_type": "code", "source": 'scriptdiff.show_file("lessons/train_one.py")'}
    one_line = {"cell_type": "code", "source": "print(1)"}
    assert readingmap.estimate([cell], "Core") >= whole / readingmap.CODE_LINES_PER_MIN
    assert readingmap.estimate([one_line], "Core") == 1


@pytest.mark.unit
def test_write_labels_each_section_and_makes_the_map(tmp_path):
    long = "word " * 900  # 5 minutes
    path = notebook(
        tmp_path,
        "# 99. Title\n\nThe question.",
        f"## First\n\n{long}",
        "## Second part\n\nshort",
        "## Exercise\n\nDo it.",
    )
    assert readingmap.problems(path)[0].endswith("has no label '*KIND · N min*' under its heading")
    readingmap.write(path, {"First": "Core", "Second part": "Deep dive", "Exercise": "Exercise"})
    assert readingmap.problems(path) == []
    secs = readingmap.sections(path)
    assert [(s.title, s.kind, s.minutes) for s in secs] == [
        ("First", "Core", 6),  # 900 words + the label's, rounded up
        ("Second part", "Deep dive", 1),
        ("Exercise", "Exercise", 11),
    ]
    cells = json.loads(path.read_text())["cells"]
    assert "".join(cells[2]["source"]).startswith("## First\n*Core · 6 min*\n")
    the_map = "".join(cells[1]["source"])
    assert the_map.startswith(":::{admonition} Reading map: the core in 6 min, the whole chapter in 18 min")
    assert "- **Deep dives**: *Second part* (1 min)." in the_map
    # Writing again changes nothing.
    assert readingmap.write(path) is False


@pytest.mark.unit
def test_a_stale_map_or_a_wrong_time_is_reported(tmp_path):
    path = notebook(tmp_path, "# 99. T", "## A\n\n" + "word " * 1800)
    readingmap.write(path, {"A": "Core"})
    text = path.read_text().replace("*Core · 11 min*", "*Core · 3 min*")
    path.write_text(text)
    bad = readingmap.problems(path)
    assert any("says 3 min, its text reads in about 11" in b for b in bad), bad
    assert any("the reading map does not match" in b for b in bad), bad


@pytest.mark.unit
def test_a_section_needs_a_known_kind(tmp_path):
    path = notebook(tmp_path, "# 99. T", "## A\n\ntext")
    with pytest.raises(ValueError, match=r"section 'A' needs a kind, one of \('Core', 'Deep dive', 'Exercise'\)"):
        readingmap.write(path, {"A": "Optional"})


@pytest.mark.unit
def test_the_short_path_takes_core_sections_only(tmp_path):
    notebook(tmp_path, "# 99. T", "## Basics\n\ntext", "## Internals\n\ntext")
    readingmap.write(tmp_path / "99_test.ipynb", {"Basics": "Core", "Internals": "Deep dive"})
    assert [s.title for s in readingmap.path_rows([("99_test", "Bas")], book=tmp_path)] == ["Basics"]
    with pytest.raises(ValueError, match="is Deep dive, and the short path takes core only"):
        readingmap.path_rows([("99_test", "Internals")], book=tmp_path)
    with pytest.raises(ValueError, match="0 sections start with 'Nothing'"):
        readingmap.path_rows([("99_test", "Nothing")], book=tmp_path)


# A code cell that teaches: it launches or checks a lesson, defines or imports something, shows code,
# or uses a calculator the chapter teaches.
TEACHES = re.compile(
    r"lessonlib\.launch\(|panel\(|check_function|^def |^import |^from |show_code|run_python|run_bounded"
    r"|per_rank_bytes\(|sent_per_step\(|\bplan\("  # chapter 13's calculator is lesson material
    r"|sbatch\(",  # chapter 17's Slurm jobs (cluster.sbatch, run_sbatch) are its launches
    re.M,
)
# A code cell that only presents a result: a table, a plot.
PRESENTS = re.compile(r"show_table\(|plt\.|plot_ranks|\bax\.")


def plumbing_cells(path):
    """Indices of code cells that only make tables and plots (and check them): the notebook's plumbing."""
    cells = json.loads(Path(path).read_text())["cells"]
    return [
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "code"
        and PRESENTS.search("".join(c["source"]))
        and not TEACHES.search("".join(c["source"]))
    ]


@pytest.mark.unit
@pytest.mark.parametrize("notebook", [*readingmap.chapters(), readingmap.BOOK / "start.ipynb"], ids=lambda p: p.stem)
def test_plumbing_is_folded_in_the_book(notebook):
    """Tables and plots stay; the code that makes them folds away (hide-input), so that the code a page
    shows unfolded is the lesson's: its launches, its exercises, and the lesson code it captions."""
    cells = json.loads(notebook.read_text())["cells"]
    unfolded = [
        i
        for i in plumbing_cells(notebook)
        if not {"hide-input", "remove-input"} & set(cells[i].get("metadata", {}).get("tags", []))
    ]
    assert not unfolded, f"{notebook.name}: code cells {unfolded} only make tables or plots; tag them hide-input"
