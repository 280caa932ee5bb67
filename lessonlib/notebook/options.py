"""A lesson's command-line options as the run panel edits them: read, set, checked and turned back into
arguments, with no widget and no kernel (chapter 2).

    options = LessonOptions.of(lesson_path)          # from the lesson's own argparse parser
    values = options.apply(["--steps", "5"])          # {flag: value} the controls start from
    options.problems(values)                          # what is wrong, before anything starts
    options.args(values)                              # ['--steps', '5']: defaults left out

Each Option has a kind, from the parser (lessonlib.notebook._argspec): "switch" (a store_true or store_false
flag), "bool" (--x / --no-x), "choice", "int" or "float" (a number; an optional one, whose default is
None, is held as text where "" means not given), or "text" (anything else: a list, a type of the
lesson's own such as lessonlib.comma_list). A value is what a control holds: a bool, the chosen
string, a number, or text. Only the lesson's parser can judge text, so `needs_lesson_check` says when
the panel must ask it (lessonlib.notebook._argspec check).
"""

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..paths import ROOT

KINDS = ("switch", "bool", "choice", "int", "float", "text")
SPEC_TIMEOUT = 60  # seconds to read a lesson's options (it imports torch)
_read = {}  # (path, mtime) -> [Option]


@dataclass(frozen=True, kw_only=True)
class Option:
    flag: str  # its --long flag
    kind: str  # one of KINDS
    default: object  # the parser's default, as JSON holds it
    help: str = ""
    choices: tuple = ()  # kind "choice"
    low: int | None = None  # kind "int" with choices=range(low, high + 1)
    high: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.flag}: kind must be one of {', '.join(KINDS)}; got {self.kind!r}")

    @classmethod
    def from_spec(cls, spec):
        """From one dict of lessonlib.notebook._argspec.describe."""
        return cls(
            flag=spec["flag"],
            kind=spec["kind"],
            default=spec["default"],
            help=spec.get("help", ""),
            choices=tuple(str(c) for c in spec.get("choices", ())),
            low=spec.get("low"),
            high=spec.get("high"),
        )

    @property
    def as_text(self):
        """Held as text: free text, or a number the lesson may leave unset (default None)."""
        return self.kind == "text" or self.kind in ("int", "float") and not _is_number(self.default)

    @property
    def shown_default(self):
        """The default as the control shows it: a list as comma-separated text, None as ""."""
        if self.default is None:
            return ""
        return ",".join(map(str, self.default)) if isinstance(self.default, list) else str(self.default)

    @property
    def initial(self):
        """The value a control starts from: the lesson's default."""
        if self.kind == "switch":
            return False
        if self.kind == "bool":
            return bool(self.default)
        if self.kind == "choice":
            return self.shown_default if self.shown_default in self.choices else self.choices[0]
        return self.shown_default if self.as_text else self.default

    def parse(self, text):
        """The value that `--flag TEXT` on a command line gives the control."""
        if self.as_text or self.kind == "choice":
            if self.kind == "choice" and text not in self.choices:
                raise ValueError(f"{self.flag} must be one of {', '.join(self.choices)}; got {text!r}")
            return text
        try:
            return (int if self.kind == "int" else float)(text)
        except ValueError:
            raise ValueError(f"{self.flag} must be {_a_number(self.kind)}; got {text!r}") from None

    def problem(self, value):
        """What is wrong with `value`, or None. Text the lesson's own type parses is not judged here."""
        if self.kind in ("int", "float") and self.as_text:
            if not value.strip():
                return None  # not given: the lesson's default
            try:
                value = (int if self.kind == "int" else float)(value.strip())
            except ValueError:
                return f"{self.flag} must be {_a_number(self.kind)} (or empty for the lesson's default); got {value!r}"
        if self.kind == "int" and self.low is not None and not self.low <= value <= self.high:
            return f"{self.flag} must be from {self.low} to {self.high}; got {value}"
        return None

    def args(self, value):
        """The arguments that give the lesson `value`; none when it is the default."""
        if self.kind == "switch":
            return [self.flag] if value else []
        if self.kind == "bool":
            return [] if value == bool(self.default) else [self.flag if value else "--no-" + self.flag[2:]]
        if isinstance(value, str):
            return [] if value.strip() in ("", self.shown_default) else [self.flag, value.strip()]
        return [] if value == self.default else [self.flag, str(value)]

    def needs_lesson_check(self, value):
        """Whether only the lesson's own parser can judge `value` (text, given)."""
        return self.as_text and bool(self.args(value))


class LessonOptions:
    """The options of one lesson, in its parser's order, by flag."""

    def __init__(self, options, script="the lesson"):
        self.by_flag = {o.flag: o for o in options}
        self.script = script

    @classmethod
    def of(cls, path, script=None):
        """The options of the lesson at `path`, read once per version of the file (read_specs)."""
        return cls([Option.from_spec(s) for s in read_specs(path) if s["flag"]], script or str(path))

    def __iter__(self):
        return iter(self.by_flag.values())

    def initial(self):
        return {o.flag: o.initial for o in self}

    def apply(self, argv, values=None):
        """`values` (default: the initial ones) updated from a list like ['--steps', '5', '--flag'];
        an option the lesson does not have, or one without its value, is a ValueError."""
        values = dict(values or self.initial())
        argv, i = [str(a) for a in argv], 0
        while i < len(argv):
            flag, text = argv[i], None
            if "=" in flag:
                flag, text = flag.split("=", 1)
            negated = flag.startswith("--no-") and "--" + flag[5:] in self.by_flag
            option = self.by_flag.get("--" + flag[5:] if negated else flag)
            if option is None:
                have = ", ".join(self.by_flag) or "none"
                raise ValueError(f"{self.script} has no option {flag!r}; its options: {have}")
            if option.kind in ("switch", "bool"):
                values[option.flag] = not negated if option.kind == "bool" else True
            else:
                if text is None:
                    i += 1
                    if i >= len(argv):
                        raise ValueError(f"option {flag} needs a value")
                    text = argv[i]
                values[option.flag] = option.parse(text)
            i += 1
        return values

    def args(self, values):
        """The lesson's arguments for `values`, as torchrun would get them (defaults left out)."""
        return [a for o in self for a in o.args(values[o.flag])]

    def problems(self, values):
        return [p for o in self if (p := o.problem(values[o.flag]))]

    def needs_lesson_check(self, values):
        return any(o.needs_lesson_check(values[o.flag]) for o in self)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _a_number(kind):
    return "an integer" if kind == "int" else "a number"


def run_argspec(mode, path, args=()):
    """Run lessonlib.notebook._argspec in a fresh process, bounded; (exit code, its JSON or None, stderr)."""
    with tempfile.TemporaryDirectory(prefix="lessonlib-argspec-") as folder:
        out = Path(folder) / "out.json"
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "lessonlib.notebook._argspec", mode, str(path), str(out), *args],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=SPEC_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"reading the options of {path} took over {SPEC_TIMEOUT} s") from None
        data = json.loads(out.read_text()) if out.exists() else None
        return proc.returncode, data, proc.stderr


def read_specs(path):
    """The lesson's argparse options as lessonlib.notebook._argspec.describe gives them ([] without argparse)."""
    path = Path(path)
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _read:
        if "ArgumentParser" not in path.read_text():
            _read[key] = []  # no parser: nothing to read, and the lesson must not be run to find out
        else:
            code, data, err = run_argspec("describe", path)
            if code != 0 or data is None:
                raise RuntimeError(f"could not read the options of {path} (exit {code}):\n{err[-2000:]}")
            _read[key] = data["options"]
    return _read[key]
