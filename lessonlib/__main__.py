"""`python -m lessonlib run LESSON [-n N] [-- options]` and `python -m lessonlib list` (lessonlib/cli/main.py)."""

import sys

from lessonlib.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
