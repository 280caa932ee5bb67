"""Exercises whose answer is a function that must run on every rank (chapter 2).

A notebook cannot hand a function it defines to torchrun's processes (chapter 1: they cannot import
the kernel's `__main__`). So `check_function` writes the function's source to a temporary file and
launches a checker lesson with `--solution FILE --function NAME`; the lesson loads it with
`load_function` and runs its checks on every rank. The function may use `torch` and `dist`
(torch.distributed), which the file imports; anything else it needs must be imported inside it.
"""

import importlib.util
import inspect
import os
import tempfile
import textwrap

PRELUDE = "import torch\nimport torch.distributed as dist\n\n\n"


def check_function(fn, script, nproc=3, args=(), timeout=120, show="auto"):
    """Run the checker `script` on `fn` under torchrun; AssertionError naming the first failure if it fails."""
    from .launcher import launch

    if not callable(fn) or not hasattr(fn, "__name__"):
        raise TypeError(f"check_function needs a function defined with def, got {fn!r}")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise TypeError(f"cannot read the source of {fn.__name__}: define it with def in a cell or file ({e})") from None
    with tempfile.TemporaryDirectory(prefix="lessonlib-solution-") as folder:
        path = os.path.join(folder, "solution.py")
        with open(path, "w") as f:
            f.write(PRELUDE + source)
        run = launch(script, nproc=nproc, args=[*args, "--solution", path, "--function", fn.__name__],
                     timeout=timeout, show=show)
    if not run.ok:
        cause = run.root_cause
        raise AssertionError(f"not yet: {cause.error if cause and cause.error else run.describe_failure()}")
    return run


def load_function(path, name):
    """The function `name` defined in the Python file at `path` (the lesson side of check_function)."""
    if not os.path.isfile(path):
        raise SystemExit(f"--solution {path}: no such file")
    spec = importlib.util.spec_from_file_location("solution", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SystemExit(f"--solution {path} defines no function {name!r}")
    return fn
