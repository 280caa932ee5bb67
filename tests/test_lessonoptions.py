"""lessonlib.notebook.options: a lesson's options as the run panel edits them, with no widget and no kernel.

The options come from a real argparse parser, described by lessonlib.notebook._argspec.describe in this process
(the panel runs the same function in a fresh one, on the lesson itself): one option of every kind.
"""

import argparse

import pytest

import lessonlib
from lessonlib.notebook._argspec import describe
from lessonlib.notebook.options import LessonOptions, Option

pytestmark = pytest.mark.unit


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6, help="SGD steps")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=None)  # optional: not given unless set
    p.add_argument("--workers", type=int, choices=range(0, 5), default=2)
    p.add_argument("--mode", choices=["plain", "join"], default="join")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--sizes", type=lessonlib.comma_list(int, low=1, high=16), default=[1, 4])
    return p


@pytest.fixture
def options():
    return LessonOptions([Option.from_spec(s) for s in describe(parser())], "lessons/x.py")


def test_each_kind_is_read_from_the_parser(options):
    kinds = {o.flag: o.kind for o in options}
    assert kinds == {
        "--steps": "int",
        "--lr": "float",
        "--seed": "int",
        "--workers": "int",
        "--mode": "choice",
        "--verbose": "switch",
        "--shuffle": "bool",
        "--sizes": "text",
    }
    workers = options.by_flag["--workers"]
    assert (workers.low, workers.high) == (0, 4) and options.by_flag["--steps"].help == "SGD steps"
    assert [o.flag for o in options if o.as_text] == ["--seed", "--sizes"]


def test_the_controls_start_from_the_defaults_and_give_no_arguments(options):
    values = options.initial()
    assert values == {
        "--steps": 6,
        "--lr": 0.1,
        "--seed": "",
        "--workers": 2,
        "--mode": "join",
        "--verbose": False,
        "--shuffle": True,
        "--sizes": "1,4",
    }
    assert options.args(values) == [] and options.problems(values) == []
    assert not options.needs_lesson_check(values)


def test_a_command_line_sets_the_values_and_comes_back_as_given(options):
    argv = ["--steps", "3", "--lr=0.5", "--seed", "7", "--mode", "plain", "--verbose", "--no-shuffle", "--sizes", "2,8"]
    values = options.apply(argv)
    assert values["--steps"] == 3 and values["--lr"] == 0.5 and values["--seed"] == "7"
    assert values["--verbose"] is True and values["--shuffle"] is False and values["--sizes"] == "2,8"
    assert options.args(values) == [a for a in " ".join(argv).replace("=", " ").split()]
    assert options.needs_lesson_check(values)  # --seed and --sizes are text: the lesson's parser judges them


def test_apply_starts_from_the_values_it_is_given(options):
    values = options.apply(["--steps", "9"], options.apply(["--verbose"]))
    assert values["--steps"] == 9 and values["--verbose"] is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nope", "1"], "lessons/x.py has no option '--nope'; its options: --steps, --lr"),
        (["--steps"], "option --steps needs a value"),
        (["--steps", "many"], "--steps must be an integer; got 'many'"),
        (["--mode", "fast"], "--mode must be one of plain, join; got 'fast'"),
    ],
)
def test_a_bad_command_line_names_what_is_wrong(options, argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        options.apply(argv)


def test_values_out_of_range_or_not_numbers_are_problems_before_anything_starts(options):
    values = {**options.initial(), "--workers": 7, "--seed": "seven"}
    assert options.problems(values) == [
        "--seed must be an integer (or empty for the lesson's default); got 'seven'",
        "--workers must be from 0 to 4; got 7",
    ]
    assert options.problems({**values, "--workers": 4, "--seed": " 3 "}) == []


def test_an_optional_number_left_empty_is_not_given(options):
    values = {**options.initial(), "--seed": "  "}
    assert options.args(values) == [] and options.problems(values) == []


def test_an_option_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="--x: kind must be one of switch, bool, choice, int, float, text; got 'list'"):
        Option(flag="--x", kind="list", default=None)
