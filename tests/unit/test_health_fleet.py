"""The fleet tracker: newest heartbeat per worker, tombstones, drains, queue status."""

from __future__ import annotations

from schemas.control import DrainWorker
from schemas.status import QueueStatus
from services.health.fleet import FleetTracker
from tests.fakes.heartbeat_worker import heartbeat


def qs(model: str, scheduler: str, ts: float, pending: int = 1) -> QueueStatus:
    return QueueStatus(model=model, scheduler_id=scheduler, pending_requests=pending,
                       pending_tokens=10 * pending, running_tokens=0, drain_tokens_per_s=0.0,
                       live_workers=1, max_usable_kv_tokens=100, ts=ts)


def test_newest_heartbeat_wins_across_restarts() -> None:
    t = FleetTracker()
    assert t.observe_heartbeat(heartbeat("w1", started_at=100.0, seq=5))
    assert not t.observe_heartbeat(heartbeat("w1", started_at=100.0, seq=4))
    # A restarted process (later started_at) wins even with a lower seq.
    assert t.observe_heartbeat(heartbeat("w1", started_at=200.0, seq=0))
    # ... and a late beat of the old process does not bring it back.
    assert not t.observe_heartbeat(heartbeat("w1", started_at=100.0, seq=6))
    rec = t.record("w1")
    assert rec is not None and rec.heartbeat.started_at == 200.0
    assert t.heartbeats_seen == 4


def test_tombstone_then_beat() -> None:
    t = FleetTracker()
    t.observe_heartbeat(heartbeat("w1", seq=1))
    t.observe_tombstone("w1")
    rec = t.record("w1")
    assert rec is not None and rec.tombstoned
    t.observe_heartbeat(heartbeat("w1", seq=2))
    rec = t.record("w1")
    assert rec is not None and not rec.tombstoned
    t.observe_tombstone("w9")  # never heard of: remembered, but no record
    assert t.record("w9") is None and t.tombstoned("w9")
    assert set(t.records()) == {"w1"}


def test_newest_drain_and_status() -> None:
    t = FleetTracker()
    t.observe_heartbeat(heartbeat("w1"))
    t.observe_drain(DrainWorker(worker_id="w1", reason="b", issued_by="cli", issued_at=20.0))
    t.observe_drain(DrainWorker(worker_id="w1", reason="a", issued_by="cli", issued_at=10.0))
    rec = t.record("w1")
    assert rec is not None and rec.drain is not None and rec.drain.reason == "b"
    t.observe_status(qs("m2", "s1", 5.0))
    t.observe_status(qs("m1", "s1", 3_605.0, pending=9))  # stamped by a clock an hour ahead
    t.observe_status(qs("m1", "s1", 5.0, pending=3))  # read later: the scheduler's latest
    assert [(q.model, q.pending_requests) for q in t.queue_statuses()] == [("m1", 3), ("m2", 1)]


def test_workers_silent_for_an_hour_are_forgotten_with_their_drains() -> None:
    t = FleetTracker()
    t.observe_heartbeat(heartbeat("old", ts=1_000.0))
    t.observe_heartbeat(heartbeat("new", ts=4_000.0))
    t.observe_drain(DrainWorker(worker_id="old", reason="x", issued_by="ops", issued_at=1_000.0))
    t.observe_drain(DrainWorker(worker_id="never-seen", reason="x", issued_by="ops",
                              issued_at=1_000.0))
    t.observe_status(qs("m", "sched-old", 1_000.0))
    t.prune(4_000.0)  # 3,000 s: "gone", still shown
    assert set(t.records()) == {"old", "new"}
    t.prune(4_601.0)
    assert set(t.records()) == {"new"} and t._drains == {} and t.queue_statuses() == []
