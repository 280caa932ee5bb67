"""torchrun --nproc_per_node=3 lessons/07_exercise_syncbn.py

Checker for the chapter 7 exercise: the statistics SyncBatchNorm normalises with, from every rank's rows.

Options: --solution FILE checks your answer, the function named by --function NAME (default:
global_batch_stats) in FILE.

A solution is a function `global_batch_stats(x)` that takes this rank's rows, a (rows, features) float64
tensor, and returns `(mean, var)`, each of shape (features,): the mean and the biased variance (what
BatchNorm normalises with) of each column over ALL ranks' rows together, the same on every rank. Ranks
hold different numbers of rows, one of them sometimes a single row, and their data are shifted and
scaled by rank. Every rank checks its answer on every case against the statistics of the gathered rows
(tolerance 1e-10), and the ranks agree on the verdict before anyone reports it. A solution that raises
fails at once, on the rank where it raised, with its message.

Without --solution the checker tests itself: the reference solution (the `solution` region, which the
chapter shows) must pass, and three plausible wrong answers must fail (at world size 1 all are right):
this rank's statistics alone, the average of the ranks' means and variances, and deviations from the
average of the ranks' means (right whenever every rank holds as many rows).
"""

import torch
import torch.distributed as dist

from lessonlib.exercises import run_checker

TOL = 1e-10


def cases(world_size):
    """(name, rows on each rank, features, shift between ranks): the same list on every rank."""
    n = world_size
    return [
        ("equal rows", [4] * n, 3, 2.0),
        ("rank 0 has a single row", [1] + [5] * (n - 1), 2, 1.0),
        ("rows grow with rank", [2 + 3 * k for k in range(n)], 4, 3.0),
        ("the last rank has a single row", [6] * (n - 1) + [1], 1, -1.5),
    ]


def rows(seed, counts, features, shift, rank, device):
    """This rank's rows for one case: shifted and scaled by rank, so the ranks' statistics differ."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(counts[rank], features, generator=g, dtype=torch.float64) * (1 + rank / 2) + shift * rank
    return x.to(device)  # nccl (a GPU per rank) reduces only GPU tensors


def gather_rows(x, counts):
    """All ranks' rows, in rank order. all_gather needs one shape on every rank, so pad to the longest."""
    padded = torch.zeros(max(counts), x.shape[1], dtype=x.dtype, device=x.device)
    padded[: len(x)] = x
    out = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(out, padded)
    return torch.cat([o[:c] for o, c in zip(out, counts)])


def short(t):
    return "[" + ", ".join(f"{v:.6g}" for v in t.flatten().tolist()) + "]"


def mismatch(got, everyone):
    """Why `got` is not the (mean, var) of the rows `everyone`, or None."""
    want = everyone.mean(0).cpu(), everyone.var(0, unbiased=False).cpu()
    try:
        got = [torch.as_tensor(t, dtype=torch.float64).cpu() for t in got]
    except (TypeError, ValueError, RuntimeError) as e:
        return f"returned {got!r}, not a pair of tensors ({e})"
    if len(got) != 2 or any(g.shape != want[0].shape for g in got):
        return (
            f"returned shapes {[tuple(g.shape) for g in got]}; expected (mean, var), "
            f"each of shape {tuple(want[0].shape)} like x.mean(0)"
        )
    if not all(torch.allclose(g, w, rtol=TOL, atol=TOL) for g, w in zip(got, want)):
        return (
            f"returned mean {short(got[0])}, var {short(got[1])}; over all {len(everyone)} rows "
            f"they are mean {short(want[0])}, var {short(want[1])}"
        )
    return None


def verdict(fn, ctx):
    """None if fn gives the global statistics on every case on this rank, else the first problem seen."""
    todo = [
        (name, counts, rows(seed, counts, features, shift, ctx.rank, ctx.device))
        for seed, (name, counts, features, shift) in enumerate(cases(ctx.world_size))
    ]
    # The truth first, so that none of the checker's own collectives sits between a solution's.
    truths = [gather_rows(x, counts) for _, counts, x in todo]
    problem = None
    for (name, counts, x), everyone in zip(todo, truths):  # every case on every rank: calls stay matched
        where = f"case {name!r} (rows per rank {counts}): {fn.__name__}(x)"
        try:
            got = fn(x.clone())
        except Exception as e:
            # A crash is a wrong answer too, but fail now, not at the agreement: the other ranks may wait
            # in a collective this rank skipped, and a mismatched collective can abort the process in
            # gloo. Leaving now turns their wait into "connection closed", and this message is the cause.
            raise AssertionError(f"rank {ctx.rank}: {where} raised {type(e).__name__}: {e}") from e
        wrong = mismatch(got, everyone)
        problem = problem or (wrong and f"{where} {wrong}")
    return problem


# [start: solution]
def global_batch_stats(x):
    totals = torch.stack([x.sum(0), (x * x).sum(0), torch.full_like(x[0], x.shape[0])])
    dist.all_reduce(totals)  # sums of all ranks, in one collective: never average means over unequal counts
    count = totals[2]
    mean = totals[0] / count
    return mean, totals[1] / count - mean * mean


# [end: solution]


def local_only(x):
    """Wrong: this rank's rows alone, what plain BatchNorm uses."""
    return x.mean(0), x.var(0, unbiased=False)


def average_of_ranks(x):
    """Wrong: averages the ranks' means and variances, ignoring row counts and the spread between ranks."""
    stats = torch.stack([x.mean(0), x.var(0, unbiased=False)])
    dist.all_reduce(stats)
    stats /= dist.get_world_size()
    return stats[0], stats[1]


def mean_of_means(x):
    """Wrong: deviations from a shared mean, but every rank weighs the same, whatever its row count."""
    mean = x.mean(0)
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    var = ((x - mean) ** 2).mean(0)
    dist.all_reduce(var)
    return mean, var / dist.get_world_size()


def main():
    wrong = [local_only, average_of_ranks, mean_of_means]  # one rank: its rows are the global batch
    run_checker(
        __doc__,
        verdict,
        global_batch_stats,
        wrong,
        right_alone=wrong,
        passed="gives the global batch's mean and variance on every case",
        device=None,
    )  # device=None: the rows go to ctx.device, GPUs (nccl) where there are


if __name__ == "__main__":
    main()
