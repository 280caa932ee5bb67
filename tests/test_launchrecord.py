"""The book's record of what it ran (lessonlib.book.launchrecord) and its committed summary, launches.json.

The unit tests write and read records in a temporary folder: a launch's line says whether it took the
reader's default path (built from launch's own signature defaults, so the two cannot part), a command's
line is the command as a reader types it, malformed lines are refused with their file and line, and a
summary merges a build's record with the committed one chapter by chapter. The others start processes:
several writers appending at once leave whole lines, and a real launch and a real bounded command write
their line only while a record is being made.
"""

import inspect
import json
import os
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest

import lessonlib
from lessonlib import ROOT, run_bounded
from lessonlib.book import launchrecord
from lessonlib.book.launchrecord import RecordError, Summary
from lessonlib.launcher.request import check_launch
from lessonlib.processes.bounded import Finished
from test_book import record_drift

HELPER = "tests/helpers/print_lines.py"  # each rank prints a few lines; needs no process group


@pytest.fixture
def record(tmp_path, monkeypatch):
    """A record being made, as the book build makes one for chapter 'NN.ipynb': its path."""
    path = tmp_path / launchrecord.RECORD_FILE
    monkeypatch.setenv(launchrecord.RECORD_VAR, str(path))
    monkeypatch.setenv(launchrecord.CHAPTER_VAR, "NN.ipynb")
    return path


def spec(**changes):
    """A LaunchSpec of HELPER as `lessonlib.launch(HELPER)` makes it with its own defaults, but `changes`."""
    params = inspect.signature(lessonlib.launch).parameters
    checked = inspect.signature(check_launch).parameters
    given = {name: p.default for name, p in params.items() if name in checked and name != "script"}
    return check_launch(HELPER, **{**given, **changes})


def ok(value=True):
    return SimpleNamespace(ok=value)  # what record_launch reads of a RunResult


def finished(returncode=0, timed_out=False):
    return Finished(argv=[], returncode=returncode, stdout="", stderr=None, seconds=0.1, timed_out=timed_out)


def line(kind, **fields):
    base = {
        "launch": {"script": "lessons/01_a.py", "ranks": 2, "defaults": True, "changed": [], "ok": True},
        "command": {"command": "python lessons/11_a.py", "defaults": True, "changed": [], "ok": True},
        "chapter": {"ok": True},
    }[kind]
    return {"chapter": "01_a.ipynb", "kind": kind, **base, **fields}


def write_lines(path, entries):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


