"""Command-line helpers shared by lessons and benchmarks (chapter 2).

    parser.add_argument("--ops", type=comma_list(choices=OPS), default="broadcast,reduce")
    parser.add_argument("--lengths", type=comma_list(int, low=1), default="1,7,1001")

argparse also applies `type` to a string default, so the default is checked the same way, and a bad
value stops the script with "argument --ops: ..." before any process group is joined.
"""

import argparse


def comma_list(kind=str, choices=None, low=None, high=None):
    """An argparse `type`: "a,b,c" -> [kind("a"), kind("b"), kind("c")], each checked, none empty."""

    def parse(text):
        try:
            items = [kind(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None
        if not items:
            raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
        if choices is not None and (unknown := [i for i in items if i not in choices]):
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(map(str, choices))}")
        outside = [i for i in items if (low is not None and i < low) or (high is not None and i > high)]
        if outside:
            bounds = f"{'' if low is None else low}..{'' if high is None else high}"
            raise argparse.ArgumentTypeError(f"{outside} outside the allowed range {bounds}")
        return items

    return parse
