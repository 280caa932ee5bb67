"""Exercises whose answer is a function that must run on every rank (chapter 2).

A notebook cannot hand a function it defines to torchrun's processes (chapter 1: they cannot import
the kernel's `__main__`). So `check_function` writes the function's source to a temporary file and
launches a checker lesson with `--solution FILE --function NAME`; the lesson loads it with
`load_function` and runs its checks on every rank. The function may use `torch` and `dist`
(torch.distributed), which the file imports; anything else it needs must be imported inside it.

A checker lesson (lessons/NN_exercise_*.py) holds what is particular to its exercise: a `verdict(fn,
ctx)` that returns None or the first problem this rank saw, the reference solution between
`# [start: solution]` and `# [end: solution]` (the chapter's hidden cell shows that region), and the
plausible wrong answers. Its `main()` is one call of `run_checker`, which does the rest the same way
for every chapter: the options, the process group, the ranks' agreement on a verdict (`shared_verdict`), and
without --solution the checker's self-test on the lesson's own reference.
"""

import argparse
import importlib.util
import inspect
import os
import tempfile
import textwrap

PRELUDE = "import torch\nimport torch.distributed as dist\n\n\n"


def check_function(fn, script, nproc=3, args=(), timeout=120, show="none"):
    """Run the checker `script` on `fn` under torchrun; AssertionError naming the first failure if it fails.

    The ranks' output is not shown (show="none"): the verdict is the return or the AssertionError.
    Pass show="auto" to watch the ranks while they check.
    """
    from .launcher.core import launch

    if not callable(fn) or not hasattr(fn, "__name__"):
        raise TypeError(f"check_function needs a function defined with def, got {fn!r}")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise TypeError(
            f"cannot read the source of {fn.__name__}: define it with def in a cell or file ({e})"
        ) from None
    with tempfile.TemporaryDirectory(prefix="lessonlib-solution-") as folder:
        path = os.path.join(folder, "solution.py")
        with open(path, "w") as f:
            f.write(PRELUDE + source)
        run = launch(
            script, nproc=nproc, args=[*args, "--solution", path, "--function", fn.__name__], timeout=timeout, show=show
        )
    if not run.ok:
        cause = run.root_cause
        raise AssertionError(f"not yet: {cause.error if cause and cause.error else run.describe_failure()}")
    return run


def load_function(path, name):
    """The function `name` defined in the Python file at `path` (the lesson side of check_function)."""
    if not os.path.isfile(path):
        raise SystemExit(f"--solution {path}: no such file")
    fn = getattr(_module_from(path, "solution"), name, None)
    if not callable(fn):
        raise SystemExit(f"--solution {path} defines no function {name!r}")
    return fn


def load_lesson(stem):
    """Another lesson of the course as a module, its classes and functions, without running its main()
    (chapter 15's lessons build on each other's classes). `stem` is the file's name without `.py`."""
    from .paths import LESSONS

    path = LESSONS / f"{stem}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no lesson {stem!r}: {path} does not exist")
    return _module_from(path, stem)


def _module_from(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shared_verdict(ctx, problem):
    """The first problem any rank saw, the same string on every rank, or None if no rank saw one.

    `problem` is this rank's: None, or what it saw. Every rank must call this, whatever it found, so
    that all ranks reach the same verdict and stop together, and each can say what went wrong even
    where it saw nothing itself. The problems travel as objects (all_gather_object), which serves
    gloo's CPU tensors and nccl's GPU ones alike (setup() has bound each rank to its GPU).
    """
    import torch.distributed as dist

    every = [None] * ctx.world_size
    dist.all_gather_object(every, problem)
    # A problem may already name its rank (checkers that compare ranks): then it is shown as it is.
    return next((p if p.startswith("rank ") else f"rank {r}: {p}" for r, p in enumerate(every) if p), None)


def checker_options(doc, default_function):
    """The checker's argparse parser: --solution FILE and --function NAME. Add a lesson's own options to it."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[2] if doc else None)
    parser.add_argument("--solution", help="Python file defining the solution (without it: the checker's self-test)")
    parser.add_argument(
        "--function", default=default_function, help=f"the solution's name in that file (default: {default_function})"
    )
    return parser


def run_checker(
    doc,
    verdict,
    solutions,
    wrong=(),
    *,
    right_alone=(),
    also_right=(),
    passed="passes every check",
    device="cpu",
    timeout=20,
    args=None,
):
    """The main() of a checker lesson (chapter 2): check a reader's solution, or test the checker itself.

    verdict(fn, ctx) runs on every rank and returns None, or the first problem this rank saw.
    solutions: the lesson's reference solution(s), from its `solution` region; the first one's name is
        the --function default. also_right: other right answers the checker must accept.
    wrong: plausible wrong answers (functions, or {name: function}) the checker must reject, except
        those in right_alone at world size 1, where one rank holds everything and they are right.
    device: "cpu" for a lesson whose tensors stay on the CPU (gloo even on a GPU machine), None to
        let setup() pick (the lesson then puts its tensors on ctx.device).
    timeout: the process-group timeout; a wrong answer may leave ranks waiting, so fail in 20 s.
    args: the parsed options, for a lesson that added its own to checker_options(); parsed here if None.

    With --solution FILE the ranks agree on the verdict, and a wrong answer fails on every rank with an
    AssertionError naming what that rank saw (check_function shows the first failing rank's).
    """
    from .dist import setup, teardown

    solutions = list(solutions) if isinstance(solutions, (list, tuple)) else [solutions]
    if args is None:
        args = checker_options(doc, solutions[0].__name__).parse_args()
    fn = load_function(args.solution, args.function) if args.solution else None  # a bad file: no group joined
    ctx = setup(device=device, timeout=timeout)
    if fn is not None:
        problem = shared_verdict(ctx, verdict(fn, ctx))
        assert problem is None, problem  # on every rank, naming the rank that saw it
        print(f"rank {ctx.rank}: {args.function} {passed}")
    else:
        self_test(ctx, verdict, [*solutions, *also_right], wrong, right_alone)
    teardown()


def self_test(ctx, verdict, right, wrong, right_alone=()):
    """Every function in `right` must pass; every one in `wrong` must fail (but right_alone at world size 1)."""
    for fn in right:
        problem = shared_verdict(ctx, verdict(fn, ctx))
        assert problem is None, f"rank {ctx.rank}: the checker rejects {fn.__name__}: {problem}"
    wrong = wrong if isinstance(wrong, dict) else {fn.__name__: fn for fn in wrong}
    alone = {name for name, fn in wrong.items() if fn in right_alone or name in right_alone}
    problems = {name: shared_verdict(ctx, verdict(fn, ctx)) for name, fn in wrong.items()}  # on every rank, in order
    rejected = [name for name, problem in problems.items() if problem]
    missed = [name for name in wrong if name not in rejected and (ctx.world_size > 1 or name not in alone)]
    assert not missed, f"rank {ctx.rank}: the checker accepted the wrong answer(s) {missed}"
    too_strict = [name for name in rejected if ctx.world_size == 1 and name in alone]
    assert not too_strict, f"rank 0: the checker rejected {too_strict}, which are right at world size 1"
    names = " and ".join(fn.__name__ for fn in right)
    print(f"rank {ctx.rank}: checker self-test: accepts {names}, rejects {rejected}")
    if ctx.world_size == 1 and alone:  # one rank holds every row: these mistakes do no harm here
        print(f"rank 0: at world size 1 these wrong answers are right, so they are not rejected: {sorted(alone)}")
    if ctx.is_main:
        for name in rejected:
            print(f"  {name}: {problems[name]}")
