"""Execute one chapter notebook exactly as `jupyter-book build` does, and save the executed copy.

    python tests/helpers/execute_notebook.py book/NN.ipynb OUT.ipynb TIMEOUT

Same function, same settings as MyST-NB's execution (execute_notebooks: force, run_in_temp: false):
jupyter-cache's single_nb_execution, the kernel started in the notebook's own folder, TIMEOUT seconds
per cell, errors not allowed. On success the executed notebook is written to OUT and the seconds
printed; on a failing cell, the cell's index and source and the error go to stderr, exit status 1.
"""

import json
import sys
from pathlib import Path

import nbformat
from jupyter_cache.executors.utils import single_nb_execution


def main():
    source, out, timeout = Path(sys.argv[1]).resolve(), Path(sys.argv[2]), int(sys.argv[3])
    nb = nbformat.read(source, as_version=4)
    result = single_nb_execution(nb, cwd=str(source.parent), timeout=timeout, allow_errors=False)
    if result.err is not None:
        # nbclient stops at the failing cell: it is the last code cell that has an execution count or an error.
        failed = next((i for i, c in reversed(list(enumerate(nb.cells)))
                       if c.cell_type == "code" and any(o.get("output_type") == "error" for o in c.get("outputs", []))),
                      None)
        print(json.dumps({"cell": failed, "source": nb.cells[failed].source if failed is not None else None,
                          "error": result.exc_string}), file=sys.stderr)
        sys.exit(1)
    nbformat.write(nb, out)
    print(f"{result.time:.1f}")


if __name__ == "__main__":
    main()
