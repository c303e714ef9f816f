"""Worker loss: requeue what streamed nothing, end the rest (core.recovery)."""

from __future__ import annotations

import pytest

from schemas.common import MAX_ATTEMPT
from services.scheduler import Ledger, Reject, Requeue, lease_refusal, requeue_lost
from tests.builders import make_request, make_worker


def test_requeue_lost_releases_and_splits_by_streamed() -> None:
    ledger = Ledger()
    dead, alive = make_worker("dead"), make_worker("alive")
    quiet = make_request("quiet", priority="high", attempt=1)
    ledger.reserve(dead, quiet)
    ledger.reserve(dead, make_request("talking"))
    ledger.reserve(alive, make_request("elsewhere"))
    ledger.hold("dead", "someone")
    decisions = requeue_lost(ledger, "dead", streamed={"talking"})
    assert decisions[0] == Requeue(
        make_request("quiet", priority="high", attempt=2, enqueued_at=quiet.enqueued_at),
        "dead lost",
    )
    assert isinstance(decisions[1], Reject) and decisions[1].code == "worker_lost"
    assert decisions[1].request_id == "talking"
    assert ledger.reservations("dead") == () and ledger.reserved_kv("alive") == 1_024
    assert ledger.holder("dead") is None
    assert requeue_lost(ledger, "dead", streamed=set()) == []  # idempotent


def test_a_request_lost_at_its_last_attempt_ends_worker_lost() -> None:
    # No attempt is left to place it at (the wire's bound): ended, not requeued for ever.
    ledger = Ledger()
    dead = make_worker("dead")
    ledger.reserve(dead, make_request("last", attempt=MAX_ATTEMPT))
    ledger.reserve(dead, make_request("before", attempt=MAX_ATTEMPT - 1))
    decisions = {d.request_id if isinstance(d, Reject) else d.request.request_id: d
                 for d in requeue_lost(ledger, "dead", streamed=set())}
    last, before = decisions["last"], decisions["before"]
    assert isinstance(last, Reject) and last.code == "worker_lost"
    assert isinstance(before, Requeue) and before.request.attempt == MAX_ATTEMPT


def test_requeue_lost_of_a_restarted_worker_releases_only_the_named_work() -> None:
    ledger = Ledger()
    worker = make_worker("w")
    for rid in ("old-quiet", "old-talking", "new"):
        ledger.reserve(worker, make_request(rid, attempt=1))
    ledger.hold("w", "someone")
    decisions = requeue_lost(ledger, "w", streamed={"old-talking"},
                             only=[("old-quiet", 1), ("old-talking", 1), ("unknown", 1)])
    assert [type(d) for d in decisions] == [Requeue, Reject]
    assert isinstance(decisions[0], Requeue) and decisions[0].reason == "w restarted"
    assert decisions[0].request.attempt == 2
    assert isinstance(decisions[1], Reject) and "restarted" in decisions[1].reason
    assert [r.request.request_id for r in ledger.reservations("w")] == ["new"]
    assert ledger.holder("w") == "someone"  # the worker lives on: its hold stays


@pytest.mark.parametrize(("asking", "lost", "newest", "refused_because"), [
    (100.0, set(), 100.0, ""),                       # nothing lost: go on
    (100.0, set(), None, ""),                        # heard of through this beat only
    (100.0, {99.0}, 100.0, ""),                      # an earlier incarnation's loss
    (100.0, {100.0}, 100.0, "declared lost"),        # its own work was given away
    (100.0, set(), 100.001, "newer process"),        # restarted (or fenced) since
])
def test_lease_refusal(asking: float, lost: set[float], newest: float | None,
                       refused_because: str) -> None:
    reason = lease_refusal(asking, lost, newest)
    assert (reason == "") == (refused_because == "") and refused_because in reason
