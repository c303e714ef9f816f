"""SchedulerState with prefill and decode workers: the prefill stage's assignment, the
hand-off (event.prefilled) placed by the leader as the next attempt, replicas, restarts,
losses, cancels and deadlines between the two stages. No Kafka."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.codec import decode
from schemas.control import LeaseAnswer
from schemas.messages import CONTROL_ADAPTER
from schemas.requests import Assignment
from schemas.workers import EventAborted, EventFailed, EventPrefilled, WorkerHeartbeat
from services.scheduler.runtime.state import SchedulerState
from tests.unit.test_scheduler_runtime_state import (
    SCHED,
    T,
    admitted,
    assignments,
    beat,
    cancel,
    done,
    events,
    new_state,
    replies,
    started,
    tick_and_release,
)

PARAMS: dict[str, Any] = {"engine": "sim", "prompt_tokens": 1_000}


def pd_beat(worker_id: str, partition: int, role: str, ts: float = T, **changes: Any
            ) -> WorkerHeartbeat:
    return beat(worker_id, partition, ts, role=role, **changes)


def pd_state(ts: float = T, **config: Any) -> SchedulerState:
    state = new_state(**{"takeover_s": 0.0, **config})
    state.observe_heartbeat(pd_beat("p0", 0, "prefill", ts))
    state.observe_heartbeat(pd_beat("d0", 1, "decode", ts))
    state.restore()
    return state


def lease_answer(state: SchedulerState, now: float) -> LeaseAnswer:
    """The answer ``state``'s next (leading) cycle gives a worker that asked to renew."""
    (out,) = [o for e in state.tick(now).effects for o in e.first
              if o.topic == "llmq.control"]
    answer = decode(out.value, CONTROL_ADAPTER)
    assert isinstance(answer, LeaseAnswer)
    return answer


def prefilled(a: Assignment, ts: float = T + 1) -> EventPrefilled:
    return EventPrefilled(request_id=a.request_id, tenant="acme", attempt=a.attempt,
                          worker_id=a.worker_id, ts=ts, kv_transfer=PARAMS, prompt_tokens=1_000)


def place_prefill(state: SchedulerState, rid: str = "r1", **kw: Any) -> Assignment:
    state.on_request(admitted(rid, **kw), ("tp", 0), T)
    ((partition, a),) = assignments(state.tick(T).effects)
    assert (a.worker_id, partition, a.phase, a.attempt) == ("p0", 0, "prefill", 1)
    return a


def test_a_request_runs_its_prefill_then_its_decode_stage_as_the_next_attempt() -> None:
    state = pd_state()
    a = place_prefill(state)
    assert a.kv_tokens == 1_008  # 1,000 prompt tokens + the sampled one, in blocks
    assert a.kv_transfer is None
    state.observe_event(started(a, "p0"))
    assert state.observe_event(prefilled(a))  # worth a cycle: a hand-off waits
    assert state.log.status("r1") == "handoff"
    result = state.tick(T + 1)
    ((partition, b),) = assignments(result.effects)
    assert (b.worker_id, partition, b.phase, b.attempt) == ("d0", 1, "decode", 2)
    assert b.kv_transfer == PARAMS and b.kv_tokens == 1_024 and b.admitted == a.admitted
    assert b.engine_priority == 0  # hand-offs go first
    assert state.reserved_kv("d0") == 1_024 and state.log.status("r1") == "active"
    # The prompt's KV stays on the prefill worker until the decode stage pulls it.
    assert state.reserved_kv("p0") == 1_008
    assert state.observe_event(started(b, "d0"))
    assert state.reserved_kv("p0") == 0
    state.observe_event(done(b, "d0"))
    assert state.log.status("r1") == "finished" and state.reserved_kv("d0") == 0
    assert replies(result.effects) == []  # nothing from the scheduler to the client


