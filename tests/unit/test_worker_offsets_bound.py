"""The offset tracker's memory stays bounded while one offset holds the commit point."""

from __future__ import annotations

import pytest

from services.worker.core.offsets import OffsetTracker


def test_finished_offsets_above_a_stuck_commit_point_are_bounded() -> None:
    tracker = OffsetTracker(max_finished=100)
    tracker.begin(0)  # never finished: the commit point stays at 0
    for offset in range(1, 10_001):
        tracker.begin(offset)
        tracker.finish(offset)
        if offset % 50 == 0:
            point = tracker.commit_point()
            assert point is not None
            tracker.committed(point)
    assert tracker.commit_point() == 0
    done = tracker.done_above()
    assert len(done) <= 100
    assert done[-1] == 10_000  # the newest are kept
    assert tracker.begin(10_000) is False  # still skipped when delivered again
    tracker.finish(0)
    assert tracker.commit_point() == 10_001


def test_max_finished_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_finished"):
        OffsetTracker(max_finished=0)
