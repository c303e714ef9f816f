"""ClusterTracker: heartbeats and queue statuses → the core's ClusterView (fail closed)."""

from __future__ import annotations

from schemas.status import QueueStatus
from services.ingest.cluster import ClusterTracker, Freshness
from services.ingest.core import ModelRegistry
from tests.builders_schemas import make_heartbeat

NOW = 1_000.0
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"  # alias of llama-3.1-8b in the registry


def tracker() -> ClusterTracker:
    return ClusterTracker(ModelRegistry.from_mapping(), Freshness(3.0, 5.0))


def beat(worker: str, **changes: object) -> object:
    fields: dict[str, object] = {
        "worker_id": worker, "model": LLAMA, "ts": NOW - 1, "interval_s": 1.0, "seq": 1,
        "started_at": NOW - 100, "draining": False,
    }
    fields.update(changes)
    return make_heartbeat(**fields)


def status(model: str, scheduler: str, pending: int, drain: float, ts: float,
           running: int = 0, usable: int = 0) -> QueueStatus:
    return QueueStatus(model=model, scheduler_id=scheduler, pending_requests=1,
                       pending_tokens=pending, running_tokens=running, drain_tokens_per_s=drain,
                       live_workers=1, max_usable_kv_tokens=usable, ts=ts)


def test_fresh_workers_count_and_stale_draining_or_empty_ones_do_not() -> None:
    t = tracker()
    t.observe_heartbeat(beat("a", kv_total_tokens=1000, kv_free_tokens=10))
    t.observe_heartbeat(beat("b", kv_total_tokens=5000, kv_free_tokens=0))
    t.observe_heartbeat(beat("stale", ts=NOW - 3.5, kv_total_tokens=9000, kv_free_tokens=0))
    t.observe_heartbeat(beat("ahead", ts=NOW + 3600, kv_total_tokens=9000, kv_free_tokens=0))
    t.observe_heartbeat(beat("draining", draining=True, kv_total_tokens=9000, kv_free_tokens=0))
    t.observe_heartbeat(beat("nokv", kv_total_tokens=0, kv_free_tokens=0, kv_total_bytes=0,
                             kv_free_bytes=0))
    capacity = t.view(NOW).models["llama-3.1-8b"]  # keyed by the canonical name
    assert capacity.live_workers == 2
    assert capacity.max_usable_kv_tokens == 5000  # whole budget, not what is free
    assert t.served_models(NOW) == [LLAMA]
    assert t.heartbeats_seen == 6


def test_prefill_workers_are_not_capacity_for_whole_requests() -> None:
    # They compute prompts for decode workers only: with the decode tier down the model
    # has no live worker (admission answers 503 at once, not a 504 after the timeout).
    t = tracker()
    t.observe_heartbeat(beat("p", role="prefill", kv_total_tokens=9000, kv_free_tokens=0))
    assert t.view(NOW).models["llama-3.1-8b"].live_workers == 0
    assert t.served_models(NOW) == []
    t.observe_heartbeat(beat("d", role="decode", kv_total_tokens=1000, kv_free_tokens=0))
    capacity = t.view(NOW).models["llama-3.1-8b"]
    assert (capacity.live_workers, capacity.max_usable_kv_tokens) == (1, 1000)


def test_freshness_is_three_intervals() -> None:
    t = tracker()
    t.observe_heartbeat(beat("a", ts=NOW - 2.9, interval_s=1.0))
    assert t.view(NOW).models["llama-3.1-8b"].live_workers == 1
    assert t.view(NOW + 0.2).models["llama-3.1-8b"].live_workers == 0  # seen lately


def test_a_model_seen_lately_stays_in_the_view_without_a_live_worker() -> None:
    """Found by an audit: a model the registry does not list was answered 404
    unknown_model (which clients do not retry) while its only worker drained or
    restarted; seen within model_memory_s it is in the view with no live worker (503)."""
    t = tracker()
    t.observe_heartbeat(beat("a", model="org/custom-14b", draining=True))
    t.observe_heartbeat(beat("b", model="org/old-7b", ts=NOW - 301))
    view = t.view(NOW)
    assert view.models["org/custom-14b"].live_workers == 0
    assert "org/old-7b" not in view.models  # quiet for longer: unknown again
    assert t.served_models(NOW) == []


def test_newest_heartbeat_wins_across_restarts() -> None:
    t = tracker()
    t.observe_heartbeat(beat("a", started_at=NOW - 10, seq=0, draining=False))
    t.observe_heartbeat(beat("a", started_at=NOW - 100, seq=99, draining=True))  # old process
    assert t.view(NOW).models["llama-3.1-8b"].live_workers == 1
    t.forget_worker("a")
    assert t.view(NOW).models == {}


