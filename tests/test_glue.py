"""Numbers in the prose come from the run the page shows: `lessonlib.glue` and the chapters' `{glue}` roles.

The book build fails on a role whose name no cell glued (a Sphinx warning, and warnings are errors); these
tests find the same mistake, and a name glued but never cited, in seconds, from the notebooks' sources.
"""

import json
import re

import numpy as np
import pytest
import torch

from lessonlib import ROOT
from lessonlib.notebook.glue import _plain, glue

pytestmark = pytest.mark.unit

CHAPTERS = sorted((ROOT / "book").glob("*.ipynb"))
ROLE = re.compile(r"\{glue(?::\w+)?\}`([^`]+)`")
CALL = re.compile(r"""\bglue\(\s*f?["']([\w-]+)["']""")


def _names(path):
    cells = json.loads(path.read_text())["cells"]
    cited, glued = set(), set()
    for cell in cells:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            cited |= {m.split("::")[-1].split(":")[0] for m in ROLE.findall(text)}
        elif cell["cell_type"] == "code":
            glued |= set(CALL.findall(text))
    return cited, glued


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_cited_number_is_glued_by_a_cell_and_every_glued_one_is_cited(path):
    cited, glued = _names(path)
    assert not cited - glued, f"{path.name}: the prose cites {sorted(cited - glued)}, which no cell glues"
    assert not glued - cited, f"{path.name}: cells glue {sorted(glued - cited)}, which the prose never cites"


def test_scalars_become_python_numbers_the_role_can_read_back():
    assert _plain(np.float64(0.28)) == 0.28 and type(_plain(np.float64(0.28))) is float
    assert type(_plain(np.int64(3))) is int
    assert _plain(torch.tensor(1.5)) == 1.5
    assert _plain("text") == "text"
    with pytest.raises(TypeError, match="single number"):
        _plain(torch.ones(2))


def test_a_bad_name_is_refused():
    with pytest.raises(ValueError, match="letters, digits"):
        glue("has space", 1)
