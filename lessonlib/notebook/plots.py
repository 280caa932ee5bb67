"""Pictures of what each rank holds (chapter 2): one row per rank, one box per element.

    plot_ranks({"before": [[1, 2], [11, 12]], "after": [[1, 2], [1, 2]]}, title="broadcast from rank 0")

Each panel is a list with one entry per rank: a list of numbers, or None for "holds nothing here"
(for example the output of gather on ranks other than dst). The numbers come from a real run's
reports; this module only draws them. matplotlib is imported on first use.

`marked` (chapter 3) outlines chosen boxes, for example the padding duplicates a sampler added:

    plot_ranks({"epoch 0": shards}, marked={"epoch 0": is_padding}, mark_label="padding duplicate")
"""


def _colour(value, lo, hi):
    import matplotlib

    if hi == lo:
        return matplotlib.colormaps["Blues"](0.35)
    return matplotlib.colormaps["viridis"](0.15 + 0.8 * (value - lo) / (hi - lo))


def _text(value):
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.3g}"
    return f"{int(value)}" if isinstance(value, float) else str(value)


def plot_ranks(panels, title=None, colour_of=None, box=0.55, ax=None, per_row=None, marked=None, mark_label="marked"):
    """Draw the panels left to right, at most `per_row` to a row of the figure; returns the figure.

    colour_of(value) -> a number used for the colour (default: the value itself). The colour scale is
    shared by all panels, so equal numbers have equal colours everywhere in the picture. With `ax`,
    everything is drawn on that one axis (per_row is then ignored). `marked` maps a panel name to one
    list of booleans per rank, shaped like that panel's values: True boxes get a red hatched outline,
    explained under the picture by `mark_label`.
    """
    import matplotlib.pyplot as plt

    colour_of = colour_of or (lambda v: v)
    marked = marked or {}
    for name, rows in marked.items():
        if name not in panels:
            raise ValueError(f"marked names panel {name!r}; the panels are {list(panels)}")
        shapes = [None if r is None else len(r) for r in panels[name]]
        if [None if r is None else len(r) for r in rows] != shapes:
            raise ValueError(f"marked[{name!r}] must have one boolean per value, per rank: shapes {shapes}")
    keys = [colour_of(v) for rows in panels.values() for r in rows if r is not None for v in r]
    lo, hi = min(keys, default=0), max(keys, default=0)
    names = list(panels)
    step = len(names) if ax is not None or not per_row else per_row
    lines = [{k: panels[k] for k in names[i : i + step]} for i in range(0, len(names), step)]
    if ax is not None:
        _draw(ax, panels, colour_of, lo, hi, marked)
        fig = ax.figure
    else:
        n = max(len(rows) for rows in panels.values())
        widest = max(sum(_width(rows) + 1.5 for rows in line.values()) for line in lines)
        fig, axes = plt.subplots(
            len(lines), 1, squeeze=False, figsize=(max(4.0, box * widest + 1.2), len(lines) * (0.5 + box * (n + 1.2)))
        )
        for axis, line in zip(axes[:, 0], lines):
            _draw(axis, line, colour_of, lo, hi, marked)
    if title:
        fig.suptitle(title, fontsize=11)
    if any(any(any(r) for r in rows if r) for rows in marked.values()):
        fig.legend(
            handles=[plt.Rectangle((0, 0), 1, 1, facecolor="white", **MARK)],
            labels=[mark_label],
            loc="lower center",
            frameon=False,
            fontsize=9,
        )
    return fig


MARK = dict(edgecolor="red", linewidth=2.0, hatch="///")


def _width(rows):
    return max([len(r) for r in rows if r is not None] or [1])


def _draw(ax, panels, colour_of, lo, hi, marked=None):
    """Boxes for every panel on one axis, left to right, coloured on the shared scale lo..hi."""
    import matplotlib.pyplot as plt

    n = max(len(rows) for rows in panels.values())
    widths = [_width(rows) for rows in panels.values()]
    gap = 1.5
    x0 = 0.0
    for (name, rows), width in zip(panels.items(), widths):
        ax.text(x0 + width / 2, -0.9, name, ha="center", va="center", fontsize=10, weight="bold")
        for rank, values in enumerate(rows):
            if values is None:
                ax.text(x0 + width / 2, rank + 0.5, "(nothing)", ha="center", va="center", color="grey", fontsize=8)
                continue
            marks = (marked or {}).get(name, [None] * len(rows))[rank] or [False] * len(values)
            for j, v in enumerate(values):
                key = colour_of(v)
                face = _colour(key, lo, hi)
                ax.add_patch(plt.Rectangle((x0 + j + 0.04, rank + 0.04), 0.92, 0.92, color=face))
                if marks[j]:
                    ax.add_patch(plt.Rectangle((x0 + j + 0.08, rank + 0.08), 0.84, 0.84, fill=False, **MARK))
                dark = sum(face[:3]) < 1.4
                ax.text(
                    x0 + j + 0.5,
                    rank + 0.5,
                    _text(v),
                    ha="center",
                    va="center",
                    fontsize=8 if len(_text(v)) > 3 else 9,
                    color="white" if dark else "black",
                )
        x0 += width + gap
    for rank in range(n):
        ax.text(-0.3, rank + 0.5, f"rank {rank}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.6, x0 - gap + 0.2)
    ax.set_ylim(n + 0.2, -1.4)
    ax.set_aspect("equal")
    ax.axis("off")
