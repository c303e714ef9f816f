"""HeldHandoffs: which hand-offs a draining prefill worker still waits for."""

from __future__ import annotations

import pytest

from services.worker.core import HeldHandoffs


def _held(hold_s: float = 120.0) -> HeldHandoffs:
    held = HeldHandoffs(hold_s)
    held.hold("t:a", 1, deadline=1_000.0, now=100.0)
    return held


def test_a_hand_off_is_held_until_its_decode_stage_has_a_first_token() -> None:
    held = _held()
    assert held.held(100.0) == 1 and held.since() == 100.0
    # The decode stage starting is not enough: the decode engine pulls the KV once it
    # admits the request.
    assert not held.observe("event.started", "t:a", 2)
    # Events of the prefill attempt itself, or of another request, change nothing.
    assert not held.observe("event.prefilled", "t:a", 1)
    assert not held.observe("event.first_token", "t:b", 2)
    assert held.held(101.0) == 1
    assert held.observe("event.first_token", "t:a", 2)
    assert held.held(101.0) == 0 and held.since() is None
    assert not held.observe("event.first_token", "t:a", 2)  # nothing left to end


@pytest.mark.parametrize(("kind", "attempt"), [
    ("event.done", 2), ("event.failed", 2), ("event.aborted", 2),  # the request ended
    ("event.aborted", 1), ("event.failed", 1),  # ... at the prefill's own attempt too
    ("event.prefilled", 2), ("event.first_token", 3),  # a start-over took its own path
])
def test_a_later_attempt_or_an_ending_lets_the_hand_off_go(kind: str, attempt: int) -> None:
    held = _held()
    assert held.observe(kind, "t:a", attempt)
    assert held.held(100.0) == 0


def test_a_hold_expires_at_the_deadline_or_after_hold_s_whichever_is_first() -> None:
    held = HeldHandoffs(30.0)
    held.hold("t:a", 1, deadline=110.0, now=100.0)  # the deadline first
    held.hold("t:b", 1, deadline=1_000.0, now=100.0)  # hold_s first
    assert held.held(109.9) == 2
    assert held.held(110.0) == 1 and held.since() == 100.0
    assert held.held(129.9) == 1
    assert held.held(130.0) == 0


def test_hold_s_zero_holds_nothing_and_an_older_attempt_never_replaces_a_newer() -> None:
    off = HeldHandoffs(0.0)
    off.hold("t:a", 1, deadline=1_000.0, now=100.0)
    assert off.held(100.0) == 0
    held = HeldHandoffs(120.0)
    held.hold("t:a", 3, deadline=1_000.0, now=100.0)
    held.hold("t:a", 1, deadline=1_000.0, now=105.0)  # a late, older hand-off
    assert not held.observe("event.first_token", "t:a", 2)  # later than 1, not than 3
    assert held.observe("event.first_token", "t:a", 4)
    held.hold("t:b", 1, deadline=1_000.0, now=100.0)
    held.hold("t:c", 1, deadline=1_000.0, now=90.0)
    assert held.since() == 90.0  # the oldest hand-off still held



def test_a_hold_starts_where_its_event_was_first_written_and_old_ones_are_let_go() -> None:
    held = HeldHandoffs(10.0)
    # Acknowledged at 100 after resends; the prefill run began at 95, before any copy.
    held.hold("t:a", 1, deadline=1_000.0, now=100.0, since=95.0)
    assert held.since() == 95.0
    # A prefill worker that never drains never asks held(): the holds of hand-offs long
    # past their expiry are let go as new ones come, so they do not pile up.
    for i in range(1_000):
        held.hold(f"t:{i}", 1, deadline=10_000.0, now=200.0 + i)
    assert len(held._held) <= 11  # about hold_s worth of hand-offs, one a second
    assert held.held(1_199.0) == 10  # acknowledged at 1_190-1_199: within their 10 s
    assert held.held(1_209.0) == 0
