"""The ledger keeps each worker's free KV and in-flight count until its book changes.

Every figure must be what a fresh computation gives, whatever was read before: compared
here with a second ledger driven the same way whose figures are read only at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.scheduler import Ledger
from tests.builders import NOW, make_request, make_worker

WORKER = make_worker("w0", kv_total_tokens=10_000, running=1, heartbeat_ts=NOW)
OTHER = make_worker("w1", kv_total_tokens=20_000)


def figures(ledger: Ledger) -> tuple[int, int, float, int]:
    return (ledger.free_kv(WORKER), ledger.in_flight(WORKER), ledger.headroom(WORKER),
            ledger.room(WORKER))


def reserve_two(ledger: Ledger) -> None:
    ledger.reserve(WORKER, make_request("a", kv_tokens=1_000))
    ledger.reserve(WORKER, make_request("b", kv_tokens=2_000))


STEPS: list[tuple[str, Callable[[Ledger], object]]] = [
    ("reserve", reserve_two),
    ("reserve elsewhere", lambda ledger: ledger.reserve(OTHER, make_request("c"))),
    ("start", lambda ledger: ledger.mark_started("a", 0, at=NOW - 2)),
    ("first token", lambda ledger: ledger.mark_first_token("a", 0)),
    ("reconcile", lambda ledger: ledger.reconcile("w0", {("a", 0), ("b", 0)})),
    ("release with credit", lambda ledger: ledger.release("a", 0, at=NOW + 1)),
    ("release", lambda ledger: ledger.release("b", 0)),
    ("drop worker", lambda ledger: ledger.drop_worker("w0")),
]


@pytest.mark.parametrize("upto", range(1, len(STEPS) + 1))
def test_figures_read_between_changes_are_always_current(upto: int) -> None:
    watched, fresh = Ledger(), Ledger()
    for _, step in STEPS[:upto]:
        figures(watched)  # read (and keep) before every change
        step(watched)
        step(fresh)
    assert figures(watched) == figures(fresh)


def test_a_newer_heartbeat_of_the_same_worker_is_computed_afresh() -> None:
    ledger = Ledger(kv_safety_margin=0.0)
    assert ledger.free_kv(WORKER) == 10_000
    busier = make_worker("w0", kv_total_tokens=10_000, kv_free_tokens=4_000, running=3)
    assert ledger.free_kv(busier) == 4_000
    assert ledger.in_flight(busier) == 3
    assert ledger.free_kv(WORKER) == 10_000  # the older heartbeat again: its own figures
