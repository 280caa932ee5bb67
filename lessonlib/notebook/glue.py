"""`glue`: a number the prose states, taken from the run the page shows.

A chapter's sentence such as "the fp16 step took 0.28 of the plain one" must say what the run above it
printed, not what an earlier run did. The cell that computes the number glues it under a name:

    lessonlib.glue("fp16_ratio", fp16_ms / plain_ms)

and the prose cites it with MyST-NB's role, with an optional format spec:

    the fp16 step took {glue:text}`fp16_ratio:.2f` of the plain one

The book build (MyST-NB) pastes the value from this execution's output; a name the prose cites that no
cell glued is a build warning, and the build treats warnings as errors. In Jupyter or VS Code the role
shows as written; the value is in the cell's own printed output above it.

NumPy and torch scalars are turned into Python numbers first: the role reads the value back from its
text form, and `np.float64(0.28)` would not parse as a number.
"""

import numbers

__all__ = ["glue"]


def _plain(value):
    """A Python int, float, bool or str for a number-like value; anything else as it is."""
    if type(value) in (bool, int, float, str):  # not isinstance: np.float64 is a float subclass
        return value
    item = getattr(value, "item", None)  # numpy and torch scalars, one-element tensors
    if callable(item):
        try:
            return item()
        except (ValueError, RuntimeError) as exc:
            raise TypeError(f"glue() takes a single number, not {type(value).__name__} of several") from exc
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def glue(name: str, value):
    """Record `value` under `name` for this page's prose, without showing it (returns None, so a cell
    that ends with it prints nothing)."""
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"glue name must be letters, digits, '_' or '-', got {name!r}")
    value = _plain(value)
    from myst_nb import glue as myst_glue  # noqa: PLC0415  (imported on first use, as the package does)

    myst_glue(name, value, display=False)
