"""Every word the course says about a run: its status line, one line per rank, the failure story, and the
text views (chapter 1).

A run that failed is told the same way everywhere (the HTML view, `str(run)`, `LaunchError`,
`python -m lessonlib run`): first one line per rank, how it ended and where it was
(`rank 0: RuntimeError: Timed out ...; at lessons/12_hang.py:57 in epoch_end: dist.barrier()`), then
the details: the root cause's traceback, the stacks of the ranks that were stopped. `render_text` is
`str(run)`; `render_columns` puts the ranks side by side in a terminal (`python -m lessonlib run --columns`).
When the machine made the run fail (`run.fault`: a full disk, too many open files, a rank likely killed
by the out-of-memory killer; lessonlib.launcher.faults), the story and `str(run)` open with
`Cause: ...`, that line, before anything about the ranks.

Every traceback and stack they show is folded (lessonlib.view.tracebacks.fold): the lesson's own frames,
the first and the innermost of what it called, and one line for the rest.
"""

from dataclasses import dataclass

from ..launcher.status import RunStatus
from .tracebacks import Frame, code_only, cut, folded_text, innermost_frame, short_error, short_paths, stack_dump

EVERY_FRAME = "run.{what}"  # where a fold line sends the reader for every frame: run.ranks[1].stderr
MIN_COLUMN = 24  # characters: the terminal's columns (render_columns) are never narrower
SOURCE_CHARS = 100  # a source line in a one-line summary is cut here


def command_line(script, args, nproc, nnodes):
    nodes = f"--nnodes={nnodes} " if nnodes > 1 else ""
    return " ".join(["torchrun", f"{nodes}--nproc_per_node={nproc}", script, *args])


@dataclass(frozen=True)
class RankLine:
    """How one rank ended, and where it was, in one line."""

    rank: int
    what: str  # "exit 0", "RuntimeError: ...", "hung: ..."
    tag: str = ""  # "root cause", "left early: look here first"
    frame: Frame | None = None

    @property
    def where(self):
        if self.frame is None:
            return ""
        f = self.frame
        code = cut(code_only(f.source), SOURCE_CHARS)
        return f"at {short_paths(f.file)}:{f.line} in {f.function}" + (f": {code}" if code else "")

    def __str__(self):
        tag = f" ({self.tag})" if self.tag else ""
        return f"rank {self.rank}{tag}: {self.what}" + (f"; {self.where}" if self.where else "")


def rank_line(result, r):
    """The RankLine of rank output `r` of `result`."""
    cause, left_early = result.root_cause, result.left_early
    # When every failure only says a peer went away and a rank left early, the first to fail is a victim.
    tag = ("first to fail" if left_early else "root cause") if cause is not None and r is cause else ""
    if r.status == RunStatus.OK:
        early = r.rank in left_early
        what = "exit 0, before the others failed" if early else "exit 0"
        return RankLine(r.rank, what, "left early: look here first" if early else "")
    if r.status == RunStatus.NOT_STARTED:
        return RankLine(r.rank, "never started its script")
    if r.status == RunStatus.HUNG:
        what = f"hung: still running at the {result.timeout:g} s timeout, then killed"
    elif r.status == RunStatus.INTERRUPTED:
        what = "interrupted: still running when the run was stopped, then killed"
    elif r.status == RunStatus.TERMINATED and r.error == "killed by SIGTERM":
        what = "stopped by torchrun (SIGTERM)" + (" after another rank failed" if cause is not None else "")
    elif r.status == RunStatus.TERMINATED and r.error:
        what = f"stopped ({r.error})"
    elif r.status == RunStatus.TERMINATED and r.exitcode is not None:
        what = f"stopped, exit code {r.exitcode}"
    elif r.status == RunStatus.TERMINATED:
        what = "stopped before it recorded an exit (no exit code known)"
    else:
        what = how_it_failed(r)
    stack = r.traceback or stack_dump(r.stderr)
    return RankLine(r.rank, what, tag, innermost_frame(stack) if stack else None)


LAUNCHER_WORDS = ("killed by ", "exit code ")  # how how_it_failed starts when the rank recorded no error


def how_it_failed(r):
    """A failed rank's end in a few words: its error, or the signal that killed it, or its exit code."""
    if r.error.startswith("killed by "):
        return f"{r.error} (exit {r.exitcode})"
    if r.error and r.error != f"exit code {r.exitcode}":
        return short_error(r.error)
    return f"exit code {r.exitcode}"


def agents_failed(result):
    """What torchrun's agents said when every rank exited 0 but an agent did not: 'torchrun exited 1'."""
    bad = [(node, rc) for node, rc in enumerate(result.returncodes) if rc != 0]
    if len(result.returncodes) == 1:
        return f"torchrun exited {bad[0][1]}"
    return ", ".join(f"torchrun of node {node} exited {rc}" for node, rc in bad)


