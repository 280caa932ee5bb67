"""lessonlib's layout, read from its sources (unit tier: nothing is imported or started).

- No import cycle among lessonlib's modules. The graph is built with ast from every `import` and
  `from ... import` in every module, the ones inside functions included: lessonlib defers many imports so
  that a rank or the terminal runner does not pay for torch or psutil, and a deferred import is still a
  dependency (it runs whenever the function does). A cycle through one would mean two modules that can
  be neither read nor moved apart one at a time, and an import order that works by accident. (The names
  `lessonlib` exports are looked up by name on first use, lessonlib/__init__.py's table: not an import.)
- The leaves, `lessonlib.paths` and `lessonlib.machine`, import the standard library alone.
- Every package's __init__ imports nothing and names each of its modules in its docstring, so its
  folder's list of what is where cannot drift from the files.
- Chapters import what they use from `lessonlib` itself (ROOT, run_bounded, Hosts, ...), not from the
  modules where those live: the layout stays lessonlib's own business.
"""

import ast
import json
import re
import sys

import pytest

from lessonlib import ROOT
from lessonlib.paths import chapter_files

pytestmark = pytest.mark.unit
PACKAGE = ROOT / "lessonlib"
LEAVES = ("lessonlib.paths", "lessonlib.machine")
# What a chapter may import from inside lessonlib: the notebook side's and the book's helper modules, and
# the rank side's modules (the same imports a lesson writes).
CHAPTER_MODULES = re.compile(r"lessonlib(\.(notebook|book|sharding|training|digits|exercises|dist|argtypes)\b.*)?$")


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name, path):
    """{module: line} for every lessonlib module that `name` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from X import y`: the module X.y if there is one, else X itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import lessonlib.a.b` names a module; trim to one that is
                target = target.rpartition(".")[0]
            if target.startswith("lessonlib") and target != name:
                found.setdefault(target, node.lineno)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def cycles(graph):
    """Every strongly connected group of more than one module (Tarjan), each as a list of modules."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_graph_sees_the_imports_it_must():
    """The reader of imports is only as good as what it finds: a top-level import, a relative one, one inside
    a function, and one of a module named in `from package import module`."""
    assert "lessonlib.launcher.request" in GRAPH["lessonlib.launcher.core"]  # from .request import check_launch
    assert "lessonlib.view.live" in GRAPH["lessonlib.launcher.core"]  # inside launch()
    assert "lessonlib.cluster.hosts" in GRAPH["lessonlib.launcher.request"]  # inside _check_hosts()
    assert "lessonlib.launcher.runfolder" in GRAPH["lessonlib.dist"]  # from .launcher import runfolder
    assert "lessonlib.launcher.fastpath.forkrank" in GRAPH["lessonlib.launcher.fastpath.agentserver"]


def test_lessonlib_has_no_import_cycle():
    found = cycles(GRAPH)
    said = [
        " -> ".join(f"{a} (line {GRAPH[a][b]})" for a, b in zip(group, group[1:] + group[:1]) if b in GRAPH[a])
        or ", ".join(group)
        for group in found
    ]
    assert found == [], "import cycles among lessonlib's modules:\n" + "\n".join(said)


def test_a_cycle_would_be_found():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


@pytest.mark.parametrize("leaf", LEAVES)
def test_a_leaf_imports_the_standard_library_alone(leaf):
    tree = ast.parse(MODULES[leaf].read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." if node.level else node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names), f"{leaf} imports {sorted(imported - set(sys.stdlib_module_names))}"


@pytest.mark.parametrize("init", [p for p in sorted(PACKAGE.rglob("__init__.py"))], ids=module_name)
def test_a_package_init_imports_nothing_and_names_each_of_its_modules(init):
    tree = ast.parse(init.read_text())
    heavy = [ast.unparse(n) for n in tree.body if isinstance(n, ast.ImportFrom) or isinstance(n, ast.Import)]
    if init.parent == PACKAGE:  # lessonlib's own: importlib alone, for the table of names it exports
        assert heavy == ["import importlib"], heavy
    else:
        assert heavy == [], f"{module_name(init)} imports {heavy}: a rank that imports one module would pay for them"
    doc = ast.get_docstring(tree) or ""
    names = [p.stem for p in sorted(init.parent.glob("*.py")) if p.name != "__init__.py"]
    names += [p.name for p in sorted(init.parent.iterdir()) if (p / "__init__.py").is_file()]
    if init.parent == PACKAGE:  # the top names its rank-side modules and its subpackages
        names = [n for n in names if n not in ("__main__",)]
    missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", doc)]
    assert missing == [], f"{module_name(init)}'s docstring does not say what {missing} are"


def chapter_imports():
    for notebook in [*chapter_files(), ROOT / "book" / "start.ipynb"]:
        cells = json.loads(notebook.read_text())["cells"]
        for cell in cells:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            for line in source.splitlines():
                m = re.match(r"\s*(?:from\s+(lessonlib[\w.]*)\s+import|import\s+(lessonlib[\w.]*))", line)
                if m:
                    yield notebook.name, m.group(1) or m.group(2), line.strip()
                for dotted in re.findall(r"\blessonlib\.(?:launcher|view|processes|cluster|cli|paths|machine)\b", line):
                    yield notebook.name, dotted, line.strip()


def test_chapters_import_what_they_use_from_lessonlib_itself():
    deep = sorted({(nb, line) for nb, module, line in chapter_imports() if not CHAPTER_MODULES.match(module)})
    assert deep == [], f"chapters reaching into lessonlib's modules (export the name from lessonlib): {deep}"
    roots = [(nb, line) for nb, module, line in chapter_imports() if re.search(r"\bROOT\b", line)]
    assert roots and all(line.startswith("from lessonlib import") for _, line in roots), roots