def test_queued_tokens_are_summed_over_fresh_schedulers_and_the_drain_rate_is_not() -> None:
    # Each replica queues its own partitions' requests, but measures the drain from every
    # terminal event: the same fleet's rate, counted once.
    t = tracker()
    t.observe_heartbeat(beat("a"))
    t.observe_status(status(LLAMA, "s1", 1000, 50.0, NOW - 1))
    t.observe_status(status("llama-3.1-8b", "s2", 500, 45.0, NOW - 2))
    t.observe_status(status("llama-3.1-8b", "s3", 9999, 99.0, NOW - 60))  # stale
    t.observe_status(status("llama-3.1-8b", "s4", 7777, 99.0, NOW + 3600))  # a clock far ahead
    capacity = t.view(NOW).models["llama-3.1-8b"]
    assert (capacity.queued_tokens, capacity.drain_tokens_per_s) == (1500, 50.0)
    # The last status read from a scheduler is its latest (the log orders them), whatever
    # its stamp says: s4 back on time replaces its far-ahead one.
    t.observe_status(status("llama-3.1-8b", "s4", 100, 55.0, NOW))
    capacity = t.view(NOW).models["llama-3.1-8b"]
    assert (capacity.queued_tokens, capacity.drain_tokens_per_s) == (1600, 55.0)


def test_kv_headroom_is_the_live_budget_minus_what_running_requests_reserve() -> None:
    t = tracker()
    t.observe_heartbeat(beat("a", kv_total_tokens=1000, kv_free_tokens=0))
    t.observe_heartbeat(beat("b", kv_total_tokens=5000, kv_free_tokens=0))
    t.observe_heartbeat(beat("gone", ts=NOW - 3.5, kv_total_tokens=9000, kv_free_tokens=0))
    # Two replicas, each reading every assignment: the running figure is the fleet's once.
    t.observe_status(status(LLAMA, "s1", 10, 0.0, NOW - 1, running=1500))
    t.observe_status(status(LLAMA, "s2", 10, 0.0, NOW - 1, running=1400))
    assert t.view(NOW).models["llama-3.1-8b"].kv_headroom_tokens == 4500
    t.observe_status(status(LLAMA, "s2", 10, 0.0, NOW, running=9000))
    assert t.view(NOW).models["llama-3.1-8b"].kv_headroom_tokens == 0  # never negative


def test_the_largest_request_is_judged_by_the_schedulers_usable_kv_and_block_size() -> None:
    # The scheduler keeps a safety margin off each worker's KV and rounds to the live
    # workers' block size: ingest judges "too large" the same way, not a round trip later.
    t = tracker()
    t.observe_heartbeat(beat("a", kv_total_tokens=1000, kv_free_tokens=0, block_size=32))
    capacity = t.view(NOW).models["llama-3.1-8b"]
    assert (capacity.max_usable_kv_tokens, capacity.block_size) == (1000, 32)  # no status yet
    t.observe_status(status(LLAMA, "s1", 0, 0.0, NOW - 1, usable=950))
    assert t.view(NOW).models["llama-3.1-8b"].max_usable_kv_tokens == 950


def test_status_without_workers_keeps_the_model_with_no_live_worker() -> None:
    t = tracker()
    t.observe_status(status("other-model", "s1", 10, 1.0, NOW))
    capacity = t.view(NOW).models["other-model"]
    assert capacity.live_workers == 0 and capacity.queued_tokens == 10


def test_a_worker_of_no_partition_of_the_assignments_topic_is_no_capacity() -> None:
    # The scheduler refuses it (its work could never be sent): admission must not count
    # it. Until the watcher has read the topic's partitions (slots None), any counts.
    t = tracker()
    t.observe_heartbeat(beat("stray", partition=16, kv_total_tokens=9000, kv_free_tokens=0))
    t.observe_heartbeat(beat("ok", partition=15, kv_total_tokens=1000, kv_free_tokens=0))
    assert t.view(NOW).models["llama-3.1-8b"].live_workers == 2
    t.slots = frozenset(range(16))
    capacity = t.view(NOW).models["llama-3.1-8b"]
    assert (capacity.live_workers, capacity.max_usable_kv_tokens) == (1, 1000)
    assert [hb.worker_id for hb in t.live_workers(NOW)] == ["ok"]


def test_workers_and_statuses_long_silent_are_forgotten() -> None:
    # Nothing writes a heartbeat tombstone: every worker id ever seen stayed, and every
    # admission's view walked them all.
    t = tracker()
    for i in range(1_000):
        t.observe_heartbeat(beat(f"old{i}"))  # type: ignore[arg-type]
        t.observe_status(status(LLAMA, f"sched-{i}", 10, 1.0, NOW))
    t.observe_heartbeat(beat("live", ts=NOW + 400.0))  # type: ignore[arg-type]
    assert len(t.view(NOW + 100.0).models) == 1  # within model_memory_s: all kept
    assert len(t._workers) == 1_001
    t.view(NOW + 400.0)
    assert list(t._workers) == ["live"] and t._statuses == {}