def failed_ranks_text(result):
    """'failed on rank(s) 1 of 2', or, when every rank exited 0 and torchrun did not, that (never an empty list)."""
    if result.failed_ranks:
        return f"failed on rank(s) {joined(result.failed_ranks)} of {result.world_size}"
    return f"failed: every rank exited 0, but {agents_failed(result)}"


def rank_lines(result):
    """One RankLine per rank, in rank order."""
    return [rank_line(result, r) for r in result.ranks]


def status_line(result):
    cmd = command_line(result.script, result.args, result.nproc, result.nnodes)
    if result.ok:
        ranks = f"{result.world_size} rank" + ("" if result.world_size == 1 else "s")
        return f"ok: {cmd} ({ranks}, {result.wall_time:.2f} s)"
    if result.timed_out:
        what = f"timed out after {result.timeout:g} s"
    elif result.interrupted:
        what = "interrupted"
    elif result.failed_ranks:
        what = f"failed on rank(s) {joined(result.failed_ranks)}"
    else:
        what = f"failed (every rank exited 0, but {agents_failed(result)})"
    cause = result.root_cause
    error = short_error(cause.error) if cause else ""
    why = f"; first failure: rank {cause.rank}" + (f" ({error})" if error else "") if cause else ""
    return f"{what}: {cmd} ({result.wall_time:.2f} s){why}"


def failure_line(result):
    """One line: what went wrong, naming the rank and its error (the last line `python -m lessonlib run`
    prints)."""
    cause = result.root_cause
    first = ""
    if cause is not None:
        how = how_it_failed(cause)
        first = f"rank {cause.rank} failed first" + (f", {how}" if how.startswith(LAUNCHER_WORDS) else f" with {how}")
    if result.timed_out:
        stuck = [r.rank for r in result.ranks if r.status == RunStatus.HUNG]
        line = f"{result.script} timed out after {result.timeout:g} s (--timeout)"
        if stuck:
            line += f"; rank(s) {joined(stuck)} were still running and were killed"
        return line + (f"; before that, {first}" if first else "")
    if result.interrupted:
        return f"{result.script} was interrupted" + (f"; before that, {first}" if first else "")
    return f"{result.script} {failed_ranks_text(result)}" + (f": {first}" if first else "")


def cause_line(result):
    """'Cause: ...' when the machine made the run fail (RunResult.fault), else ''."""
    fault = getattr(result, "fault", None)
    return f"Cause: {fault}" if fault else ""


def describe_failure(result, details=True):
    """What went wrong, for a person: `Cause: ...` when the machine made it fail, a headline, one line per
    rank, then (with `details`) the root cause's traceback and the stacks of the ranks that were stopped.
    RunResult.describe_failure and LaunchError's message."""
    if result.ok:
        return f"{result.script}: " + (
            "its one rank exited 0" if result.world_size == 1 else f"all {result.world_size} ranks exited 0"
        )
    cause = cause_line(result)
    story = _describe_failure(result, details)
    return f"{short_paths(cause)}\n{story}" if cause else story


def _describe_failure(result, details):
    stopped = result.timed_out or result.interrupted
    what = f"timed out after {result.timeout:g} s" if result.timed_out else "was interrupted"
    if stopped and not [r for r in result.ranks if r.status != RunStatus.NOT_STARTED]:
        return short_paths(
            f"{result.script} {what} before any rank had started its script (torchrun was still starting; "
            f"everything was killed). torchrun said:\n{tail(result.launcher_output, 30)}"
        )
    stuck = [r for r in result.ranks if r.status in (RunStatus.HUNG, RunStatus.INTERRUPTED)]
    if stopped:
        head = f"{result.script} {what}" + (
            f"; rank(s) {joined(r.rank for r in stuck)} were still running and were killed:" if stuck else ":"
        )
    else:
        head = f"{result.script} {failed_ranks_text(result)}:"
    lines = [head, *(f"  {line}" for line in rank_lines(result))]
    early = result.left_early
    if early:
        lines.append(
            f"Rank(s) {joined(early)} exited 0 before the first failure, while the others still called "
            "collectives: a rank that leaves early reads as 'Connection closed by peer' on the others. "
            "Look there first."
        )
    if not details:
        return short_paths("\n".join(lines))
    cause = result.root_cause
    if stopped:
        if stuck:
            lines.append("Their Python stacks at that moment:")
        for r in stuck:
            lines += [
                f"--- rank {r.rank} stack ---",
                shown(stack_dump(r.stderr), r) or shown(r.stderr, r, last=30) or "(none printed)",
            ]
        if cause is not None:
            lines += [f"Before that, rank {cause.rank} failed:", shown(cause.traceback, cause) or cause.error]
        return short_paths("\n".join(lines))
    if cause is None:
        lines += ["No rank recorded an error; torchrun said:", tail(result.launcher_output, 30) or "(nothing)"]
        return short_paths("\n".join(lines))
    start = result.ranks_start
    when = f" at +{cause.end - start:.2f} s" if cause.end and start else ""
    if cause.error.startswith("killed by "):
        lines.append(f"First failure (root cause): rank {cause.rank} was {cause.error} (exit {cause.exitcode}){when}")
    else:
        with_error = cause.error and cause.error != f"exit code {cause.exitcode}"
        lines.append(
            f"First failure (root cause): rank {cause.rank} exited {cause.exitcode}{when}"
            + (f" with {cause.error}" if with_error else "")
        )
    lines += [
        f"--- rank {cause.rank} traceback ---",
        shown(cause.traceback, cause) or shown(cause.stderr, cause, last=30) or "(no traceback: see its stderr)",
    ]
    for r in result.ranks:
        stack = stack_dump(r.stderr) if r.status == RunStatus.TERMINATED else ""
        if stack and r is not cause:
            lines += [f"--- rank {r.rank} stack (where it was when it was stopped) ---", shown(stack, r)]
    return short_paths("\n".join(lines))


