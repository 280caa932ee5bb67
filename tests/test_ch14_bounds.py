"""Chapter 14's launches end inside the time the book gives a cell, so a slow run is stopped and said, not fatal.

The book executes every cell with a timeout (`execute.timeout` in _config.yml, 300 s). A cell whose launches
could together run past it would fail the whole page on a slow machine, where the launch's own bound would
have ended the run and let the cell say so (the inductor compile of *torch.compile with DDP* does: it prints
that it was stopped). Read from the notebook's code, with no process started: every `lessonlib.launch` call,
its `timeout=` (a number, or a name the cell assigns a number; the launcher's default 120 s if none),
times the length of each literal tuple a `for` loop around it runs over, added up per cell.
"""

import ast
import json
import re

import pytest

from lessonlib import ROOT

pytestmark = pytest.mark.unit

CHAPTER = ROOT / "book" / "14_cheaper.ipynb"
DEFAULT_LAUNCH_TIMEOUT = 120  # lessonlib.launch's default
MARGIN = 30  # seconds a cell needs beyond its launches: a fresh agent, tables, cleaning up


def cell_timeout():
    config = (ROOT / "_config.yml").read_text()
    return int(re.search(r"^\s+timeout:\s*(\d+)", config, re.M).group(1))


def launch_budget(source):
    """Seconds the cell's launches may take at most, by their bounds."""
    tree = ast.parse(source)
    names = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def visit(node, times):
        total = 0
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            times *= len(node.iter.elts)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "lessonlib.launch":
            bound = next((k.value for k in node.keywords if k.arg == "timeout"), None)
            if bound is None:
                seconds = DEFAULT_LAUNCH_TIMEOUT
            elif isinstance(bound, ast.Constant):
                seconds = bound.value
            else:
                seconds = names[ast.unparse(bound)]  # KeyError: a bound this test cannot read
            total += seconds * times
        return total + sum(visit(child, times) for child in ast.iter_child_nodes(node))

    return visit(tree, 1)


def code_cells():
    cells = json.loads(CHAPTER.read_text())["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def test_the_budget_counts_loops_and_named_bounds():
    source = 'B = 50\nlessonlib.launch("a", timeout=B)\nfor x in (1, 2, 3):\n    lessonlib.launch("b", timeout=10)\n'
    assert launch_budget(source) == 50 + 3 * 10
    assert launch_budget('lessonlib.launch("a")') == DEFAULT_LAUNCH_TIMEOUT


@pytest.mark.parametrize("index, source", code_cells(), ids=[f"cell{i}" for i, _ in code_cells()])
def test_a_cells_launches_end_inside_the_cell_timeout(index, source):
    budget, limit = launch_budget(source), cell_timeout()
    assert budget + MARGIN <= limit, (
        f"{CHAPTER.name} cell {index}: its launches may take {budget} s by their bounds, and the book gives the "
        f"cell {limit} s: a slow machine would fail the page instead of ending the run within its bound"
    )


def test_the_inductor_cell_says_when_its_bound_stopped_the_compile():
    [source] = [s for _, s in code_cells() if '"--backend", "inductor"' in s]
    assert "timed_out" in source and "raise_for_status" in source.split("timed_out")[1], (
        "the inductor cell must check the launch's timed_out before raise_for_status, and say it was stopped"
    )
