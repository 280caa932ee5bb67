"""A lesson's own argparse parser, read or applied without running the lesson (the run panel, chapter 2).

    python -m lessonlib.notebook._argspec describe LESSON OUT.json
    python -m lessonlib.notebook._argspec check LESSON OUT.json [LESSON OPTIONS ...]

The lesson runs as `__main__` up to its `parse_args()` call, which this module replaces: `describe`
writes the parser's options to OUT.json; `check` parses the given options with the lesson's parser
(argparse prints its usual error and exits 2 on a bad one) and writes the result. Either way the
process leaves there, before the lesson does anything else. The run panel calls this in a fresh
process only for lessons whose source builds an ArgumentParser, so a lesson is never run in full.
"""

import argparse
import json
import os
import runpy
import sys


def _plain(value):
    """`value` as JSON can hold it (a range or a function default becomes its repr)."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def describe(parser):
    """One dict per option: what lessonlib.notebook.options.Option is made from."""
    options = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        flags = action.option_strings
        item = {
            "flag": next((f for f in flags if f.startswith("--")), flags[0]) if flags else None,
            "help": action.help or "",
            "default": _plain(action.default),
        }
        if isinstance(action, argparse.BooleanOptionalAction):
            item["kind"] = "bool"  # --x / --no-x
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            item["kind"] = "switch"  # giving the flag flips the default
        elif action.choices is not None and isinstance(action.choices, range) and action.type is int:
            item.update(kind="int", low=action.choices.start, high=action.choices.stop - 1)
        elif action.choices is not None:
            item.update(kind="choice", choices=[_plain(c) for c in action.choices])
        elif action.nargs in (None, "?") and action.type in (int, float):
            item["kind"] = action.type.__name__
        else:
            item["kind"] = "text"  # a `type` of the lesson's own (comma_list, ...) is the lesson's to check
        options.append(item)
    return options


def main():
    mode, lesson, out, *args = sys.argv[1:]
    real_parse_args = argparse.ArgumentParser.parse_args

    def intercept(self, args=None, namespace=None):
        if mode == "describe":
            result = {"options": describe(self)}
        else:
            parsed = real_parse_args(self, args, namespace)  # a bad option exits 2 here, as in the lesson
            result = {"parsed": {k: _plain(v) for k, v in vars(parsed).items()}}
        with open(out, "w") as f:
            json.dump(result, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the lesson goes no further

    argparse.ArgumentParser.parse_args = intercept
    sys.argv = [lesson, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(lesson)))  # as `python lessons/X.py` has it
    runpy.run_path(lesson, run_name="__main__")
    # The lesson returned without parsing its arguments (and the caller made sure it builds a parser).
    with open(out, "w") as f:
        json.dump({"options": [], "unparsed": True}, f)


if __name__ == "__main__":
    main()