def test_the_decode_stage_goes_to_a_decode_worker_of_the_engine_that_holds_the_kv() -> None:
    # d1 is roomier but runs another engine: its connector could not pull the prompt's KV.
    state = pd_state()
    state.observe_heartbeat(pd_beat("d1", 2, "decode", engine="openai",
                                    kv_total_tokens=90_000, kv_free_tokens=90_000))
    a = place_prefill(state)  # on p0, whose engine (sim) d0 runs too
    state.observe_event(prefilled(a))
    ((_, b),) = assignments(state.tick(T + 1).effects)
    assert (b.worker_id, b.phase, b.kv_transfer) == ("d0", "decode", PARAMS)
    # A restarted scheduler reads the engine back from the log's event.prefilled.
    after = new_state(takeover_s=0.0)
    for hb in (pd_beat("p0", 0, "prefill"), pd_beat("d0", 1, "decode"),
               pd_beat("d1", 2, "decode", engine="openai", kv_total_tokens=90_000,
                       kv_free_tokens=90_000)):
        after.observe_heartbeat(hb)
    after.observe_assignment(a)
    after.observe_event(prefilled(a))
    after.restore()
    ((_, c),) = assignments(after.tick(T + 1).effects)
    assert (c.worker_id, c.phase, c.attempt, c.kv_transfer) == ("d0", "decode", 2, PARAMS)
    # With no decode worker of its engine left, the prompt is computed again: the request
    # runs whole (attempt 2) on the other engine's decode worker instead of failing there.
    alone = pd_state()
    alone.observe_heartbeat(pd_beat("d1", 2, "decode", engine="openai"))
    a = place_prefill(alone, "r2")
    alone.observe_heartbeat(pd_beat("d0", 1, "decode", T + 1, draining=True))
    alone.observe_event(prefilled(a))
    ((_, d),) = assignments(alone.tick(T + 1).effects)
    assert (d.worker_id, d.phase, d.attempt, d.kv_transfer) == ("d1", "whole", 2, None)


def test_the_decode_stage_goes_to_a_decode_worker_of_the_prefill_workers_version() -> None:
    """Found by an audit: stages were paired by engine only, so during a rolling upgrade a
    prompt computed with v1's weights was decoded by a v2 worker (the request pins no
    version)."""
    state = new_state(takeover_s=0.0)
    state.observe_heartbeat(pd_beat("p0", 0, "prefill", model_version="v1"))
    state.observe_heartbeat(pd_beat("d0", 1, "decode", model_version="v1"))
    state.observe_heartbeat(pd_beat("d1", 2, "decode", model_version="v2",
                                    kv_total_tokens=90_000, kv_free_tokens=90_000))  # roomier
    state.restore()
    a = place_prefill(state)
    state.observe_event(prefilled(a))
    ((_, b),) = assignments(state.tick(T + 1).effects)
    assert (b.worker_id, b.phase, b.request.model_version) == ("d0", "decode", None)


def test_only_the_leader_places_a_hand_off_and_replicas_book_it_from_the_log() -> None:
    leader, other = pd_state(), pd_state()
    a = place_prefill(leader)
    other.observe_assignment(a)
    for state in (leader, other):
        state.observe_event(prefilled(a))
    assert assignments(other.tick(T + 1, handle_losses=False).effects) == []
    ((_, b),) = assignments(leader.tick(T + 1).effects)
    other.observe_assignment(b)
    assert other.reserved_kv("d0") == 1_024 and other.reserved_kv("p0") == 1_008
    other.observe_event(started(b, "d0"))
    assert other.reserved_kv("p0") == 0
    # The prefill worker's process lost nothing: its lease may be renewed.
    other.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 2, renew=True))
    answer = lease_answer(other, T + 2)
    assert answer.granted, answer


def test_a_new_leader_places_the_hand_off_the_old_one_left() -> None:
    old, new = pd_state(), pd_state()
    a = place_prefill(old)
    new.observe_assignment(a)
    for state in (old, new):
        state.observe_event(prefilled(a))
    assert len(old.tick(T + 1, handle_losses=False).effects) == 0  # never led: nothing
    old_led = old.tick(T + 1)  # leads now: adopts and places it ...
    assert [b.attempt for _, b in assignments(old_led.effects)] == [2]
    # ... while a replica that adopted it but lost the lead before placing gives it back.
    third = pd_state()
    third.observe_assignment(a)
    third.observe_event(prefilled(a))
    third.observe_heartbeat(pd_beat("d0", 1, "decode", T + 1, draining=True))
    assert assignments(third.tick(T + 1).effects) == []  # adopted, no decode worker
    assert len(third.pending) == 1
    third.tick(T + 1, handle_losses=False)
    assert len(third.pending) == 0 and third.log.status("r1") == "handoff"


