"""`python -m lessonlib run LESSON [-n N] [-- options]` and `python -m lessonlib list` (launcher/terminal.py)."""

import sys

from lessonlib.launcher.terminal import main

if __name__ == "__main__":
    sys.exit(main())
