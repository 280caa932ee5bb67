"""Where the course's files are: the checkout's root, the lessons and chapters, and the one rule that finds a
lesson file. A leaf: the standard library only, so anything (a rank, the terminal runner's `--help`, a test
at collection) can import it for free.

    from lessonlib import ROOT            # the course checkout: lessons/ and book/ live here
    lesson_files()                        # every lessons/NN_name.py, in order
    find_script("lessons/01_launch.py")   # the file a launch, the runner and the rebuild cache mean by it
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the course checkout: lessons/ and book/ live here
LESSONS = ROOT / "lessons"
BOOK = ROOT / "book"
LESSON_GLOB = "[0-9][0-9]_*.py"  # a lesson is lessons/NN_name.py; NN is its chapter
CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"  # a chapter is book/NN_name.ipynb


def lesson_files(root=ROOT):
    """Every lesson under `root`/lessons, by file name (a new lesson is found the moment it is added)."""
    return sorted((Path(root) / "lessons").glob(LESSON_GLOB))


def chapter_files(root=ROOT):
    """Every numbered chapter notebook under `root`/book, in order."""
    return sorted((Path(root) / "book").glob(CHAPTER_GLOB))


def script_candidates(script, bases=(), here=None):
    """Where a lesson named `script` may be, first match wins: as given if absolute; else relative to each
    of `bases`, then to the working folder `here` (default: this process's), then to the course root
    (notebooks run in book/, lessons live in lessons/). The one lookup rule of launch, the terminal runner
    and the book's rebuild cache."""
    path = Path(script)
    if path.is_absolute():
        return [path]
    return list(dict.fromkeys(Path(b) / path for b in [*bases, here or Path.cwd(), ROOT]))


def find_script(script, bases=(), here=None):
    """The first of script_candidates that is a file, resolved; or None."""
    return next((c.resolve() for c in script_candidates(script, bases, here) if c.is_file()), None)