def test_a_restarted_scheduler_places_the_hand_off_from_the_log() -> None:
    before = pd_state()
    a = place_prefill(before)
    after = new_state(takeover_s=0.0)
    after.observe_heartbeat(pd_beat("p0", 0, "prefill"))
    after.observe_heartbeat(pd_beat("d0", 1, "decode"))
    after.observe_event(prefilled(a))  # replayed in any order
    after.observe_assignment(a)
    assert after.restore() == 0  # no active assignment ...
    assert after.reserved_kv("p0") == a.kv_tokens  # ... but the prompt's KV waits on p0
    # The request's record is redelivered (its offset was committed with the prefill's
    # assignment, or not): acked, not placed again from the start.
    assert [e.tickets for e in after.on_request(admitted("r1"), ("tp", 0), T)] == [
        (("tp", 0),)]
    ((_, b),) = assignments(after.tick(T + 1).effects)
    assert (b.phase, b.attempt, b.kv_transfer) == ("decode", 2, PARAMS)


def test_a_lost_decode_worker_requeues_the_whole_request() -> None:
    state = pd_state()
    a = place_prefill(state)
    state.observe_event(prefilled(a))
    ((_, b),) = assignments(state.tick(T + 1).effects)
    assert b.worker_id == "d0"
    state.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 5))
    state.observe_heartbeat(pd_beat("d1", 3, "decode", T + 5))
    result = tick_and_release(state, T + 5)  # d0 last beat at T: lost, nothing streamed
    assert result.lost_workers == ["d0"]
    ((_, again),) = assignments(result.effects)
    assert (again.attempt, again.phase, again.worker_id, again.kv_tokens) == (
        3, "prefill", "p0", 1_008)  # from the start: the prompt's KV went with d0
    assert state.reserved_kv("p0") == 1_008  # the new prefill only: the old one is over


def test_a_lost_prefill_worker_requeues_its_prefill_stage_as_the_whole_request() -> None:
    state = pd_state()
    a = place_prefill(state)
    state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 5))
    state.observe_heartbeat(pd_beat("p1", 2, "prefill", T + 5))
    result = tick_and_release(state, T + 5)
    assert result.lost_workers == ["p0"]
    ((_, again),) = assignments(result.effects)
    assert (again.attempt, again.phase, again.worker_id) == (2, "prefill", "p1")
    assert state.reserved_kv("p1") == a.kv_tokens


def test_cancel_and_deadline_between_the_stages_end_at_the_decode_attempt() -> None:
    # Cancelled after its prefill, before the leader queued the decode stage.
    state = pd_state()
    a = place_prefill(state)
    state.observe_event(prefilled(a))
    state.on_cancel(cancel("r1"), T + 1)
    result = state.tick(T + 1)
    assert assignments(result.effects) == []
    (error,) = replies(result.effects)
    (event,) = events(result.effects)
    assert (error.code, error.attempt) == ("cancelled", 2)
    assert isinstance(event, EventAborted) and (event.attempt, event.worker_id) == (2, SCHED)
    assert state.log.status("r1") == "finished"
    # Past its deadline while its decode stage waits (no decode worker takes it).
    state = pd_state()
    a = place_prefill(state, "r2", timeout_s=5.0)
    state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 1, draining=True))
    state.observe_event(prefilled(a))
    assert assignments(state.tick(T + 1).effects) == []
    result = state.tick(T + 6)
    (error,) = replies(result.effects)
    (event,) = events(result.effects)
    assert (error.code, error.attempt) == ("queue_timeout", 2)
    assert isinstance(event, EventFailed) and event.attempt == 2
    assert len(state.pending) == state.tracked() == 0


def test_a_prefill_failure_ends_the_request_without_a_decode_stage() -> None:
    state = pd_state()
    a = place_prefill(state)
    state.observe_event(EventFailed(request_id="r1", tenant="acme", attempt=1, worker_id="p0",
                                    ts=T + 1, code="invalid", message="bad prompt"))
    assert state.log.status("r1") == "finished"
    assert assignments(state.tick(T + 1).effects) == [] and state.reserved_kv("p0") == 0
    assert a.attempt == 1


def test_a_new_leader_waits_before_it_places_hand_offs() -> None:
    # The old leader placed r1#2; the new one has not read that assignment yet when it
    # begins to lead: it must not place attempt 2 a second time.
    old = pd_state()
    new = pd_state(takeover_s=1.0)
    a = place_prefill(old)
    new.observe_assignment(a)
    for state in (old, new):
        state.observe_event(prefilled(a))
    ((_, b),) = assignments(old.tick(T + 1).effects)
    assert assignments(new.tick(T + 1).effects) == []  # just began to lead: waits
    new.observe_assignment(b)  # ... and reads the old leader's placement meanwhile
    assert assignments(new.tick(T + 2.5).effects) == []
    assert new.log.status("r1") == "active"


