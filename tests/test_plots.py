"""lessonlib.plot_ranks (chapter 2 on): one panel per step, one box per element, one colour scale."""

import matplotlib
import matplotlib.pyplot
import pytest

import lessonlib

pytestmark = pytest.mark.unit

matplotlib.use("Agg")


def test_plot_ranks_draws_one_box_per_element_and_marks_empty_ranks():
    fig = lessonlib.plot_ranks(
        {"before": [[1, 2, 3], [11, 12, 13]], "after": [[1, 2, 3, 11, 12, 13], None]}, title="gather"
    )
    ax = fig.axes[0]
    assert len(ax.patches) == 3 + 3 + 6  # the None rank draws no boxes
    texts = [t.get_text() for t in ax.texts]
    assert "(nothing)" in texts and "rank 1" in texts and "13" in texts and fig._suptitle.get_text() == "gather"
    matplotlib.pyplot.close(fig)


def test_plot_ranks_wraps_panels_onto_rows_with_one_colour_scale():
    panels = {name: [[k], [k + 10]] for k, name in enumerate("abcde")}
    fig = lessonlib.plot_ranks(panels, per_row=2)
    assert len(fig.axes) == 3  # 2 + 2 + 1 panels
    assert [len(a.patches) for a in fig.axes] == [4, 4, 2]
    first, last = fig.axes[0].patches[0].get_facecolor(), fig.axes[2].patches[0].get_facecolor()
    assert first != last  # 0 and 4 differ on the shared scale (a per-row scale would give both its lowest colour)
    matplotlib.pyplot.close(fig)


def test_plot_ranks_shares_one_colour_scale_across_panels():
    fig = lessonlib.plot_ranks({"a": [[5]], "b": [[5], [9]]})
    colours = [tuple(p.get_facecolor()) for p in fig.axes[0].patches]
    assert colours[0] == colours[1] != colours[2]  # equal values, equal colours, in different panels
    matplotlib.pyplot.close(fig)
