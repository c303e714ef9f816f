"""DrainMeter: tokens finished per second, per backlogged second when work waited."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.scheduler import DrainMeter


def backlogged(start: float, end: float, *finishes: tuple[float, int]) -> DrainMeter:
    """A meter for model "m" that saw a backlog over [start, end) and these finishes."""
    meter = DrainMeter(window_s=30.0, min_backlog_s=2.0)
    meter.waiting(start, ["m"])
    for ts, tokens in finishes:
        meter.add("m", ts, tokens)
    meter.waiting(end, [])
    return meter


@pytest.mark.parametrize(
    ("meter", "now", "rate"),
    [
        (DrainMeter(), 100.0, 0.0),  # nothing seen: unknown
        (backlogged(90.0, 100.0, (95.0, 500)), 100.0, 50.0),  # 500 tokens in 10 s of backlog
        # The idle seconds after the backlog do not dilute the rate.
        (backlogged(80.0, 90.0, (85.0, 500)), 100.0, 50.0),
        # Only the part of a backlog inside the window counts, and only its finishes.
        (backlogged(60.0, 80.0, (65.0, 900), (75.0, 100)), 100.0, 10.0),
        # 1 s of backlog is too little evidence: the plain average, 500 / 30 s.
        (backlogged(90.0, 91.0, (90.5, 500)), 100.0, 500 / 30),
        (backlogged(10.0, 20.0, (15.0, 999)), 100.0, 0.0),  # replayed history: forgotten
        (backlogged(90.0, 100.0, (95.0, 0)), 100.0, 0.0),  # no tokens: nothing drained
    ],
)
def test_rate_is_tokens_per_backlogged_second(meter: DrainMeter, now: float, rate: float) -> None:
    assert meter.rate("m", now) == pytest.approx(rate)


def test_a_backlog_lifts_the_rate_above_the_idle_fleets_average() -> None:
    # One warm-up request is all an idle fleet shows: 16 tokens / 30 s. Once work waits,
    # what finishes per backlogged second is the measure (the startup refusal seen in the
    # end-to-end test came from judging a burst by the warm-up's 0.5 tokens/s).
    meter = DrainMeter(window_s=30.0, min_backlog_s=2.0)
    meter.add("m", 5.0, 16)
    assert meter.rate("m", 10.0) == pytest.approx(16 / 30)
    meter.waiting(10.0, ["m"])
    meter.add("m", 11.0, 400)
    assert meter.rate("m", 11.0) == pytest.approx(416 / 30)  # 1 s of backlog: not yet
    meter.add("m", 12.0, 400)
    assert meter.rate("m", 12.0) == pytest.approx(400.0)  # 800 tokens / 2 s


def test_a_backlog_going_on_counts_up_to_now_and_late_events_land_in_their_span() -> None:
    meter = DrainMeter(window_s=30.0, min_backlog_s=2.0)
    meter.waiting(0.0, ["a", "b"])
    meter.waiting(4.0, ["a"])  # b's backlog ended at 4
    meter.add("b", 3.0, 400)  # read late, finished during b's backlog: counts
    meter.add("b", 5.0, 999)  # finished after it: does not
    meter.add("a", 2.0, 600)
    assert meter.rate("b", 6.0) == pytest.approx(100.0)  # 400 / 4 s (the 999 outside)
    assert meter.rate("a", 6.0) == pytest.approx(100.0)  # 600 / 6 s
    assert meter.models() == ["a", "b"]
    assert meter.rate("b", 40.0) == 0.0
    assert meter.models() == ["a"]  # b forgotten, a still backlogged


def test_the_rate_is_never_below_what_the_window_demonstrably_drained() -> None:
    # A 10 s backlog in which one small request ended, while 3,000 tokens ended outside it:
    # the fleet did at least 3,100 tokens / 30 s.
    meter = DrainMeter(window_s=30.0, min_backlog_s=2.0)
    meter.add("m", 72.0, 3_000)
    meter.waiting(80.0, ["m"])
    meter.add("m", 85.0, 100)
    meter.waiting(90.0, [])
    assert meter.rate("m", 100.0) == pytest.approx(3_100 / 30.0)


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        DrainMeter(0.0)
    with pytest.raises(ValueError, match="min_backlog_s"):
        DrainMeter(10.0, min_backlog_s=11.0)


@given(st.lists(st.tuples(st.floats(0, 100), st.booleans(), st.integers(0, 10_000)),
                max_size=40))
def test_rate_never_exceeds_what_finished_over_the_minimum_evidence(
    steps: list[tuple[float, bool, int]],
) -> None:
    meter = DrainMeter(window_s=30.0, min_backlog_s=2.0)
    total = 0
    for ts, waiting, tokens in sorted(steps):
        meter.waiting(ts, ["m"] if waiting else [])
        meter.add("m", ts, tokens)
        total += tokens
        rate = meter.rate("m", ts)
        assert 0.0 <= rate <= max(total / 2.0, total / 30.0)
        assert meter.backlogged_s("m", ts) <= 30.0