def test_a_prefill_worker_lost_before_its_late_hand_off_is_requeued_once() -> None:
    # p0 goes stale while prefilling; the loss is decided (held for the reply check), then
    # p0's event.prefilled is read: the request starts over once, whole, not also decoded.
    state = pd_state()
    a = place_prefill(state)
    state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 5))
    state.observe_heartbeat(pd_beat("p1", 2, "prefill", T + 5))
    first = state.tick(T + 5)
    assert first.lost_workers == ["p0"] and len(first.held) == 1
    state.observe_event(prefilled(a, ts=T + 5))
    assert state.log.status("r1") == "lost"
    assert assignments(state.tick(T + 5).effects) == []  # not adopted
    released = [e for h in first.held for e in state.release(h, False, T + 5)]
    placed = assignments([*released, *state.tick(T + 5).effects])
    assert [(b.attempt, b.phase, b.worker_id) for _, b in placed] == [(2, "prefill", "p1")]


def test_a_hand_off_from_a_gone_prefill_worker_starts_over_whole() -> None:
    state = pd_state()
    a = place_prefill(state)
    state.observe_event(prefilled(a))
    state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 10))
    state.observe_heartbeat(pd_beat("p1", 2, "prefill", T + 10))
    placed = assignments(state.tick(T + 10).effects)
    assert [(b.attempt, b.phase, b.worker_id, b.kv_transfer) for _, b in placed] == [
        (2, "prefill", "p1", None)]


def test_followers_keep_the_prefill_workers_lease_in_any_read_order() -> None:
    for order in ("assignment first", "done first"):
        leader, other = pd_state(), pd_state()
        a = place_prefill(leader)
        other.observe_assignment(a)
        leader.observe_event(prefilled(a))
        ((_, b),) = assignments(leader.tick(T + 1).effects)
        if order == "assignment first":  # the assignments topic ahead of the events topic
            other.observe_assignment(b)
            other.observe_event(prefilled(a))
        else:  # the events topic ahead
            other.observe_event(prefilled(a))
            other.observe_event(done(b, "d0"))
            other.observe_assignment(b)
        other.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 2, renew=True))
        answer = lease_answer(other, T + 2)
        assert answer.granted, (order, answer)


def test_a_hand_off_from_a_restarted_prefill_worker_starts_over_whole() -> None:
    state = pd_state()
    a = place_prefill(state)
    state.observe_event(prefilled(a))
    # p0 restarted (a newer process, fresh heartbeat) before the hand-off was adopted.
    state.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 1, started_at=T + 0.5))
    placed = assignments(state.tick(T + 1).effects)
    assert [(b.attempt, b.phase, b.kv_transfer) for _, b in placed] == [(2, "prefill", None)]


def test_a_queued_hand_off_whose_prefill_worker_dies_starts_over_whole() -> None:
    state = pd_state()
    a = place_prefill(state)
    state.observe_heartbeat(pd_beat("d0", 1, "decode", T, draining=True, seq=5))  # no decode
    state.observe_event(prefilled(a))
    assert assignments(state.tick(T + 1).effects) == [] and len(state.pending) == 1
    # p0 goes stale while the decode stage waits; a decode worker comes back.
    state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 5, seq=10))
    state.observe_heartbeat(pd_beat("p1", 2, "prefill", T + 5))
    placed = assignments(state.tick(T + 5).effects)
    assert [(b.attempt, b.phase, b.worker_id, b.kv_transfer) for _, b in placed] == [
        (2, "prefill", "p1", None)]
    assert state.reserved_kv("p0") == 0  # the KV p0 held went with it


