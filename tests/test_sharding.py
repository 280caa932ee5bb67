"""lessonlib.sharding (chapter 13): the calculator's formulas, its errors, and the byte counter.

The chapter's lessons check the calculator and Traffic against real gloo runs at 1 to 4 ranks; here,
the formulas against the numbers the ZeRO paper and the ring model give by hand, and bad input.
"""

import os
import sys

import pytest

from lessonlib.sharding import (
    STRATEGIES,
    bytes_written,
    check_counted,
    per_rank_bytes,
    plan,
    sent_per_step,
    shard,
)

pytestmark = pytest.mark.unit


def test_per_rank_bytes_follows_the_zero_stages():
    # Mixed precision, 7.5B parameters, 64 ranks: the ZeRO paper's figure 1 (120 GB, 31.4, 16.6, 1.9).
    p, n, mixed = 7_500_000_000, 64, {"param_bytes": 2, "grad_bytes": 2, "state_bytes": 12}
    totals = [per_rank_bytes(p, n, s, **mixed)["total"] / 1e9 for s in STRATEGIES]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_splits_are_padded_up():
    assert shard(10, 3) == 4 and shard(9, 3) == 3 and shard(0, 4) == 0
    fsdp = per_rank_bytes(10, 3, "fsdp")
    assert fsdp == {"parameters": 16, "gradients": 16, "optimizer state": 32, "total": 64}
    assert per_rank_bytes(10, 1, "fsdp") == per_rank_bytes(10, 1, "ddp")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_traffic_follows_the_ring_model(n):
    p, b = 1000, 4000  # parameters, and their bytes in float32
    one = (n - 1) / n * b
    assert sent_per_step(p, n, "ddp") == pytest.approx(2 * one)
    assert sent_per_step(p, n, "zero1") == sent_per_step(p, n, "zero2") == pytest.approx(2 * one)
    assert sent_per_step(p, n, "fsdp") == pytest.approx(3 * one)
    # gloo's reduce-scatter is an all-reduce of the whole tensor: one more (N-1)/N.
    assert sent_per_step(p, n, "zero1", reduce_scatter="allreduce") == pytest.approx(3 * one)
    assert sent_per_step(p, n, "fsdp", reduce_scatter="allreduce") == pytest.approx(4 * one)


def test_plan_says_what_fits():
    rows = {r["strategy"]: r for r in plan(7_000_000_000, 8, memory=80e9)}
    assert [r["fits"] for r in rows.values()] == [False, True, True, True]
    assert rows["fsdp"]["sent vs ddp"] == pytest.approx(1.5) and rows["ddp"]["sent vs ddp"] == 1.0
    assert rows["ddp"]["total"] == 16 * 7_000_000_000


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: per_rank_bytes(10, 2, "zero3"), "strategy must be one of ddp, zero1, zero2, fsdp; got 'zero3'"),
        (lambda: per_rank_bytes(10, 0, "ddp"), "world_size >= 1"),
        (lambda: sent_per_step(10, 2, "ddp", reduce_scatter="tree"), "'ring' or 'allreduce'"),
        (lambda: plan(10, 2, precision="fp8"), "precision must be one of float32, mixed"),
    ],
)
def test_bad_input_says_what_is_allowed(call, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        call()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/io exists on Linux only")
def test_bytes_written_counts_this_process_writes(tmp_path):
    before = bytes_written()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"x" * 100_000)
    os.close(fd)
    assert bytes_written() - before >= 100_000


def test_a_transport_that_wchar_cannot_see_is_an_error_not_zero_bytes():
    # wchar counts writev (gloo), not send/sendmsg: 0 bytes for a real payload across ranks is refused.
    with pytest.raises(RuntimeError, match=r"wchar did not move: this transport sends with send\(\)"):
        check_counted(0, 4096, 2)
    check_counted(0, 4096, 1)  # one rank sends nothing: 0 is the truth
    check_counted(0, 0, 4)  # no payload given
    check_counted(8192, 4096, 2)
    check_counted(None, 4096, 2)  # no /proc: Traffic reports None
