"""Pictures of what each rank holds (chapter 2): one row per rank, one box per element.

    plot_ranks({"before": [[1, 2], [11, 12]], "after": [[1, 2], [1, 2]]}, title="broadcast from rank 0")

Each panel is a list with one entry per rank: a list of numbers, or None for "holds nothing here"
(for example the output of gather on ranks other than dst). The numbers come from a real run's
reports; this module only draws them. matplotlib is imported on first use.
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


def plot_ranks(panels, title=None, colour_of=None, box=0.55, ax=None):
    """Draw every panel side by side; returns the matplotlib figure.

    colour_of(value) -> a number used for the colour (default: the value itself). The colour scale is
    shared by all panels, so equal numbers have equal colours everywhere in the picture.
    """
    import matplotlib.pyplot as plt

    colour_of = colour_of or (lambda v: v)
    n = max(len(rows) for rows in panels.values())
    widths = [max([len(r) for r in rows if r is not None] or [1]) for rows in panels.values()]
    keys = [colour_of(v) for rows in panels.values() for r in rows if r is not None for v in r]
    lo, hi = (min(keys), max(keys)) if keys else (0, 0)
    gap = 1.5
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(4.0, box * (sum(widths) + gap * len(widths)) + 1.2),
                                        0.5 + box * (n + 1.2)))
    else:
        fig = ax.figure
    x0 = 0.0
    for (name, rows), width in zip(panels.items(), widths):
        ax.text(x0 + width / 2, -0.9, name, ha="center", va="center", fontsize=10, weight="bold")
        for rank, values in enumerate(rows):
            if values is None:
                ax.text(x0 + width / 2, rank + 0.5, "(nothing)", ha="center", va="center", color="grey",
                        fontsize=8)
                continue
            for j, v in enumerate(values):
                key = colour_of(v)
                face = _colour(key, lo, hi)
                ax.add_patch(plt.Rectangle((x0 + j + 0.04, rank + 0.04), 0.92, 0.92, color=face))
                dark = sum(face[:3]) < 1.4
                ax.text(x0 + j + 0.5, rank + 0.5, _text(v), ha="center", va="center",
                        fontsize=8 if len(_text(v)) > 3 else 9, color="white" if dark else "black")
        x0 += width + gap
    for rank in range(n):
        ax.text(-0.3, rank + 0.5, f"rank {rank}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.6, x0 - gap + 0.2)
    ax.set_ylim(n + 0.2, -1.4)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    return fig
