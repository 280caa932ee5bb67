"""lessonlib.processes.bounded.poll_until, the one bounded wait of lessonlib and the tests (unit tier: no process).

The clock is a fake one that moves only when poll_until sleeps, so each test says exactly when the check
ran, how long each sleep was and that none ran past the bound, on a busy machine as on a quiet one. One
test waits on the real clock, for the lower bound alone.
"""

import math
import time

import pytest

from lessonlib.processes import bounded
from lessonlib.processes.bounded import poll_until

pytestmark = pytest.mark.unit


class FakeClock:
    """time.monotonic and time.sleep for bounded: the time moves by exactly what poll_until sleeps."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        assert seconds > 0, f"slept {seconds} s"
        self.sleeps.append(round(seconds, 9))
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(bounded, "time", fake)
    return fake


def checks(clock, values):
    """A check that returns `values` one after another and notes the (fake) time of each call."""
    calls, values = [], iter(values)

    def check():
        calls.append(round(clock.now - 1000.0, 9))
        return next(values)

    return check, calls


def test_returns_the_checks_first_true_value_itself(clock):
    check, calls = checks(clock, [0, None, "", [], "found", "later"])
    assert poll_until(check, 10, interval=0.5) == "found"
    assert calls == [0.0, 0.5, 1.0, 1.5, 2.0] and clock.sleeps == [0.5] * 4


def test_a_check_true_at_once_returns_without_sleeping(clock):
    check, calls = checks(clock, [{"rank": 1}])
    assert poll_until(check, 10) == {"rank": 1} and calls == [0.0] and clock.sleeps == []


def test_the_timeout_names_what_was_awaited_and_the_bound(clock):
    check, calls = checks(clock, [False] * 10)
    with pytest.raises(TimeoutError, match=r"^waited 1 s in vain for rank 1 to be ready$"):
        poll_until(check, 1, interval=0.3, what="rank 1 to be ready")
    # A last look at the bound itself, and no sleep past it.
    assert calls == [0.0, 0.3, 0.6, 0.9, 1.0] and clock.sleeps == [0.3, 0.3, 0.3, 0.1]


def test_what_may_be_a_callable_that_says_what_was_seen_last(clock):
    seen, said = [], []
    check, _ = checks(clock, [None] * 5)

    def what():
        said.append(clock.now - 1000.0)
        return f"no process left (still {len(seen)} of them)"

    def counting():
        seen.append(1)
        return check()

    with pytest.raises(TimeoutError, match=r"waited 0.25 s in vain for no process left \(still 4 of them\)"):
        poll_until(counting, 0.25, interval=0.1, what=what)
    assert said == [pytest.approx(0.25)]  # called once, at the end, not at every look


def test_without_what_the_message_names_the_check(clock):
    def ranks_ready():
        return False

    with pytest.raises(TimeoutError, match=r"waited 2 s in vain for .*ranks_ready\(\) to return something true"):
        poll_until(ranks_ready, 2)


def test_an_exception_from_the_check_ends_the_wait_at_once(clock):
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the process it waits on has exited")
        return None

    with pytest.raises(RuntimeError, match="has exited"):
        poll_until(check, 60, interval=1)
    assert len(calls) == 2 and clock.sleeps == [1]


def test_a_zero_timeout_looks_once(clock):
    check, calls = checks(clock, [None, "too late"])
    with pytest.raises(TimeoutError, match="waited 0 s in vain for"):
        poll_until(check, 0)
    assert calls == [0.0] and clock.sleeps == []


def test_an_interval_longer_than_the_timeout_sleeps_to_the_bound_only(clock):
    check, calls = checks(clock, [None, None, "x"])
    with pytest.raises(TimeoutError):
        poll_until(check, 0.5, interval=30)
    assert calls == [0.0, 0.5] and clock.sleeps == [0.5]


@pytest.mark.parametrize(
    "timeout, interval",
    [
        (-1, 0.1),
        (math.nan, 0.1),
        (math.inf, 0.1),
        ("5", 0.1),
        (None, 0.1),
        (True, 0.1),
        (5, 0),
        (5, -0.1),
        (5, math.inf),
    ],
)
def test_a_bad_bound_or_interval_is_refused_before_the_first_look(clock, timeout, interval):
    check, calls = checks(clock, ["x"])
    with pytest.raises(ValueError, match="poll_until: (timeout|interval) must be a finite number of seconds"):
        poll_until(check, timeout, interval=interval)
    assert calls == []


def test_on_the_real_clock_it_waits_the_whole_bound():
    """The lower bound only: a busy machine may make the wait longer, never shorter."""
    looks = []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="waited 0.2 s in vain for nothing"):
        poll_until(lambda: looks.append(1), 0.2, interval=0.05, what="nothing")
    assert time.monotonic() - started >= 0.2 and len(looks) >= 2, looks
