"""DrainMeter (sliding-window drain rate) and RecentCancels (cancel memory)."""

from __future__ import annotations

import pytest

from services.scheduler.runtime.meters import DrainMeter, RecentCancels


@pytest.mark.parametrize(
    ("samples", "now", "rate"),
    [
        ([], 100.0, 0.0),
        ([(90.0, 300)], 100.0, 10.0),  # 300 tokens in a 30 s window
        ([(90.0, 300), (95.0, 600)], 100.0, 30.0),
        ([(69.0, 300), (95.0, 600)], 100.0, 20.0),  # the first left the window
        ([(70.0, 300)], 100.0, 0.0),  # exactly window_s old: out
        ([(10.0, 999), (20.0, 999)], 100.0, 0.0),  # replayed history counts for nothing
        ([(99.0, 0)], 100.0, 0.0),  # nothing generated, nothing drained
    ],
)
def test_drain_rate_over_the_window(
    samples: list[tuple[float, int]], now: float, rate: float
) -> None:
    meter = DrainMeter(30.0)
    for ts, tokens in samples:
        meter.add("m", ts, tokens)
    assert meter.rate("m", now) == pytest.approx(rate)


def test_drain_rate_is_per_model_and_forgets_idle_models() -> None:
    meter = DrainMeter(10.0)
    meter.add("a", 0.0, 100)
    meter.add("b", 5.0, 50)
    assert meter.rate("a", 6.0) == pytest.approx(10.0)
    assert meter.rate("b", 6.0) == pytest.approx(5.0)
    assert meter.rate("a", 20.0) == 0.0
    assert meter.models() == ["b"]


def test_drain_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        DrainMeter(0.0)


@pytest.mark.parametrize(
    ("issued_at", "tenant", "now", "matches"),
    [
        (100.0, "acme", 100.0, True),
        (100.0, "other", 100.0, False),  # a tenant mismatch is ignored
        (100.0, "acme", 699.0, True),
        (100.0, "acme", 700.0, False),  # memory_s after issued_at: forgotten
    ],
)
def test_recent_cancels(issued_at: float, tenant: str, now: float, matches: bool) -> None:
    cancels = RecentCancels(memory_s=600.0)
    assert cancels.add("r1", "acme", issued_at, now=issued_at)
    assert cancels.matches("r1", tenant, now) is matches


def test_recent_cancels_refuse_stale_commands_and_stay_bounded() -> None:
    cancels = RecentCancels(memory_s=10.0, capacity=2)
    assert not cancels.add("old", "t", issued_at=0.0, now=50.0)
    for rid in ("a", "b", "c"):
        cancels.add(rid, "t", 50.0, 50.0)
    assert len(cancels) == 2 and not cancels.matches("a", "t", 50.0)
    cancels.prune(100.0)
    assert len(cancels) == 0
