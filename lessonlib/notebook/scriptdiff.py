"""The Start page's diffs: what turns a one-process script into a DDP script, and what AMP adds.

    before, middle, after = split_changes("lessons/train_one.py", "lessons/train_ddp.py", AMP_LINES)
    show_diff(before, middle)    # the DDP changes alone
    show_diff(middle, after)     # then the mixed-precision ones

`lessons/train_ddp.py` differs from `lessons/train_one.py` in two ways at once: DDP and mixed
precision. `split_changes` takes the differences between the two files, change by change, and applies
only those that have nothing to do with mixed precision (no line of the change matches the pattern):
the middle text is the DDP script without AMP. It is never stored; tests/test_train_ddp.py runs it to
prove it is a working script. A change that mixes both kinds is an error, so the split cannot
silently put an AMP line into the DDP diff.
"""

import ast
import difflib
import re
from dataclasses import dataclass

from ..launcher.request import resolve_script
from .code import Code

# A line that belongs to mixed precision in lessons/train_ddp.py.
AMP_LINES = re.compile(r"\bamp\b|amp_dtype|autocast|scaler|GradScaler|float16|mixed precision")


@dataclass(frozen=True, kw_only=True)
class Text:
    """A script's text with the name a diff gives it."""

    name: str
    text: str


def read(path, docstring=False):
    """The file at `path` as a Text; without its module docstring unless `docstring` (the two scripts'
    docstrings say different things in prose, which is not a change a reader makes to the code)."""
    text = resolve_script(path).read_text()
    if not docstring:
        body = ast.parse(text).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            text = "".join(text.splitlines(keepends=True)[body[0].end_lineno :]).lstrip("\n")
    return Text(name=str(path), text=text)


def split_changes(before, after, pattern=AMP_LINES, middle_name=None):
    """(before, middle, after) as Texts: `middle` is `before` with every change from `before` to `after`
    applied except those that match `pattern`.

    A change matches when every line it adds matches (for a change that only deletes: every line it
    deletes). A line that a change only re-indents (a block moved under a new `with`) goes with the
    rest of its change. A change that adds both matching and other lines is a ValueError naming them.
    """
    a, b = read(before), read(after)
    old, new = a.text.splitlines(keepends=True), b.text.splitlines(keepends=True)
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "equal":
            out += old[i1:i2]
            continue
        moved = {line.strip() for line in old[i1:i2]}
        judged = [line for line in new[j1:j2] if line.strip() and line.strip() not in moved]
        judged = judged or [line for line in old[i1:i2] if line.strip()]
        matching = [bool(pattern.search(line)) for line in judged]
        if any(matching) and not all(matching):
            raise ValueError(
                f"a change from {a.name} to {b.name} mixes lines that match {pattern.pattern!r} with lines that "
                f"do not (lines {i1 + 1}-{i2} of {a.name}, {j1 + 1}-{j2} of {b.name}):\n" + "".join(judged)
            )
        out += old[i1:i2] if matching and all(matching) else new[j1:j2]
    middle = Text(name=middle_name or f"{b.name} without the changes matching the pattern", text="".join(out))
    return a, middle, b


def unified(first, second, context=2):
    """The unified diff of two Texts, as a string (empty when they are equal)."""
    lines = difflib.unified_diff(
        first.text.splitlines(keepends=True),
        second.text.splitlines(keepends=True),
        fromfile=first.name,
        tofile=second.name,
        n=context,
    )
    return "".join(lines)


def show_diff(first, second, context=2):
    """The unified diff of two Texts as highlighted code (a `diff` block) in the book, Jupyter and VS Code."""
    caption = f"diff · {first.name} → {second.name}"
    return Code(unified(first, second, context).rstrip("\n"), "diff", caption=caption)


def show_file(path):
    """A whole file as highlighted Python, for a script shown in full (the Start page's train_ddp.py)."""
    return Code(read(path, docstring=True).text.rstrip("\n"), "python", caption=f"{path} · whole file")


def changed_lines(first, second):
    """(removed, added): the number of lines a diff takes away and adds."""
    removed = added = 0
    for line in unified(first, second, context=0).splitlines():
        if line.startswith("-") and not line.startswith("---"):
            removed += 1
        elif line.startswith("+") and not line.startswith("+++"):
            added += 1
    return removed, added