@pytest.mark.unit
def test_nothing_is_written_without_a_record(tmp_path, monkeypatch):
    monkeypatch.delenv(launchrecord.RECORD_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    assert launchrecord.record_file() is None
    launchrecord.record_launch(spec(), ok())
    launchrecord.record_command([sys.executable, "-c", "pass"], ROOT, None, finished())
    launchrecord.record_chapter(True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_a_launch_line_says_whether_it_took_the_default_path(record, tmp_path):
    launchrecord.record_launch(spec(), ok())
    launchrecord.record_launch(spec(nproc=3), ok(False))
    launchrecord.record_launch(spec(args=["--lines", "1"]), ok())
    launchrecord.record_launch(spec(env={"X": "1"}, nnodes=2, cwd=tmp_path), ok())
    launchrecord.record_launch(spec(timeout=5), ok())  # a bound, not a change to what the ranks do
    entries = launchrecord.read_record(record)
    assert [(e["script"], e["ranks"], e["defaults"], e["changed"], e["ok"]) for e in entries] == [
        (HELPER, 2, True, [], True),
        (HELPER, 3, True, [], False),
        (HELPER, 2, False, ["args"], True),
        (HELPER, 4, False, ["env", "nnodes", "cwd"], True),  # ranks: the world size, 2 nodes of 2
        (HELPER, 2, True, [], True),
    ]
    assert {e["chapter"] for e in entries} == {"NN.ipynb"} and {e["kind"] for e in entries} == {"launch"}
    # Every setting of a launch but the lesson, its ranks and its bound is one the defaults name: a new
    # option cannot be taken for the reader's default path unnoticed.
    settings = set(inspect.signature(check_launch).parameters) - {"script", "nproc", "timeout"}
    assert settings == set(launchrecord.LAUNCH_DEFAULTS)


@pytest.mark.unit
def test_a_command_line_is_the_command_as_a_reader_types_it(record, tmp_path):
    argv = [sys.executable, "lessons/11_spawn.py", "--world-size", "2", "two words"]
    launchrecord.record_command(argv, ROOT, None, finished())
    launchrecord.record_command(argv, ROOT, {"TMPDIR": "/x"}, finished(1))
    launchrecord.record_command(argv, tmp_path, None, finished(0, timed_out=True))
    launchrecord.record_chapter(False)
    entries = launchrecord.read_record(record)
    assert [(e["kind"], e.get("command"), e.get("defaults"), e.get("changed"), e["ok"]) for e in entries] == [
        ("command", "python lessons/11_spawn.py --world-size 2 'two words'", True, [], True),
        ("command", "python lessons/11_spawn.py --world-size 2 'two words'", False, ["env"], False),
        ("command", "python lessons/11_spawn.py --world-size 2 'two words'", False, ["cwd"], False),
        ("chapter", None, None, None, False),
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, said",
    [
        ('{"kind": "launch"\n', "line 1: not JSON"),
        (json.dumps(line("launch")) + "\n" + json.dumps(line("chapter")), "line 2: cut short"),
        ('["launch"]\n', "line 1: not a record line"),
        (json.dumps({**line("chapter"), "kind": "run"}) + "\n", "line 1: not a record line"),
        (json.dumps(line("launch", ranks="2")) + "\n", "line 1: a launch line needs 'ranks' (int); it has '2'"),
        (json.dumps(line("launch", ranks=True)) + "\n", "line 1: a launch line needs 'ranks' (int); it has True"),
        (json.dumps(line("command", ok="yes")) + "\n", "needs 'ok' (bool)"),
        (json.dumps(line("chapter", chapter=None)) + "\n", "a chapter line needs 'chapter' (str); it has None"),
        (json.dumps(line("chapter")) + "\n" + json.dumps({"kind": "command"}) + "\n", "line 2: a command line"),
    ],
    ids=["json", "cut", "list", "kind", "str-ranks", "bool-ranks", "ok", "no-chapter", "missing"],
)
def test_a_malformed_line_is_named_with_its_file_and_line(tmp_path, text, said):
    path = tmp_path / "r.jsonl"
    path.write_text(text)
    with pytest.raises(RecordError) as e:
        launchrecord.read_record(path)
    assert str(e.value).startswith(f"{path}, line "), e.value
    assert said in str(e.value), e.value


@pytest.mark.unit
def test_a_missing_record_is_a_clear_error(tmp_path):
    with pytest.raises(RecordError, match="cannot read the book's launch record"):
        launchrecord.read_record(tmp_path / "absent.jsonl")
    assert launchrecord.read_record(write_lines(tmp_path / "empty.jsonl", [])) == []


@pytest.mark.unit
def test_the_summary_keeps_what_ran_with_defaults_and_succeeded():
    entries = [
        line("launch"),
        line("launch", ranks=4, ok=False),  # failed
        line("launch", ranks=3, defaults=False, changed=["args"]),  # other arguments
        line("launch", script="/tmp/x/sleeper.py"),  # not a file of the course
        line("launch", chapter="02_b.ipynb"),  # the same run in another chapter: both kept
        line("command"),
        line("command", command="python lessons/11_a.py --port 1", defaults=False, changed=["env"]),
        line("command", command="python lessons/11_b.py", ok=False),
        line("chapter"),
    ]
    summary = launchrecord.summarise(entries)
    assert summary.launches == {("lessons/01_a.py", 2, "01_a.ipynb"), ("lessons/01_a.py", 2, "02_b.ipynb")}
    assert summary.commands == {("python lessons/11_a.py", "01_a.ipynb")}
    assert summary.chapters_launching("lessons/01_a.py", 2) == ["01_a.ipynb", "02_b.ipynb"]
    assert summary.chapters_launching("lessons/01_a.py", 3) == []
    assert summary.chapters_running("python  lessons/11_a.py") == ["01_a.ipynb"]  # word by word
    assert summary.chapters_running("python lessons/11_a.py --port 1") == []


@pytest.mark.unit
def test_the_summary_is_sorted_one_entry_a_line_and_reads_back(tmp_path):
    summary = Summary(
        frozenset(
            {("lessons/09_b.py", 3, "09_b.ipynb"), ("lessons/01_a.py", 4, "01_a.ipynb"), ("lessons/01_a.py", 2, "x")}
        ),
        frozenset({("python lessons/11_a.py --n 2", "11_a.ipynb")}),
    )
    text = launchrecord.dump(summary)
    assert text.splitlines()[3:7] == [
        '  {"script": "lessons/01_a.py", "ranks": 2, "chapter": "x"},',
        '  {"script": "lessons/01_a.py", "ranks": 4, "chapter": "01_a.ipynb"},',
        '  {"script": "lessons/09_b.py", "ranks": 3, "chapter": "09_b.ipynb"}',
        " ],",
    ]
    path = tmp_path / "launches.json"
    path.write_text(text)
    assert launchrecord.load(path) == summary
    assert launchrecord.dump(launchrecord.load(path)) == text
    path.write_text('{"launches": []}')
    with pytest.raises(RecordError, match="not a summary of the book's launches .* make book-record"):
        launchrecord.load(path)


@pytest.mark.unit
def test_the_committed_summary_is_as_launchrecord_writes_it():
    text = launchrecord.SUMMARY.read_text()
    assert launchrecord.dump(launchrecord.load()) == text, (
        f"{launchrecord.SUMMARY} was edited by hand: {launchrecord.REWRITE} writes it"
    )


@pytest.mark.unit
def test_a_rewrite_replaces_the_chapters_the_build_executed_and_keeps_the_others(tmp_path):
    summary = tmp_path / "launches.json"
    summary.write_text(
        launchrecord.dump(
            Summary(
                frozenset(
                    {
                        ("lessons/01_a.py", 2, "01_a.ipynb"),  # executed again, no longer run: goes
                        ("lessons/02_b.py", 2, "02_b.ipynb"),  # not executed (cache fresh): stays
                        ("lessons/03_c.py", 2, "03_c.ipynb"),  # executed, launches nothing now: goes
                        ("lessons/99_z.py", 2, "99_gone.ipynb"),  # no longer in the toc: goes
                    }
                ),
                frozenset({("python lessons/02_b.py", "02_b.ipynb")}),
            )
        )
    )
    record = write_lines(
        tmp_path / "r.jsonl",
        [
            line("launch", ranks=4),
            line("command", command="python lessons/01_a.py --n 2"),
            line("chapter"),
            line("chapter", chapter="03_c.ipynb"),
            line("launch", chapter="88_draft.ipynb"),  # executed, but not in the toc: not the book's
            line("chapter", chapter="88_draft.ipynb"),
        ],
    )
    chapters = {"01_a.ipynb", "02_b.ipynb", "03_c.ipynb"}
    new, old = launchrecord.rewrite(record, summary, chapters)
    assert old.launches and launchrecord.load(summary) == new
    assert new.launches == {("lessons/01_a.py", 4, "01_a.ipynb"), ("lessons/02_b.py", 2, "02_b.ipynb")}
    assert new.commands == {("python lessons/01_a.py --n 2", "01_a.ipynb"), ("python lessons/02_b.py", "02_b.ipynb")}
    text = summary.read_text()
    launchrecord.rewrite(record, summary, chapters)
    assert summary.read_text() == text  # the same record, the same file
    # A build that executed nothing changes nothing.
    launchrecord.rewrite(write_lines(tmp_path / "nothing.jsonl", []), summary, chapters)
    assert summary.read_text() == text


@pytest.mark.unit
def test_a_record_of_a_chapter_that_did_not_run_to_its_end_is_refused(tmp_path):
    summary = tmp_path / "launches.json"
    for entries, said in [
        ([line("launch"), line("chapter", ok=False)], "01_a.ipynb: failed"),
        ([line("launch"), line("chapter", chapter="02_b.ipynb")], "01_a.ipynb: did not run to its end"),
    ]:
        record = write_lines(tmp_path / "r.jsonl", entries)
        with pytest.raises(RecordError, match=f"not every chapter of that build ran to its end \\({said}\\)"):
            launchrecord.rewrite(record, summary, {"01_a.ipynb", "02_b.ipynb"})
        assert not summary.exists()


@pytest.mark.unit
def test_the_command_line_rewrites_the_summary_and_says_what_changed(tmp_path, monkeypatch, capsys):
    summary = tmp_path / "launches.json"
    monkeypatch.setattr(launchrecord, "SUMMARY", summary)
    chapter = sorted(launchrecord.toc_chapters())[0]
    record = write_lines(tmp_path / "r.jsonl", [line("launch", chapter=chapter), line("chapter", chapter=chapter)])
    launchrecord.main([str(record)])
    assert launchrecord.load(summary).launches == {("lessons/01_a.py", 2, chapter)}
    assert f"+ lessons/01_a.py at 2 rank(s), in {chapter}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="usage: python -m lessonlib.book.launchrecord"):
        launchrecord.main([])
    cut = tmp_path / "cut.jsonl"
    cut.write_text(json.dumps(line("launch")))
    with pytest.raises(SystemExit, match="line 1: cut short"):
        launchrecord.main([str(cut)])


@pytest.mark.unit
def test_the_book_test_names_what_drifted_both_ways_and_how_to_rewrite_it(tmp_path):
    summary = tmp_path / "launches.json"
    summary.write_text(
        launchrecord.dump(
            Summary(frozenset({("lessons/01_a.py", 2, "01_a.ipynb"), ("lessons/01_a.py", 3, "01_a.ipynb")}))
        )
    )
    same = write_lines(tmp_path / "same.jsonl", [line("launch"), line("launch", ranks=3), line("chapter")])
    assert record_drift(same, summary) is None
    other = write_lines(
        tmp_path / "other.jsonl",
        [line("launch"), line("launch", ranks=3, ok=False), line("launch", ranks=4), line("chapter")],
    )
    said = record_drift(other, summary)
    assert "In it, but not run by this build with default arguments and every rank ok" in said, said
    assert "\n  lessons/01_a.py at 3 rank(s), in 01_a.ipynb\n" in said, said
    assert "Run by this build, but not in it (the tests run these a second time):\n  lessons/01_a.py at 4" in said
    assert f"python -m lessonlib.book.launchrecord {other}" in said and "make book-record" in said, said
    with pytest.raises(RecordError, match="did not run to its end"):
        record_drift(write_lines(tmp_path / "partial.jsonl", [line("launch")]), summary)


def test_writers_appending_at_once_leave_whole_lines(tmp_path):
    """Chapters execute side by side and append to one record: four processes, each writing lines of up to
    three times a pipe buffer's size at once (after all four are up), leave every line whole."""
    path, go = tmp_path / "r.jsonl", tmp_path / "up"
    go.mkdir()
    writer = textwrap.dedent(f"""
        import os, sys, time
        from lessonlib.book import launchrecord
        me = sys.argv[1]
        open(os.path.join({str(go)!r}, me), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir({str(go)!r})) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(300):
            launchrecord.append({{"kind": "command", "command": me * (1 + i * 41 % 12000), "defaults": True,
                                  "changed": [], "ok": True}})
            time.sleep(0.001)  # the four writers' lines interleave
    """)
    env = {**os.environ, launchrecord.RECORD_VAR: str(path), launchrecord.CHAPTER_VAR: "w.ipynb"}
    done = [None] * 4

    def run(i):
        done[i] = run_bounded([sys.executable, "-c", writer, "abcd"[i]], 120, cwd=ROOT, env=env)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert all(d is not None and d.returncode == 0 and not d.timed_out for d in done), [d and d.output for d in done]
    entries = launchrecord.read_record(path)
    assert len(entries) == 1200
    for me in "abcd":
        mine = [e["command"] for e in entries if e["command"][0] == me]
        assert [len(c) for c in mine] == [1 + i * 41 % 12000 for i in range(300)], me
        assert all(set(c) == {me} for c in mine), me
    switches = sum(a["command"][0] != b["command"][0] for a, b in zip(entries, entries[1:]))
    assert switches > 3, "the writers took turns, never writing at once: not a test of it"


def test_a_launch_and_a_bounded_command_write_their_line_only_while_recording(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    monkeypatch.delenv(launchrecord.RECORD_VAR, raising=False)
    assert lessonlib.launch(HELPER, nproc=2, timeout=120, show="none").ok
    run_bounded([sys.executable, "-c", "pass"], 60, cwd=ROOT, record=True)
    assert not path.exists()
    monkeypatch.setenv(launchrecord.RECORD_VAR, str(path))
    monkeypatch.setenv(launchrecord.CHAPTER_VAR, "NN.ipynb")
    lessonlib.launch(HELPER, nproc=2, timeout=120, show="none").raise_for_status()
    lessonlib.launch(HELPER, nproc=2, args=["--lines", "1"], timeout=120, show="none").raise_for_status()
    run_bounded([sys.executable, "-c", "import sys; sys.exit(3)"], 60, cwd=ROOT, record=True)
    run_bounded([sys.executable, "-c", "pass"], 60, cwd=ROOT)  # not asked to record
    assert launchrecord.read_record(path) == [
        {
            "chapter": "NN.ipynb",
            "kind": "launch",
            "script": HELPER,
            "ranks": 2,
            "defaults": True,
            "changed": [],
            "ok": True,
        },
        {
            "chapter": "NN.ipynb",
            "kind": "launch",
            "script": HELPER,
            "ranks": 2,
            "defaults": False,
            "changed": ["args"],
            "ok": True,
        },
        {
            "chapter": "NN.ipynb",
            "kind": "command",
            "command": "python -c 'import sys; sys.exit(3)'",
            "defaults": True,
            "changed": [],
            "ok": False,
        },
    ]
