"""Execute one chapter notebook as the book build does: `python -m lessonlib._execute_notebook`.

    python tests/helpers/execute_notebook.py book/NN.ipynb OUT.ipynb TIMEOUT
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lessonlib._execute_notebook import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
