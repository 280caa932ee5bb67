"""`show_table`: a list of dicts as a table, HTML in a notebook and aligned text in a terminal (chapter 1)."""

import html

from ..view.live import in_notebook

_CELL = "border:1px solid #ccc;padding:2px 8px;text-align:left;font-family:monospace"


def show_table(rows, columns=None, title=None):
    """Show a list of dicts as a table: HTML in a notebook, aligned text in a terminal (chapter 1)."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    if in_notebook():
        from IPython.display import HTML, display

        head = "".join(f'<th style="{_CELL}">{html.escape(str(c))}</th>' for c in columns)
        body = "".join(
            "<tr>" + "".join(f'<td style="{_CELL}">{html.escape(str(row.get(c, "")))}</td>' for c in columns) + "</tr>"
            for row in rows
        )
        cap = f"<caption>{html.escape(title)}</caption>" if title else ""
        display(HTML(f'<table style="border-collapse:collapse">{cap}<tr>{head}</tr>{body}</table>'))
    else:
        widths = [max(len(str(c)), *(len(str(row.get(c, ""))) for row in rows)) for c in columns]
        lines = [title] if title else []
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(columns, widths)))
        lines += ["  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)) for row in rows]
        print("\n".join(lines))