def test_a_hand_off_queued_past_the_connectors_hold_starts_over_whole() -> None:
    # The decode tier is busy (draining here) for longer than the prefill server keeps an
    # unread prompt's KV: the decode stage would fail on missing KV, so the request is
    # computed again instead. Without a TTL it keeps waiting for the KV.
    for ttl, expected in ((5.0, [(2, "prefill", "p0", None)]), (None, [(2, "decode", "d0")])):
        state = pd_state(handoff_ttl_s=ttl)
        a = place_prefill(state)
        state.observe_heartbeat(pd_beat("d0", 1, "decode", T, draining=True, seq=5))
        state.observe_event(prefilled(a, ts=T + 1))
        state.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 5.5))  # alive all along
        assert assignments(state.tick(T + 5.9).effects) == []  # within the hold: it waits
        assert state.reserved_kv("p0") > 0  # the prompt's KV, held for the decode stage
        state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 6.2, seq=10))  # back
        state.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 6.2))
        placed = assignments(state.tick(T + 6.2).effects)
        got = [(b.attempt, b.phase, b.worker_id, b.kv_transfer) if ttl else
               (b.attempt, b.phase, b.worker_id) for _, b in placed]
        assert got == expected, (ttl, got)


def test_a_hand_off_run_whole_keeps_the_prefill_workers_lease() -> None:
    # The decode stage ran whole on a mixed worker (no decode worker could): followers
    # must not take that for a requeue of the prefill worker's work.
    leader, other = pd_state(), pd_state()
    for state in (leader, other):
        state.observe_heartbeat(beat("m0", 4))
    a = place_prefill(leader)
    other.observe_assignment(a)
    for state in (leader, other):
        state.observe_event(prefilled(a))
        state.observe_heartbeat(pd_beat("d0", 1, "decode", T, draining=True, seq=5))
    ((_, b),) = assignments(leader.tick(T + 1).effects)
    assert (b.worker_id, b.phase, b.attempt) == ("m0", "whole", 2)
    other.observe_assignment(b)
    other.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 2, renew=True))
    answer = lease_answer(other, T + 2)
    assert answer.granted, answer


def test_a_prefill_workers_lost_work_ended_in_the_queue_refuses_its_lease() -> None:
    # p0 died mid-prefill (no event.prefilled); its requeue ended in the queue, signed by
    # the leader. A follower must refuse that incarnation's renewal, as for any worker.
    leader, other = pd_state(), pd_state()
    a = place_prefill(leader, timeout_s=7.0)
    other.observe_assignment(a)
    for state in (leader, other):  # no worker left that could run it
        state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 5, draining=True))
    result = tick_and_release(leader, T + 5)  # p0 stale: requeued, no prefill worker left
    assert result.lost_workers == ["p0"]
    ended = leader.tick(T + 8)  # the requeue's deadline passed in the queue
    for event in events(ended.effects):
        other.observe_event(event)
    other.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 8.5, renew=True))
    answer = lease_answer(other, T + 8.5)
    assert not answer.granted, answer


def test_a_prefilled_prompt_is_no_longer_prompt_work() -> None:
    state = pd_state()
    a = place_prefill(state)
    assert state.ledger.uncomputed_prompt("p0") == 1_000
    state.observe_event(prefilled(a))
    assert state.ledger.uncomputed_prompt("p0") == 0
    assert state.reserved_kv("p0") == 1_008  # still held until the decode stage starts


def test_a_request_no_decode_worker_could_hold_is_refused_too_large_at_once() -> None:
    state = new_state(takeover_s=0.0)
    state.observe_heartbeat(pd_beat("p0", 0, "prefill", kv_total_tokens=100_000,
                                    kv_free_tokens=100_000, kv_total_bytes=100_000,
                                    kv_free_bytes=100_000))
    state.observe_heartbeat(pd_beat("d0", 1, "decode"))  # 10,000 tokens
    state.restore()
    state.on_request(admitted("big", prompt=20_000, max_tokens=8, timeout_s=120.0),
                     ("tp", 0), T)
    (error,) = replies(state.tick(T).effects)
    assert error.code == "too_large"


def test_queue_status_counts_no_prefill_worker_as_live_capacity() -> None:
    state = new_state(takeover_s=0.0)
    state.observe_heartbeat(pd_beat("p0", 0, "prefill", kv_total_tokens=50_000,
                                    kv_free_tokens=50_000, kv_total_bytes=50_000,
                                    kv_free_bytes=50_000))
    state.observe_heartbeat(pd_beat("d0", 1, "decode"))
    state.restore()
    (status,) = state.statuses(T)
    assert (status.live_workers, status.max_usable_kv_tokens) == (1, 9_500)


