"""torchrun --nproc_per_node=3 lessons/09_reduce_on_main.py

reduce versus all_reduce (who holds the result), and a collective called on the main rank only.

Options: --bug-timeout 3 (seconds, the default).

Every rank counts its correct answers on its unpadded shard of a fixed classifier's n = 101 answers.
  1. reduce(dst=0): rank 0 holds the totals; on the other ranks the buffer is not the result (gloo
     left a partial sum or the input there, chapter 2). Only rank 0 may use it.
  2. all_reduce: every rank holds the totals.
  3. The pitfall, as tutorials sometimes advise it: run the evaluation, which contains `reduce`, inside
     `if rank == 0:`. Rank 0 enters the collective and waits for ranks that never come. The lesson
     runs that call in a group of its own with a short timeout (--bug-timeout), so the wait becomes an
     error within seconds; rank 0 catches it and reports it. With one rank there is nobody to wait for.
  4. The fix: every rank calls the evaluation (and so the collective); only rank 0 prints.
"""

import argparse
import datetime
import time

import torch
import torch.distributed as dist

import lessonlib


def correct_answers(n, classes=4, seed=0):
    """1 where a fixed random classifier is right on item i, else 0: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (n,), generator=g)
    logits = torch.randn(n, classes, generator=g, dtype=torch.float64)
    logits[torch.arange(n), labels] += 1.0
    return (logits.argmax(1) == labels).long()


# [start: test]
def test(correct, group=None):
    """Accuracy over every rank's items, on rank 0 (None elsewhere). A collective: call it on every rank."""
    totals = torch.stack([correct.sum(), torch.tensor(len(correct))])  # int64: counts stay exact
    dist.reduce(totals, dst=0, group=group)
    if dist.get_rank() == 0:
        return totals[0].item() / totals[1].item()
    return None


# [end: test]


def who_holds(ctx, mine, expected):
    """reduce and all_reduce on copies of the same counts; asserts who holds the totals afterwards."""
    r = ctx.rank
    reduced = mine.clone()
    dist.reduce(reduced, dst=0)
    if ctx.is_main:
        assert reduced.tolist() == expected, f"rank 0: reduce left {reduced.tolist()}, expected {expected}"
    else:
        assert reduced.tolist() != expected, f"rank {r}: reduce's non-destination buffer holds the totals"
    everyone = mine.clone()
    dist.all_reduce(everyone)
    assert everyone.tolist() == expected, f"rank {r}: all_reduce left {everyone.tolist()}, expected {expected}"
    return {
        "rank": r,
        "own counts": mine.tolist(),
        "after reduce(dst=0)": reduced.tolist(),
        "after all_reduce": everyone.tolist(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--size", type=int, default=101, choices=range(1, 100001), metavar="1..100000")
    parser.add_argument(
        "--bug-timeout", type=float, default=3.0, help="seconds the bounded group waits in the pitfall before it raises"
    )
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")
    r, w, n = ctx.rank, ctx.world_size, args.size
    answers = correct_answers(n)
    truth = answers.sum().item() / n  # one process, every item once
    mine = answers[r::w]  # this rank's unpadded shard (chapter 3)
    expected = [answers.sum().item(), n]

    lessonlib.report("holds", who_holds(ctx, torch.stack([mine.sum(), torch.tensor(len(mine))]), expected))

    # The pitfall. A group of its own, so its timeout can be short; creating it is collective too.
    bounded = dist.new_group(timeout=datetime.timedelta(seconds=args.bug_timeout))
    # [start: main_only]
    if ctx.is_main:  # wrong: test() holds a collective that the other ranks never join
        start = time.monotonic()
        try:
            acc = test(mine, group=bounded)
            outcome = {"returned": acc, "error": None}
        except RuntimeError as e:
            outcome = {"returned": None, "error": str(e).splitlines()[0]}
        outcome["seconds"] = round(time.monotonic() - start, 2)
        # [end: main_only]
        if w > 1:
            assert outcome["error"] is not None, f"rank 0: test() on rank 0 alone returned {outcome}"
        else:  # alone in the world, rank 0 has nobody to wait for
            assert outcome["returned"] == truth, f"rank 0: test() alone returned {outcome}"
        lessonlib.report("main_only", outcome)
        print(f"rank 0: test() inside `if rank == 0`: {outcome}")
    else:
        print(f"rank {r}: skipped test(), as the `if rank == 0` says, and went on")

    # [start: fixed]
    acc = test(mine)  # every rank joins the reduce
    if ctx.is_main:
        print(f"accuracy {acc:.4f}")
    # [end: fixed]
    if ctx.is_main:
        assert acc == truth, f"rank 0: test() on every rank gave {acc}, one process {truth}"
        lessonlib.report("fixed", {"accuracy": acc, "one process": truth})
    else:
        assert acc is None, f"rank {r}: test() returned {acc} on a rank that is not dst"
    lessonlib.teardown()


if __name__ == "__main__":
    main()
