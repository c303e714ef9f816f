"""Worker loss: requeue what streamed nothing, end the rest (core.recovery)."""

from __future__ import annotations

from services.scheduler import Ledger, Reject, Requeue, requeue_lost
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