def test_a_decode_stage_is_not_counted_as_a_second_placement() -> None:
    from services.common import metrics as m
    from services.scheduler.runtime.metrics import SchedulerMetrics

    def placements() -> float:
        return sum(m.REGISTRY.get_sample_value(
            "llmq_placements_total", {"worker": w, "lane": "short"}) or 0.0
            for w in ("p0", "d0"))

    def sample(name: str, **labels: str) -> float:
        return m.REGISTRY.get_sample_value(name, labels) or 0.0

    state, meters = pd_state(), SchedulerMetrics()
    before = placements()
    stages = sample("llmq_decode_stages_total", worker="d0", lane="short")
    waits = sample("llmq_handoff_wait_seconds_count", lane="short")
    waited = sample("llmq_handoff_wait_seconds_sum", lane="short")
    state.on_request(admitted("r1"), ("tp", 0), T)
    first = state.tick(T)
    meters.tick(first)
    ((_, a),) = assignments(first.effects)
    state.observe_event(prefilled(a))
    second = state.tick(T + 1)
    meters.tick(second)
    assert [p.phase for p in (*first.placements, *second.placements)] == ["prefill", "decode"]
    assert placements() == before + 1
    # The decode worker's share is counted apart, with how long the hand-off waited.
    assert sample("llmq_decode_stages_total", worker="d0", lane="short") == stages + 1
    assert sample("llmq_handoff_wait_seconds_count", lane="short") == waits + 1
    assert sample("llmq_handoff_wait_seconds_sum", lane="short") - waited == \
        pytest.approx(second.placements[0].waited_s)


def test_a_restart_books_the_prompt_kv_a_placed_decode_stage_has_not_pulled_yet() -> None:
    before = pd_state()
    a = place_prefill(before)
    before.observe_event(prefilled(a))
    ((_, b),) = assignments(before.tick(T + 1).effects)
    replay: list[Any] = [a, prefilled(a), b]
    for order in (replay, list(reversed(replay))):
        after = new_state()
        after.observe_heartbeat(pd_beat("p0", 0, "prefill"))
        after.observe_heartbeat(pd_beat("d0", 1, "decode"))
        for record in order:
            if isinstance(record, Assignment):
                after.observe_assignment(record)
            else:
                after.observe_event(record)
        assert after.restore() == 1  # the decode stage ...
        assert (after.reserved_kv("d0"), after.reserved_kv("p0")) == (1_024, 1_008)  # + KV
        after.observe_event(started(b, "d0"))  # it pulls the prompt's KV
        assert after.reserved_kv("p0") == 0
    # Once the decode stage started, a restart books the decode stage only.
    after = new_state()
    for record in (a, prefilled(a), b, started(b, "d0")):
        if isinstance(record, Assignment):
            after.observe_assignment(record)
        else:
            after.observe_event(record)
    after.restore()
    assert (after.reserved_kv("d0"), after.reserved_kv("p0")) == (1_024, 0)


def test_a_restart_books_no_prefill_whose_decode_stage_was_lost_and_requeued() -> None:
    state = pd_state()
    for worker in ("m0",):
        state.observe_heartbeat(beat(worker, 4))
    a = place_prefill(state)
    state.observe_event(prefilled(a))
    ((_, b),) = assignments(state.tick(T + 1).effects)
    assert b.phase == "decode"
    # d0 dies before it starts: the request starts over whole (attempt 3).
    state.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 5))
    state.observe_heartbeat(beat("m0", 4, T + 5))
    result = tick_and_release(state, T + 5)
    ((_, c),) = assignments(result.effects)
    assert c.attempt == 3
    after = new_state()
    for record in (a, prefilled(a), b, c):
        if isinstance(record, Assignment):
            after.observe_assignment(record)
        else:
            after.observe_event(record)
    after.restore()
    assert after.reserved_kv("p0") == state.reserved_kv("p0")
    assert after.log.pinned() == []


def test_a_follower_reading_event_prefilled_first_books_the_prefill_stage() -> None:
    leader, other = pd_state(), pd_state()
    a = place_prefill(leader)
    other.observe_event(prefilled(a))  # the events topic ahead of the assignments topic
    other.observe_assignment(a)
    assert other.reserved_kv("p0") == leader.reserved_kv("p0") == a.kv_tokens


def test_running_tokens_leave_prefill_bookings_out() -> None:
    state = pd_state()
    place_prefill(state)
    (status,) = state.statuses(T)
    assert status.running_tokens == 0 and state.reserved_kv("p0") > 0
