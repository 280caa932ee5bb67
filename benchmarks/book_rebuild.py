"""python benchmarks/book_rebuild.py [--jobs N] [--chapter 05_dp_vs_ddp] [--lesson lessons/05_by_hand.py]

How long `jupyter-book build book` takes cold and on each kind of rebuild, and what each one executes.

Works on a copy of the course in a temporary folder (the checkout is never edited), with that copy's
lessonlib, and runs the reader's command there five times:
  cold          an empty _build: every chapter executes, --jobs at a time (BOOK_JOBS)
  unchanged     nothing edited
  prose         one word added to a markdown cell of --chapter
  lesson        a comment line added to --lesson
  code          a comment line added to a code cell of --chapter
For each it prints the wall time and the chapters that executed, and for the cold build the sum of
the chapters' own execution times over the wall time (how much running them side by side saved).
No threshold: this reports, it does not pass or fail (tests/test_code.py checks which chapters each
kind of edit executes).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lessonlib import ROOT, run_bounded

JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")
BUILD_TIMEOUT = 3600  # seconds for one build: a bound against a hang (a cold build takes ~15 min on 2 cores)


def copy_course(dest):
    """The files git tracks (and any chapter or lesson not yet added), without _build/ or .venv/."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split("\n")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def build(course, env):
    """One `jupyter-book build book` in the copy: (seconds, {chapter: seconds executed}, log)."""
    started = time.monotonic()
    done = run_bounded([JUPYTER_BOOK, "build", "book", "-W", "-n", "--keep-going"], BUILD_TIMEOUT, cwd=course, env=env)
    seconds = time.monotonic() - started
    if done.timed_out or done.returncode != 0:
        what = f"did not finish in {BUILD_TIMEOUT} s" if done.timed_out else f"failed (exit {done.returncode})"
        raise SystemExit(f"the build {what}:\n{done.output[-5000:]}")
    report = json.loads((course / "_build" / "lessonlib-execution.json").read_text())
    return seconds, {Path(p).stem: s for p, s in report["executed"].items()}, report


def edit_notebook(path, cell_type, change):
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == cell_type)
    source = "".join(cell["source"])
    cell["source"] = change(source)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--jobs", type=int, default=None, help="chapters at once (BOOK_JOBS; default: by CPU count)")
    parser.add_argument("--chapter", default="05_dp_vs_ddp", help="the chapter whose prose and code are edited")
    parser.add_argument("--lesson", default="lessons/05_by_hand.py", help="the lesson that is edited")
    args = parser.parse_args()
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more")
    if not (ROOT / "book" / f"{args.chapter}.ipynb").is_file():
        parser.error(
            f"--chapter {args.chapter}: no book/{args.chapter}.ipynb; chapters: "
            + ", ".join(p.stem for p in sorted((ROOT / "book").glob("*.ipynb")))
        )
    if not (ROOT / args.lesson).is_file():
        parser.error(f"--lesson {args.lesson}: no such file under {ROOT}")

    env = dict(os.environ)
    if args.jobs is not None:
        env["BOOK_JOBS"] = str(args.jobs)
    with tempfile.TemporaryDirectory(prefix="book-rebuild-") as folder:
        course = Path(folder)
        copy_course(course)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(course), os.environ.get("PYTHONPATH")]))
        print(f"building a copy of the course in {course} (cpu count {os.cpu_count()})", flush=True)
        rows = []
        seconds, executed, report = build(course, env)
        rows.append(("cold", seconds, executed))
        print(
            f"cold: {seconds:.0f} s, {len(executed)} chapters, {report['jobs']} at a time; their own execution "
            f"times add up to {sum(executed.values()):.0f} s, {sum(executed.values()) / seconds:.2f}x the wall time",
            flush=True,
        )
        chapter = course / "book" / f"{args.chapter}.ipynb"
        lesson = course / args.lesson
        steps = [
            ("unchanged", lambda: None),
            ("prose", lambda: edit_notebook(chapter, "markdown", lambda s: s.rstrip("\n") + " Indeed.")),
            ("lesson", lambda: lesson.write_text(lesson.read_text() + "# edited by benchmarks/book_rebuild.py\n")),
            ("code", lambda: edit_notebook(chapter, "code", lambda s: s + "\n# edited")),
        ]
        for name, edit in steps:
            edit()
            seconds, executed, _ = build(course, env)
            rows.append((name, seconds, executed))
            print(f"{name}: {seconds:.1f} s", flush=True)
    print("\n| rebuild | wall time | chapters executed |\n|---|---|---|")
    for name, seconds, executed in rows:
        names = ", ".join(sorted(executed)) if 0 < len(executed) < 4 else f"{len(executed)}"
        print(f"| {name} | {seconds:.1f} s | {names} |")


if __name__ == "__main__":
    main()
