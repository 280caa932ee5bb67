"""`python -m lessonlib run LESSON [-n N] [-- options]` and `python -m lessonlib list` (lessonlib/runner.py)."""

import sys

from lessonlib.runner import main

if __name__ == "__main__":
    sys.exit(main())
