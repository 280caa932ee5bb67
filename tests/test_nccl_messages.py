"""Chapter 12 quotes torch's own words: each quoted line must still be in the installed torch.

lessonlib.notebook.ncclmessages pairs each symptom's gloo text with NCCL's, quoted from a GPU run of
lessons/12_nccl.py or from torch's source, and lists the prose's other quotes from torch that no run on the
page prints. Each names the file of the installed torch (or of the NCCL and CUDA libraries its wheel
installs) that holds the fixed parts of the quote. Here those parts are looked up in those files, byte for
byte, so an upgrade that rewords a message fails this test instead of leaving the chapter wrong. A lookup
marked present=False quotes another version's words: they must still be missing. Where a file is not
installed (libtorch_cuda.so and nvidia/ in a CPU-only torch), its lookups skip and say which file.
"""

import json
import re
import runpy

import pytest

from lessonlib import ROOT
from lessonlib.notebook import ncclmessages
from lessonlib.notebook.ncclmessages import Lookup

pytestmark = pytest.mark.unit


LOOKUPS = [(m.symptom, lookup) for m in ncclmessages.MESSAGES for lookup in m.lookups]
LOOKUPS += [(q.said, lookup) for q in ncclmessages.QUOTES for lookup in q.lookups]


def check(lookup):
    """The lookup's parts are in its file (or, for another version's words, are not); skip if it is missing."""
    why = ncclmessages.missing(lookup.file)
    if why:
        pytest.skip(why)
    found = ncclmessages.find_in_torch(lookup.file, lookup.parts)
    if lookup.present:
        gone = [part for part, ok in found.items() if not ok]
        assert not gone, f"not in the installed {lookup.file}: {gone} (torch reworded it: update chapter 12)"
    else:
        back = [part for part, ok in found.items() if ok]
        assert not back, f"{lookup.file} has these words again, update chapter 12: {back}"


@pytest.mark.parametrize(
    ("quote", "lookup"), LOOKUPS, ids=[f"{q[:40]}|{lk.file.rsplit('/', 1)[-1]}" for q, lk in LOOKUPS]
)
def test_each_quote_is_in_the_installed_torch(quote, lookup):
    check(lookup)


def test_a_row_with_no_quote_says_it_was_not_run():
    for message in ncclmessages.MESSAGES:
        if not message.lookups:
            assert message.seen == "source" and not message.printed, message.symptom


def test_each_run_row_quotes_what_the_gpu_run_printed():
    printed = "\n".join(case["output"] for case in json.loads(ncclmessages.CAPTURE.read_text())["cases"])
    for message in ncclmessages.MESSAGES:
        assert message.seen in ("run", "source"), message.symptom
        for part in message.printed:
            assert part in printed, f"{message.symptom}: {part!r} is not in the captured run"


def test_the_capture_is_of_the_lesson_as_it_is():
    # Same cases, and every expectation of the lesson met by the captured output.
    lesson = runpy.run_path(str(ROOT / "lessons" / "12_nccl.py"))
    captured = {case["case"]: case for case in json.loads(ncclmessages.CAPTURE.read_text())["cases"]}
    assert set(captured) == set(lesson["CASES"]), "run lessons/12_nccl.py --save on a GPU again"
    for name, case in lesson["CASES"].items():
        for label, pattern in case.expected:
            assert re.search(pattern, captured[name]["output"]), f"{name}: {label}"


def test_a_library_that_is_not_installed_skips_its_lookups_and_names_it(monkeypatch, tmp_path):
    # A CPU-only torch: torch/ without lib/libtorch_cuda.so, and no nvidia/ beside it.
    (tmp_path / "torch" / "lib").mkdir(parents=True)
    (tmp_path / "torch" / "lib" / "libtorch_cpu.so").write_bytes(b"\0TORCH_FR_DUMP_TEMP_FILE\0")
    monkeypatch.setattr(ncclmessages, "torch_site_packages", lambda: tmp_path)
    for file in (ncclmessages.CUDA, ncclmessages.NCCL):
        with pytest.raises(pytest.skip.Exception, match=re.escape(file)):
            check(Lookup(file=file, parts=("anything",)))
    check(Lookup(file=ncclmessages.CPU, parts=("TORCH_FR_DUMP_TEMP_FILE",)))  # an installed file is still read
    with pytest.raises(AssertionError, match="reworded"):
        check(Lookup(file=ncclmessages.CPU, parts=("not there",)))
    with pytest.raises(AssertionError, match="has these words again"):
        check(Lookup(file=ncclmessages.CPU, parts=("TORCH_FR_DUMP_TEMP_FILE",), present=False))


def test_find_in_torch_names_a_missing_file():
    with pytest.raises(FileNotFoundError, match="no/such/lib.so is not installed"):
        ncclmessages.find_in_torch("no/such/lib.so", ("x",))
