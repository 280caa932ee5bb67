"""Chapter 12's NCCL column quotes torch's own words: each quoted line must still be in the installed torch.

lessonlib.notebook.ncclmessages pairs each symptom's gloo text with NCCL's, quoted from a GPU run of
lessons/12_nccl.py or from torch's source, and names the file of the installed torch (or the NCCL and
CUDA libraries its wheel installs) that holds the fixed parts of each quote. Here those parts are looked up
in those files, byte for byte, so an upgrade that rewords a message fails this test instead of leaving the
chapter wrong. A row marked absent quotes text from another version: it must still be missing.
"""

import json
import re
import runpy
from pathlib import Path

import pytest

from lessonlib.notebook import ncclmessages

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("message", ncclmessages.MESSAGES, ids=lambda m: m.symptom[:40])
def test_each_quoted_line_is_in_the_installed_torch(message):
    if not message.parts + message.also:
        assert message.seen == "source" and not message.file, "a row with no quote must say it was not run"
        return
    found = ncclmessages.find_in_torch(message.file, message.parts + message.also)
    if message.absent:
        assert not any(found.values()), f"{message.file} has this text again, update the row: {found}"
    else:
        missing = [part for part, ok in found.items() if not ok]
        assert not missing, f"not in the installed {message.file}: {missing} (torch reworded it: update the row)"


def test_each_run_row_quotes_what_the_gpu_run_printed():
    printed = "\n".join(case["output"] for case in json.loads(ncclmessages.CAPTURE.read_text())["cases"])
    for message in ncclmessages.MESSAGES:
        if message.seen == "run":
            for part in message.parts:
                assert part in printed, f"{message.symptom}: {part!r} is not in the captured run"


def test_the_capture_is_of_the_lesson_as_it_is():
    # Same cases, and every expectation of the lesson met by the captured output.
    lesson = runpy.run_path(str(ROOT / "lessons" / "12_nccl.py"))
    captured = {case["case"]: case for case in json.loads(ncclmessages.CAPTURE.read_text())["cases"]}
    assert set(captured) == set(lesson["CASES"]), "run lessons/12_nccl.py --save on a GPU again"
    for name, case in lesson["CASES"].items():
        for label, pattern in case.expected:
            assert re.search(pattern, captured[name]["output"]), f"{name}: {label}"


def test_a_file_that_is_not_installed_is_named():
    with pytest.raises(FileNotFoundError, match="no/such/lib.so is not installed"):
        ncclmessages.find_in_torch("no/such/lib.so", ("x",))