def shown(text, r, last=None):
    """A traceback or stack of rank output `r` (or its stderr) as a text view shows it: folded, the rest kept
    in its stderr; `last`: only that many lines of it, the last."""
    return "\n".join(folded_text(text, every_frame_of(r.rank))[-last if last else 0 :])


def every_frame_of(rank, every_frame=EVERY_FRAME, stream="stderr"):
    """What a fold line names as keeping every frame of rank `rank`'s stream (EVERY_FRAME: run.ranks[1].stderr)."""
    return every_frame.format(what=f"ranks[{rank}].{stream}")


def quiet_groups(ranks):
    """[(ranks, how they ended)] of the ranks that printed nothing, grouped by how they ended."""
    groups = {}
    for r in ranks:
        groups.setdefault(exit_text(r), []).append(r.rank)
    return [(rs, how) for how, rs in groups.items()]


def quiet_text(groups):
    parts = []
    for ranks, how in groups:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {joined(ranks)}"
        parts.append(f"{who} printed nothing ({how})")
    return "; ".join(parts)


def printed(r):
    return bool(r.stdout.strip() or r.stderr.strip())


def render_text(result):
    """`str(run)`: `Cause: ...` when the machine made it fail, the status line, one line per rank if it failed,
    then each rank's lines, prefixed."""
    parts = [line for line in (cause_line(result), status_line(result)) if line]
    if not result.ok:
        parts += [f"  {line}" for line in rank_lines(result)]
    quiet = [r for r in result.ranks if not printed(r)]
    for r in result.ranks:
        if r in quiet:
            continue
        parts.append(f"--- rank {r.rank} ({exit_text(r)}) ---")
        parts.extend(f"[rank {r.rank}] {line}" for line in r.stdout.splitlines())
        parts.extend(f"[rank {r.rank}:stderr] {line}" for line in folded_text(r.stderr, every_frame_of(r.rank)))
    if quiet:
        parts.append(quiet_text(quiet_groups(quiet)))
    return short_paths("\n".join(parts))


def render_columns(result, width, every_frame=EVERY_FRAME):
    """Each rank's output in a column of its own, as many columns per row as fit in `width` characters
    (`python -m lessonlib run --columns`); the ranks that printed nothing on one line below. Tracebacks
    and stacks folded, each fold line naming `every_frame` (formatted as EVERY_FRAME); None: not folded."""
    sep = " | "
    shown = [r for r in result.ranks if printed(r)]
    quiet = [r for r in result.ranks if not printed(r)]
    n = len(shown)
    per_row = max(1, min(n, (width + len(sep)) // (MIN_COLUMN + len(sep))))
    col = max(8, (width - len(sep) * (per_row - 1)) // per_row)
    blocks = []
    for start in range(0, n, per_row):
        cells = []
        for r in shown[start : start + per_row]:
            lines = [f"rank {r.rank} ({exit_text(r)})", "-" * col]
            for text in short_paths(r.stdout).splitlines():
                lines += _wrap(text, col)
            if r.stderr.strip():
                lines.append("-- stderr --")
                shown = (
                    r.stderr.splitlines()
                    if every_frame is None
                    else folded_text(r.stderr, every_frame_of(r.rank, every_frame))
                )
                for text in shown:
                    lines += _wrap(short_paths(text), col)
            cells.append(lines)
        height = max(len(c) for c in cells)
        rows = []
        for i in range(height):
            parts = [(c[i] if i < len(c) else "").ljust(col) for c in cells]
            rows.append(sep.join(parts).rstrip())
        blocks.append("\n".join(rows))
    if quiet:
        blocks.append("\n".join(_wrap(quiet_text(quiet_groups(quiet)), width)))
    return "\n\n".join(blocks)


def _wrap(line, width):
    line = line.expandtabs(4).rstrip()
    return [line[i : i + width] for i in range(0, len(line), width)] or [""]


def exit_text(r):
    if r.status == RunStatus.OK:
        return "exit 0"
    code = f"exit {r.exitcode}" if r.exitcode is not None else "no exit code"
    return f"{r.status}, {code}" if r.status != RunStatus.FAILED else code


def joined(items):
    return ", ".join(str(i) for i in items)


def tail(text, n):
    return "\n".join(text.rstrip("\n").splitlines()[-n:])
