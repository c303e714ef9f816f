"""SchedulerState: inputs in, the core's decisions out as effects — no Kafka.

Drives the state the way the Faust app does (heartbeats, admitted requests with tickets,
events, ticks) and checks the records it would produce and the acks it would release.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from schemas.codec import SchemaError, decode, encode
from schemas.control import CancelRequest, LeaseAnswer
from schemas.messages import (
    ASSIGNMENT_ADAPTER,
    CONTROL_ADAPTER,
    EVENT_ADAPTER,
    REPLY_ADAPTER,
    REQUEST_ADAPTER,
)
from schemas.replies import Error, Usage
from schemas.requests import AdmittedRequest, Assignment
from schemas.workers import (
    EventAborted,
    EventDone,
    EventFailed,
    EventFirstToken,
    EventStarted,
    LifecycleEvent,
    WorkerHeartbeat,
)
from services.scheduler import DEFAULT_PROFILE, QueueConfig, build_pipeline
from services.scheduler.runtime.results import Effect, RuntimeConfig, TickResult
from services.scheduler.runtime.state import SchedulerState
from tests.builders_schemas import make_admitted, make_heartbeat, make_request

T = 1_700_000_000.0
MODEL = "m"
SCHED = "sched-1"


def new_state(**config: Any) -> SchedulerState:
    """A state whose first leading cycle may decide losses and hand-offs at once
    (``takeover_s`` 0 unless given: it has led for long; the takeover has tests of its
    own in ``test_scheduler_runtime_once``)."""
    config.setdefault("takeover_s", 0.0)
    cfg = RuntimeConfig(scheduler_id=SCHED, assignments_topic="p.assignments",
                        events_topic="p.events", status_topic="p.status", **config)
    return SchedulerState(cfg, QueueConfig(), build_pipeline(DEFAULT_PROFILE), random.Random(1))


def beat(worker_id: str, partition: int, ts: float = T, **changes: Any) -> WorkerHeartbeat:
    fields: dict[str, Any] = {
        "worker_id": worker_id, "partition": partition, "model": MODEL, "model_version": None,
        "pool": "any", "kv_total_tokens": 10_000, "kv_free_tokens": 10_000,
        "kv_total_bytes": 10_000, "kv_free_bytes": 10_000, "block_size": 16, "running": 0,
        "waiting": 0, "max_num_seqs": 64, "draining": False, "interval_s": 1.0,
        "started_at": T - 100, "seq": int(ts - T) + 1, "ts": ts,
    }
    fields.update(changes)
    return make_heartbeat(**fields)


def admitted(rid: str, *, prompt: int = 1_000, max_tokens: int = 24, timeout_s: float = 60.0,
             priority: str = "normal", model: str = MODEL, at: float = T) -> AdmittedRequest:
    request = make_request(request_id=rid, tenant="acme", model=model, max_tokens=max_tokens,
                           timeout_s=timeout_s, created_at=at, prefix_hash=None)
    return make_admitted(request=request, priority=priority, lane="short", prompt_tokens=prompt,
                         reply_topic="p.replies.acme", admitted_at=at)


def assignments(effects: list[Effect]) -> list[tuple[int | None, Assignment]]:
    return [(o.partition, decode(o.value, ASSIGNMENT_ADAPTER))
            for e in effects for o in e.first if o.topic == "p.assignments"]


def replies(effects: list[Effect]) -> list[Error]:
    out = [decode(o.value, REPLY_ADAPTER) for e in effects for o in e.first
           if o.topic == "p.replies.acme"]
    return [r for r in out if isinstance(r, Error)]


def events(effects: list[Effect]) -> list[Any]:
    return [decode(o.value, EVENT_ADAPTER) for e in effects for o in e.then]


def tickets(effects: list[Effect]) -> list[Any]:
    return [t for e in effects for t in e.tickets]


def started(a: Assignment, worker: str, ts: float = T + 1) -> EventStarted:
    return EventStarted(request_id=a.request_id, tenant="acme", attempt=a.attempt,
                        worker_id=worker, ts=ts)


def done(a: Assignment, worker: str, ts: float = T + 2) -> EventDone:
    return EventDone(request_id=a.request_id, tenant="acme", attempt=a.attempt,
                     worker_id=worker, ts=ts, finish_reason="stop",
                     usage=Usage(prompt_tokens=1_000, completion_tokens=20))


def tick_and_release(state: SchedulerState, now: float, answered: frozenset[tuple[str, int]]
                     = frozenset(), *, handle_losses: bool = True,
                     heard: Mapping[int, float] | None = None) -> TickResult:
    """A dispatch cycle around a worker loss, as the app runs it: the tick, its held
    worker_lost endings settled and held requeues released once the reply-topic check is
    back (``answered``: the attempts found answered), and the next tick, which places them.
    The first tick's result, with the effects of all three."""
    first = state.tick(now, handle_losses=handle_losses, heard=heard)
    checked = [e for e in first.effects if e.unless_answered is not None]
    settled = state.settle_endings(checked, answered, now)  # the held worker_lost endings
    released = [e for h in first.held for e in state.release(h, h.check[:2] in answered, now)]
    second = state.tick(now, handle_losses=handle_losses)
    return replace(first, effects=[*(e for e in first.effects if e.unless_answered is None),
                                   *settled, *released, *second.effects],
                   placed=first.placed + second.placed)


def ready_state(*workers: tuple[str, int], **config: Any) -> SchedulerState:
    state = new_state(**config)
    for worker_id, partition in workers:
        state.observe_heartbeat(beat(worker_id, partition))
    state.restore()
    return state


def test_an_admitted_request_is_placed_on_the_workers_partition_and_acked_after() -> None:
    state = ready_state(("w0", 3))
    assert state.on_request(admitted("r1"), ("tp", 0), T) == []  # queued, not acked yet
    result = state.tick(T)
    ((partition, a),) = assignments(result.effects)
    assert (partition, a.partition, a.worker_id, a.attempt) == (3, 3, "w0", 1)
    assert a.kv_tokens == 1_024  # 1,000 + 24 rounded up to 16-token blocks
    assert a.deadline == T + 60.0 and a.admitted == admitted("r1")
    assert tickets(result.effects) == [("tp", 0)]
    assert state.reserved_kv("w0") == 1_024 and state.log.status("r1") == "active"
    assert len(state.pending) == state.tracked() == 0
    assert a.engine_priority == 1  # a normal request placed at once keeps its class


def test_the_assignment_carries_the_class_the_request_aged_into() -> None:
    """A low request admitted 45 s before it is placed has aged one class (30 s each):
    its engine gets priority 1 (normal); at 60 s it would get 0."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("old", priority="low", at=T - 45, timeout_s=120.0), ("tp", 0), T)
    ((_, a),) = assignments(state.tick(T).effects)
    assert a.engine_priority == 1


@pytest.mark.parametrize("end", ["none", "done"])
def test_a_redelivered_request_is_acked_and_skipped(end: str) -> None:
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), ("tp", 0), T)
    (a,) = [x for _, x in assignments(state.tick(T).effects)]
    if end == "done":
        state.observe_event(done(a, "w0"))
    assert state.on_request(admitted("r1"), ("tp", 0), T) == [Effect(tickets=(("tp", 0),))]
    assert assignments(state.tick(T).effects) == []


def test_a_duplicate_record_of_a_pending_request_is_acked_with_it() -> None:
    state = ready_state()  # no worker: stays pending
    state.on_request(admitted("r1"), ("tp", 0), T)
    state.on_request(admitted("r1"), ("tp", 7), T)
    assert len(state.pending) == 1
    state.observe_heartbeat(beat("w0", 0))
    assert tickets(state.tick(T).effects) == [("tp", 0), ("tp", 7)]


def test_restart_rebuild_restores_reservations_and_skips_what_was_decided() -> None:
    # Before the crash: r0, r1 placed on w0 (r0 started), r2 finished, r3 pending.
    before = ready_state(("w0", 0), max_placements=3)
    for i in range(4):
        before.on_request(admitted(f"r{i}", prompt=3_000, max_tokens=8), ("tp", i), T)
    placed = [a for _, a in assignments(before.tick(T).effects)]
    assert [a.request_id for a in placed] == ["r0", "r1", "r2"]  # 3 x 3,008 <= 9,500
    replay: list[Any] = [*placed, started(placed[0], "w0"), done(placed[2], "w0")]

    # After the restart: the log is replayed (assignments and events in any order) ...
    after = new_state()
    after.observe_heartbeat(beat("w0", 0, kv_free_tokens=10_000 - 3_008))  # r0 started
    for record in reversed(replay):
        if isinstance(record, Assignment):
            after.observe_assignment(record)
        else:
            after.observe_event(record)
    assert after.restore() == 2  # r0 and r1 hold their reservations again
    assert after.reserved_kv("w0") == 2 * 3_008
    # ... then every request is redelivered (nothing was committed).
    effects = [e for i in range(4)
               for e in after.on_request(admitted(f"r{i}", prompt=3_000, max_tokens=8),
                                         ("tp", i), T)]
    assert tickets(effects) == [("tp", 0), ("tp", 1), ("tp", 2)]  # skipped and acked
    (a,) = [x for _, x in assignments(after.tick(T).effects)]
    assert a.request_id == "r3" and a.attempt == 1
    assert after.reserved_kv("w0") == 3 * 3_008


def test_restored_reservations_are_booked_even_if_the_worker_shrank() -> None:
    before = ready_state(("w0", 0))
    before.on_request(admitted("big", prompt=9_000, max_tokens=8), ("tp", 0), T)
    ((_, a),) = assignments(before.tick(T).effects)
    after = new_state()
    after.observe_heartbeat(beat("w0", 0, kv_total_tokens=4_000, kv_free_tokens=4_000,
                                 kv_total_bytes=4_000, kv_free_bytes=4_000))
    after.observe_assignment(a)
    after.restore()
    assert after.reserved_kv("w0") == a.kv_tokens  # a fact, booked: fail closed
    after.on_request(admitted("small", prompt=10, max_tokens=6), ("tp", 1), T)
    assert assignments(after.tick(T).effects) == []  # no room until the big one ends


def test_worker_loss_requeues_unstreamed_work_and_fails_streamed() -> None:
    state = ready_state(("w0", 0))
    state.on_request(admitted("quiet"), ("tp", 0), T)
    state.on_request(admitted("chatty"), ("tp", 1), T)
    placed = {a.request_id: a for _, a in assignments(state.tick(T).effects)}
    state.observe_event(started(placed["chatty"], "w0"))
    state.observe_event(EventFirstToken(request_id="chatty", tenant="acme", attempt=1,
                                        worker_id="w0", ts=T + 1, ttft_s=0.1))
    state.observe_heartbeat(beat("w1", 1, ts=T + 5))
    result = tick_and_release(state, T + 5)  # w0 last beat at T: dead after 3 s
    assert result.lost_workers == ["w0"] and result.requeued == 1
    ((partition, again),) = assignments(result.effects)
    assert (again.request_id, again.attempt, again.worker_id, partition) == ("quiet", 2, "w1", 1)
    assert again.admitted == placed["quiet"].admitted  # verbatim, same place in line
    (error,) = replies(result.effects)
    assert (error.request_id, error.code, error.attempt) == ("chatty", "worker_lost", 1)
    (event,) = events(result.effects)
    assert isinstance(event, EventFailed)
    # Signed by the scheduler: the ending is its, not the worker's (``_note_ending``).
    assert (event.code, event.worker_id, event.attempt) == ("worker_lost", SCHED, 1)
    assert event.usage is None  # it ran: what it generated is unknown (charged in full)
    assert state.reserved_kv("w0") == 0
    assert state.tick(T + 5.1).lost_workers == []  # declared once
    # Its reply then found on the reply topic (the worker answered before it died): only
    # the event goes, and the ending leaves the scheduler's count of terminals it sent.
    assert state.ended == {"worker_lost": 1}
    state.answered_after_all("worker_lost")
    state.answered_after_all("worker_lost")  # never below none
    assert state.ended == {"worker_lost": 0}


def test_a_stalled_heartbeat_reader_gives_no_work_away() -> None:
    # The reader handled every heartbeat up to T + 0.5 and then stalled (the scheduler's
    # process paused, or cut from the broker while the workers were not): w0 kept
    # beating, its lease renewed by the broker's acks. Declared lost at T + 5, its running
    # request got worker_lost from the scheduler and Done from w0 (the code before).
    state = ready_state(("w0", 0))
    state.observe_heartbeat(beat("w0", 0, ts=T, seq=2), read_at=T, source=3)
    state.on_request(admitted("r1"), ("tp", 0), T)
    ((_, a),) = assignments(state.tick(T).effects)
    state.observe_assignment(a)
    state.observe_event(started(a, "w0"))
    stalled = state.tick(T + 5, heard={3: T + 0.5})
    assert stalled.lost_workers == [] and stalled.held == ()
    assert replies(stalled.effects) == [] and events(stalled.effects) == []
    # The reader catches up: w0's newer beat, the same process. Nothing to undo.
    state.observe_heartbeat(beat("w0", 0, ts=T + 4.5, seq=5), read_at=T + 5.05, source=3)
    assert state.tick(T + 5.1, heard={3: T + 5.1}).lost_workers == []
    assert state.log.status("r1") == "active"
    # Silent for real, and seen to be by a reader that is current: lost.
    assert tick_and_release(state, T + 9, heard={3: T + 9}).lost_workers == ["w0"]


def test_only_the_replica_that_handles_losses_acts_on_one() -> None:
    # Two replicas read the same assignments and events; w0 dies holding one request that
    # streamed and one that did not. One requeue and one worker_lost in all, not two.
    leader, other = ready_state(("w0", 0)), ready_state(("w0", 0))
    leader.on_request(admitted("quiet"), ("tp", 0), T)
    leader.on_request(admitted("chatty"), ("tp", 1), T)
    placed = [a for _, a in assignments(leader.tick(T).effects)]
    for state in (leader, other):
        for a in placed:
            state.observe_assignment(a)
        chatty = next(a for a in placed if a.request_id == "chatty")
        state.observe_event(started(chatty, "w0"))
        state.observe_event(EventFirstToken(request_id="chatty", tenant="acme", attempt=1,
                                            worker_id="w0", ts=T + 1, ttft_s=0.1))
        state.observe_heartbeat(beat("w1", 1, ts=T + 5))
    acted = tick_and_release(leader, T + 5)
    idle = other.tick(T + 5, handle_losses=False)
    assert acted.lost_workers == ["w0"] and acted.requeued == 1
    assert (idle.lost_workers, idle.requeued, idle.effects) == ([], 0, [])
    # The other replica learns the outcome from the leader's output: its bookings on w0
    # go, and the requeued attempt is booked where it went.
    for _, a in assignments(acted.effects):
        other.observe_assignment(a)
    for event in events(acted.effects):
        other.observe_event(event)
    assert other.reserved_kv("w0") == 0 and other.reserved_kv("w1") > 0


def _first_token(a: Assignment, worker: str) -> EventFirstToken:
    return EventFirstToken(request_id=a.request_id, tenant="acme", attempt=a.attempt,
                           worker_id=worker, ts=T + 1, ttft_s=0.1)


def test_assignments_are_stamped_with_the_worker_process_they_were_placed_on() -> None:
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), ("tp", 0), T)
    ((_, a),) = assignments(state.tick(T).effects)
    assert a.worker_started_at == T - 100  # the heartbeat's started_at


def _quiet_and_chatty_on_a_restarted_w0() -> tuple[SchedulerState, dict[str, Assignment]]:
    """"quiet" and "chatty" placed on w0, "chatty" streaming; then w0's new process beats."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("quiet"), ("tp", 0), T)
    state.on_request(admitted("chatty"), ("tp", 1), T)
    placed = {a.request_id: a for _, a in assignments(state.tick(T).effects)}
    state.observe_event(started(placed["chatty"], "w0"))
    state.observe_event(_first_token(placed["chatty"], "w0"))
    state.observe_heartbeat(beat("w0", 0, ts=T + 1, started_at=T + 0.5, seq=0))
    return state, placed


def test_a_restarted_worker_loses_only_its_earlier_processs_work() -> None:
    """w0 restarts between two beats (no stale gap): the new process drops the assignments
    stamped for the old one, so the scheduler must end them itself at once — requeue the
    quiet one (placed again, on the new process), worker_lost for the one that streamed —
    and leave what it placed on the new process alone."""
    state, _ = _quiet_and_chatty_on_a_restarted_w0()
    state.on_request(admitted("fresh"), ("tp", 2), T + 1)
    result = tick_and_release(state, T + 1)
    assert result.lost_workers == [] and result.restarted_workers == ["w0"]
    assert result.requeued == 1
    again = {a.request_id: a for _, a in assignments(result.effects)}
    assert (again["quiet"].attempt, again["quiet"].worker_started_at) == (2, T + 0.5)
    assert again["fresh"].worker_started_at == T + 0.5
    (error,) = replies(result.effects)
    assert (error.request_id, error.code, error.attempt) == ("chatty", "worker_lost", 1)
    assert "restarted" in error.message
    # Only the two new attempts hold KV now; the next beat of the same process changes
    # nothing.
    assert state.reserved_kv("w0") == again["quiet"].kv_tokens + again["fresh"].kv_tokens
    state.observe_heartbeat(beat("w0", 0, ts=T + 2, started_at=T + 0.5, seq=1))
    later = state.tick(T + 2)
    assert (later.restarted_workers, later.requeued, later.effects) == ([], 0, [])


def test_a_restarted_scheduler_ends_work_stamped_for_a_replaced_process() -> None:
    """After a scheduler restart the compacted heartbeats hold only the new process's beat;
    the log still holds an assignment stamped for the old one. Whatever order the two are
    read in, the first cycle requeues it."""
    before = ready_state(("w0", 0))
    before.on_request(admitted("r1"), ("tp", 0), T)
    ((_, a),) = assignments(before.tick(T).effects)
    for heartbeat_first in (True, False):
        after = new_state()
        new_beat = beat("w0", 0, ts=T + 3, started_at=T + 2, seq=0)
        if heartbeat_first:
            after.observe_heartbeat(new_beat)
            after.observe_assignment(a)
        else:
            after.observe_assignment(a)
            after.observe_heartbeat(new_beat)
        after.restore()
        after.on_request(admitted("r1"), ("tp", 0), T)  # redelivered: acked, skipped
        result = tick_and_release(after, T + 3)
        assert result.restarted_workers == ["w0"] and result.requeued == 1
        ((_, again),) = assignments(result.effects)
        assert (again.request_id, again.attempt, again.worker_started_at) == ("r1", 2, T + 2)


def test_a_worker_lost_ending_is_marked_for_the_reply_topic_check() -> None:
    """A worker killed between its terminal reply and its terminal event leaves a reply the
    scheduler never heard of: each worker_lost ending carries what the app needs to look
    for it on the reply topic first (services.common.answered), and so does each requeue, held
    until the check is back (nothing of it is in the cycle's effects)."""
    state, placed = _quiet_and_chatty_on_a_restarted_w0()
    result = state.tick(T + 1)
    marked = [e.unless_answered for e in result.effects if e.unless_answered is not None]
    chatty, quiet = placed["chatty"], placed["quiet"]
    ((request_id, attempt, topic, key, assigned_at),) = marked
    assert (request_id, attempt, assigned_at) == ("chatty", 1, chatty.assigned_at)
    assert topic == chatty.admitted.reply_topic and key == b"chatty"
    ((held_id, held_attempt, held_topic, held_key, held_at),) = [h.check for h in result.held]
    assert (held_id, held_attempt, held_key, held_at) == ("quiet", 1, b"quiet",
                                                          quiet.assigned_at)
    assert held_topic == quiet.admitted.reply_topic
    assert assignments(result.effects) == [] and state.log.status("quiet") == "lost"


def test_an_unstamped_assignment_is_not_fenced() -> None:
    """Assignments written before the stamp existed (None) are left to the heartbeat rule
    and the worker's replay check, as before."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), ("tp", 0), T)
    ((_, a),) = assignments(state.tick(T).effects)
    other = new_state()
    other.observe_heartbeat(beat("w0", 0))
    other.observe_assignment(a.evolve(worker_started_at=None))
    other.restore()
    other.observe_heartbeat(beat("w0", 0, ts=T + 1, started_at=T + 0.5, seq=0))
    result = other.tick(T + 1)
    assert (result.restarted_workers, result.requeued) == ([], 0)
    assert other.log.status("r1") == "active"


def test_a_replica_that_does_not_handle_losses_acts_on_a_restart_once_it_does() -> None:
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), ("tp", 0), T)
    assignments(state.tick(T).effects)
    state.observe_heartbeat(beat("w0", 0, ts=T + 1, started_at=T + 0.5, seq=0))
    idle = state.tick(T + 1, handle_losses=False)
    assert (idle.restarted_workers, idle.requeued) == ([], 0)
    acted = state.tick(T + 1.5, handle_losses=True)  # it became the leader
    assert (acted.restarted_workers, acted.requeued) == (["w0"], 1)


def test_queue_deadline_ends_with_queue_timeout_from_the_scheduler() -> None:
    state = ready_state()
    state.on_request(admitted("late", timeout_s=2.0), ("tp", 0), T)
    assert state.tick(T + 1).effects == []
    result = state.tick(T + 2.5)
    (error,) = replies(result.effects)
    assert (error.code, error.attempt) == ("queue_timeout", 0)
    (event,) = events(result.effects)
    assert isinstance(event, EventFailed)
    assert (event.code, event.attempt, event.worker_id, event.tenant) == (
        "queue_timeout", 1, SCHED, "acme")
    # It never ran: ingest's settlement refunds its tenant the whole reservation.
    assert event.usage == Usage(prompt_tokens=0, completion_tokens=0)
    assert tickets(result.effects) == [("tp", 0)]
    assert result.rejected == {"queue_timeout": 1}
    assert state.on_request(admitted("late", timeout_s=2.0), ("tp", 0), T + 3) == [
        Effect(tickets=(("tp", 0),))]  # redelivered later: not answered twice


def cancel(rid: str, tenant: str = "acme", at: float = T) -> CancelRequest:
    return CancelRequest(request_id=rid, tenant=tenant, issued_by="test", issued_at=at)


def test_cancel_of_a_pending_request() -> None:
    state = ready_state()
    state.on_request(admitted("r1"), ("tp", 0), T)
    assert not state.on_cancel(cancel("r1", tenant="mallory"), T)  # tenant mismatch
    assert state.on_cancel(cancel("r1"), T)
    result = state.tick(T)
    (error,) = replies(result.effects)
    assert (error.code, error.attempt) == ("cancelled", 0)
    (event,) = events(result.effects)
    assert isinstance(event, EventAborted) and event.code == "cancelled"
    assert event.usage == Usage(prompt_tokens=0, completion_tokens=0)  # never ran


def test_a_cancel_before_the_request_arrives_is_remembered() -> None:
    state = ready_state(("w0", 0))
    assert not state.on_cancel(cancel("r1"), T)
    effects = state.on_request(admitted("r1"), ("tp", 0), T)
    assert [r.code for r in replies(effects)] == ["cancelled"] and tickets(effects) == [("tp", 0)]
    assert assignments(state.tick(T).effects) == []


def test_a_cancel_read_long_before_its_request_is_still_remembered() -> None:
    """Found by an audit: remembered 10 minutes, a cancel read 640 s before its request
    (a low-priority record waiting in Kafka behind paused topics, timeout an hour) was
    forgotten, and the request was placed and ran for nobody."""
    state = ready_state(("w0", 0))
    state.on_cancel(cancel("r1", at=T + 60), T + 60)
    now = T + 700
    state.observe_heartbeat(beat("w0", 0, ts=now))
    effects = state.on_request(admitted("r1", timeout_s=3600.0, priority="low"), ("tp", 0),
                               now)
    assert [r.code for r in replies(effects)] == ["cancelled"]
    assert assignments(state.tick(now).effects) == []


def test_a_cancel_of_an_earlier_request_under_the_same_id_does_not_end_a_reuse() -> None:
    """Found by a review of 1e5276b: a cancel is now remembered a day, longer than the log
    remembers a finished request (an hour past its deadline); a new request reusing the id
    two hours later was then answered cancelled at once."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), ("tp", 0), T)
    [(_, first)] = assignments(state.tick(T).effects)
    state.on_cancel(cancel("r1", at=T + 1), T + 1)  # while it runs: remembered
    state.observe_event(done(first, "w0", ts=T + 2), read_at=T + 2)
    later = T + 2 * 3600
    state.prune(later)  # the log forgot r1
    state.observe_heartbeat(beat("w0", 0, ts=later))
    effects = state.on_request(admitted("r1", at=later), ("tp", 1), later)
    assert replies(effects) == []
    assert [(a.request_id, a.attempt) for _, a in assignments(state.tick(later).effects)] == [
        ("r1", 1)]


def test_a_cancelled_running_request_is_not_requeued_when_its_worker_dies() -> None:
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), ("tp", 0), T)
    state.tick(T)
    assert not state.on_cancel(cancel("r1"), T)  # running: the worker's to abort
    state.observe_heartbeat(beat("w1", 1, ts=T + 5))
    result = tick_and_release(state, T + 5)
    assert assignments(result.effects) == []
    (error,) = replies(result.effects)
    assert (error.code, error.attempt) == ("cancelled", 2)


def test_a_draining_worker_gets_no_new_work() -> None:
    state = ready_state()
    state.observe_heartbeat(beat("w0", 0, draining=True))
    state.on_request(admitted("r1"), ("tp", 0), T)
    assert assignments(state.tick(T).effects) == []
    state.observe_heartbeat(beat("w1", 1))
    assert [a.worker_id for _, a in assignments(state.tick(T).effects)] == ["w1"]


def test_unknown_model_is_rejected_by_the_core() -> None:
    state = ready_state(("w0", 0))
    state.on_request(admitted("odd", model="nobody-serves-this"), ("tp", 0), T)
    result = state.tick(T)
    assert [e.code for e in replies(result.effects)] == ["unknown_model"]


def test_the_requeue_of_a_restarting_models_only_worker_waits_for_it() -> None:
    """Found by an audit: m2's only worker b went stale while m1's w0 was live, and the
    requeue of b's lost work was refused unknown_model at once: now it waits for a worker
    heard from lately (5 minutes), then is refused as before."""
    state = new_state(takeover_s=0.0)
    state.observe_heartbeat(beat("w0", 0))
    state.observe_heartbeat(beat("b", 1, model="m2"))
    state.restore()
    state.on_request(admitted("r", model="m2"), ("tp", 0), T)
    [(_, first)] = assignments(state.tick(T).effects)
    assert first.worker_id == "b"
    now = T + 4  # b stale (3 intervals), w0 beating
    state.observe_heartbeat(beat("w0", 0, ts=now))
    effects = tick_and_release(state, now).effects
    assert replies(effects) == [] and assignments(effects) == []  # requeued, waiting
    assert state.pending and "r" in state.pending
    state.observe_heartbeat(beat("b", 1, model="m2", ts=now + 1, started_at=now))  # back
    state.observe_heartbeat(beat("w0", 0, ts=now + 1))
    [(_, again)] = assignments(tick_and_release(state, now + 1).effects)
    assert (again.worker_id, again.attempt) == ("b", 2)


def test_queue_status_per_model() -> None:
    state = ready_state(("w0", 0), ("w1", 1))
    state.observe_heartbeat(beat("w2", 2, draining=True))
    for i in range(3):
        state.on_request(admitted(f"r{i}", prompt=6_000, max_tokens=8), ("tp", i), T)
    placed = [a for _, a in assignments(state.tick(T).effects)]
    assert len(placed) == 2  # 6,016 tokens: one per worker, the third waits
    state.observe_event(done(placed[0], placed[0].worker_id))
    (status,) = state.statuses(T + 3)
    assert (status.model, status.scheduler_id) == (MODEL, SCHED)
    assert (status.pending_requests, status.pending_tokens) == (1, 6_008)
    assert status.running_tokens == 6_016
    assert (status.live_workers, status.max_usable_kv_tokens) == (2, 9_500)
    # The third request has waited since T: one request of 6,008 reserved tokens (prompt +
    # max_tokens, the queue's unit; it generated fewer) finished in 3 backlogged seconds.
    assert status.drain_tokens_per_s == pytest.approx(6_008 / 3.0)


def test_revoked_partitions_take_their_pending_requests_but_not_requeues() -> None:
    state = ready_state()
    state.on_request(admitted("a"), ("tp-a", 0), T)
    state.on_request(admitted("b"), ("tp-b", 0), T)
    assert state.drop_sources({"tp-a"}, T) == 1
    assert "a" not in state.pending and "b" in state.pending
    assert len(state.pending) == state.tracked() == 1


def test_a_cancel_not_yet_answered_leaves_with_its_revoked_partition_unanswered() -> None:
    # Cancelled while pending; its partition is revoked before the next cycle answers it.
    state = ready_state()  # no worker: the request stays pending
    state.on_request(admitted("r1"), ("tp", 0), T)
    assert state.on_cancel(cancel("r1"), T)
    assert state.drop_sources({"tp"}, T) == 1
    # The record goes back to the partition's new owner: no answer from here (one owner,
    # one terminal), and the next cycle has nothing left to trip over.
    result = state.tick(T + 1)
    assert replies(result.effects) == [] and events(result.effects) == []
    assert state.tracked() == 0 and len(state.pending) == 0
    # If the partition comes back here, the redelivered record is answered cancelled.
    state.observe_heartbeat(beat("w0", 0))
    effects = state.on_request(admitted("r1"), ("tp", 0), T + 2)
    assert [r.code for r in replies(effects)] == ["cancelled"]
    assert tickets(effects) == [("tp", 0)]
    assert assignments(state.tick(T + 2).effects) == []


def test_a_cancel_not_yet_answered_of_a_request_placed_elsewhere_is_the_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Another replica placed r1 (it read the record first); here it was just cancelled.
    here, there = ready_state(("w0", 0)), ready_state(("w0", 0))
    here.on_request(admitted("r1"), ("tp", 0), T)
    there.on_request(admitted("r1"), ("tp", 0), T)
    [(_, placed)] = assignments(there.tick(T).effects)
    assert here.on_cancel(cancel("r1"), T)
    effects = here.observe_assignment(placed)
    assert tickets(effects) == [("tp", 0)]  # its record is done here
    # The worker answers the cancel (it remembers cancels); nothing more from here, and
    # the cycle does not trip over the request it no longer tracks.
    with caplog.at_level(logging.ERROR):
        result = here.tick(T + 1)
    assert replies(result.effects) == [] and events(result.effects) == []
    assert here.tracked() == 0
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def _quiet_started_and_other_on_a_dead_w0() -> tuple[SchedulerState, dict[str, Assignment],
                                                     TickResult]:
    """"quiet" (started, no token) and "other" placed on w0, which then dies; no live
    worker, so the requeues would wait in the queue."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("quiet"), ("tp", 0), T)
    state.on_request(admitted("other"), ("tp", 1), T)
    placed = {a.request_id: a for _, a in assignments(state.tick(T).effects)}
    state.observe_event(started(placed["quiet"], "w0"))
    result = state.tick(T + 5)
    assert result.lost_workers == ["w0"] and result.requeued == 2 and len(result.held) == 2
    return state, placed, result


def test_a_requeue_whose_attempt_was_answered_is_not_requeued() -> None:
    """Its worker answered it (no token: a cancel or timeout during prefill, an empty
    completion) and died before the terminal event: the reply is on the reply topic, so
    only the terminal event goes out, and the request is not run again."""
    state, _, result = _quiet_started_and_other_on_a_dead_w0()
    state.observe_heartbeat(beat("w1", 1, ts=T + 6))
    held = {h.record.request_id: h for h in result.held}
    answered = state.release(held["quiet"], True, T + 6)
    assert replies(answered) == [] and assignments(answered) == []
    (event,) = events(answered)
    assert isinstance(event, EventFailed) and (event.request_id, event.attempt) == ("quiet", 1)
    assert state.log.status("quiet") == "finished"
    assert state.release(held["other"], False, T + 6) == []  # requeued: placed next cycle
    again = [a for _, a in assignments(state.tick(T + 6).effects)]
    assert [(a.request_id, a.attempt) for a in again] == [("other", 2)]


def test_requeues_and_worker_lost_endings_are_counted_when_done_not_when_decided() -> None:
    """Found by an audit of the metrics: a held requeue found answered counted as a
    worker_lost terminal (only its event goes: the worker's own terminal is the one), and
    requeues were counted when held, so one found answered counted too."""
    state, _, result = _quiet_started_and_other_on_a_dead_w0()
    held = {h.record.request_id: h for h in result.held}
    assert state.requeued == 0  # held, not requeued yet
    state.release(held["quiet"], True, T + 6)
    state.release(held["other"], False, T + 6)
    assert state.ended.get("worker_lost", 0) == 0 and state.requeued == 1


def test_a_loss_given_back_and_decided_again_is_one_loss() -> None:
    """Leadership lapsed during the reply-topic check: the loss is given back and decided
    again when this replica leads again. It was counted (and logged dead) twice."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("q"), ("tp", 0), T)
    placed = {a.request_id: a for _, a in assignments(state.tick(T).effects)}
    state.observe_event(started(placed["q"], "w0"))
    first = state.tick(T + 5)
    assert first.lost_workers == ["w0"]
    state.tick(T + 5.5, handle_losses=False)  # a rebalance: another replica leads
    for h in first.held:
        assert state.release(h, False, T + 5.6) == []  # given back to the leader
    again = state.tick(T + 6)  # this replica leads again: the same loss, decided again
    assert again.lost_workers == [] and len(again.held) == 1
    for h in again.held:
        state.release(h, False, T + 6.1)
    assert state.requeued == 1


def test_a_requeue_given_back_before_it_was_placed_is_counted_once() -> None:
    """Found by a review: pushed (counted), given back at a lapse of leadership before it
    was placed, and decided again: counted twice."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("q"), ("tp", 0), T)
    placed = {a.request_id: a for _, a in assignments(state.tick(T).effects)}
    state.observe_event(started(placed["q"], "w0"))
    first = state.tick(T + 5)
    for h in first.held:
        state.release(h, False, T + 5.1)  # requeued: no live worker to place it on
    assert state.requeued == 1
    state.tick(T + 5.5, handle_losses=False)  # leadership lapses: the requeue given back
    assert state.requeued == 0
    again = state.tick(T + 6)
    for h in again.held:
        state.release(h, False, T + 6.1)
    assert state.requeued == 1


def test_an_ending_taken_back_is_not_counted_again_by_the_next_one() -> None:
    """SchedulerMetrics.ended() took a lower total (an ending withdrawn at a rebalance,
    never sent) as its new base, and counted the next ending of that code twice."""
    from services.common import metrics as m
    from services.scheduler.runtime.metrics import SchedulerMetrics

    def exported() -> float:
        return m.REGISTRY.get_sample_value("llmq_requests_total",
                                           {"outcome": "queue_timeout"}) or 0.0

    before, metrics = exported(), SchedulerMetrics()
    state = new_state()
    state.restore()
    state.on_request(admitted("a", timeout_s=1.0), ("tp", 0), T)
    (ending,) = [e for e in state.tick(T + 2).effects if e.decision is not None]
    metrics.ended(state.ended)  # exported before the rebalance took it back
    assert state.withdraw(ending, T + 2) and state.ended["queue_timeout"] == 0
    metrics.ended(state.ended)
    state.on_request(admitted("b", timeout_s=1.0), ("tp", 1), T + 2)
    state.tick(T + 4)  # b ends queue_timeout, sent
    metrics.ended(state.ended)
    assert exported() - before == 1  # one ending counted for the one sent and the other


def test_a_requeue_is_dropped_when_the_terminal_event_comes_during_the_check() -> None:
    state, placed, result = _quiet_started_and_other_on_a_dead_w0()
    state.observe_event(done(placed["quiet"], "w0"))  # its event, read while checking
    held = {h.record.request_id: h for h in result.held}
    assert state.release(held["quiet"], False, T + 6) == []
    state.release(held["other"], False, T + 6)
    state.observe_heartbeat(beat("w1", 1, ts=T + 6))
    again = [a for _, a in assignments(state.tick(T + 6).effects)]
    assert [(a.request_id, a.attempt) for a in again] == [("other", 2)]


def test_a_requeue_is_withdrawn_when_the_lost_attempts_terminal_event_comes_after_all() -> None:
    """The worker answered, but its event was read after the requeue was released (the
    check ran before its reply landed): placing the requeue would be a second terminal."""
    state, placed, result = _quiet_started_and_other_on_a_dead_w0()
    for held in result.held:
        state.release(held, False, T + 5)  # no live worker: both wait in the queue
    state.observe_event(done(placed["quiet"], "w0"))  # late: it did finish
    assert state.requeues_withdrawn == 1
    state.observe_heartbeat(beat("w1", 1, ts=T + 6))
    again = [a for _, a in assignments(state.tick(T + 6).effects)]
    assert [(a.request_id, a.attempt) for a in again] == [("other", 2)]
    assert sum(state.depth().values()) == 0


# -- lease renewals (services.worker.core.lease) ----------------------------------------
def lease_answers(effects: list[Effect]) -> list[LeaseAnswer]:
    out = [decode(o.value, CONTROL_ADAPTER) for e in effects for o in e.first
           if o.topic == "p.control"]
    return [a for a in out if isinstance(a, LeaseAnswer)]


def _w0_running_r1() -> tuple[SchedulerState, Assignment]:
    state = ready_state(("w0", 0), control_topic="p.control")
    state.on_request(admitted("r1"), ("tp", 0), T)
    ((_, a),) = assignments(state.tick(T).effects)
    state.observe_event(started(a, "w0"))
    return state, a


def test_a_lease_is_renewed_when_the_worker_was_not_declared_lost() -> None:
    """w0 was silent 2.9 s (its lease lapsed, under the scheduler's 3 s): the renewing beat
    comes before any cycle found it stale, so the work is still its own."""
    state, _ = _w0_running_r1()
    state.observe_heartbeat(beat("w0", 0, ts=T + 2.9, seq=9, renew=True))
    result = state.tick(T + 2.95)
    (answer,) = lease_answers(result.effects)
    assert (answer.worker_id, answer.started_at, answer.seq, answer.granted) == (
        "w0", T - 100, 9, True)
    assert answer.issued_by == SCHED and result.leases == (("w0", True),)
    assert result.lost_workers == [] and state.log.status("r1") == "active"
    # Answered once: the next cycle says nothing more, and w0 stays alive.
    later = state.tick(T + 5)
    assert lease_answers(later.effects) == [] and later.lost_workers == []


def test_a_lease_is_refused_once_the_workers_work_was_declared_lost() -> None:
    state, _ = _w0_running_r1()
    lost = tick_and_release(state, T + 3.5)  # stale: r1 streamed nothing, so it is requeued
    assert lost.lost_workers == ["w0"] and lost.requeued == 1
    state.observe_heartbeat(beat("w0", 0, ts=T + 3.6, seq=9, renew=True))
    result = state.tick(T + 3.6)
    (answer,) = lease_answers(result.effects)
    assert (answer.seq, answer.granted) == (9, False)
    assert "stale" in answer.reason and result.leases == (("w0", False),)


def test_a_lease_is_refused_when_a_newer_process_of_the_worker_is_known() -> None:
    state, _ = _w0_running_r1()
    state.observe_heartbeat(beat("w0", 0, ts=T + 2, started_at=T + 1, seq=0))  # restarted
    state.observe_heartbeat(beat("w0", 0, ts=T + 2.5, seq=7, renew=True))  # the old one asks
    (answer,) = lease_answers(state.tick(T + 2.5).effects)
    assert (answer.started_at, answer.granted) == (T - 100, False)
    assert "newer process" in answer.reason


def test_only_the_replica_that_handles_losses_answers_a_lease() -> None:
    state, _ = _w0_running_r1()
    state.observe_heartbeat(beat("w0", 0, ts=T + 2.9, seq=9, renew=True))
    follower = state.tick(T + 2.95, handle_losses=False)
    assert lease_answers(follower.effects) == [] and follower.leases == ()
    # The worker asks on every beat while it waits; the leader answers the next one.
    state.observe_heartbeat(beat("w0", 0, ts=T + 3.0, seq=10, renew=True))
    (answer,) = lease_answers(state.tick(T + 3.0).effects)
    assert (answer.seq, answer.granted) == (10, True)


def test_a_replica_that_read_a_requeue_refuses_the_lease_once_it_leads() -> None:
    """The leader declared w0 dead and requeued r1 onto w1; then leadership moved. The new
    leader never decided that loss itself, but it read the requeue (attempt 2) from the
    log: w0's incarnation may not renew either."""
    leader = ready_state(("w0", 0), ("w1", 1), control_topic="p.control")
    leader.on_request(admitted("r1"), ("tp", 0), T)
    ((_, first),) = assignments(leader.tick(T).effects)
    other, other_partition = ("w1", 1) if first.worker_id == "w0" else ("w0", 0)
    leader.observe_heartbeat(beat(other, other_partition, ts=T + 3.5, seq=4))  # only it beats
    lost = tick_and_release(leader, T + 3.6)
    ((_, second),) = assignments(lost.effects)
    assert second.attempt == 2 and second.worker_id != first.worker_id
    follower = new_state(control_topic="p.control")
    for worker_id, partition in (("w0", 0), ("w1", 1)):
        follower.observe_heartbeat(beat(worker_id, partition))
    follower.observe_assignment(first)
    follower.restore()
    follower.observe_assignment(second)
    follower.observe_heartbeat(beat(first.worker_id, first.partition, ts=T + 3.7, seq=9,
                                    renew=True))
    (answer,) = lease_answers(follower.tick(T + 3.7).effects)
    assert (answer.worker_id, answer.granted) == (first.worker_id, False)


def _follower_of(first: Assignment, *events_read: LifecycleEvent) -> SchedulerState:
    """A replica that did not lead: it read ``first`` and ``events_read`` from the log."""
    follower = new_state(control_topic="p.control")
    follower.observe_heartbeat(beat(first.worker_id, first.partition))
    follower.observe_assignment(first)
    follower.restore()
    for event in events_read:
        follower.observe_event(event)
    return follower


def _streaming(a: Assignment) -> list[LifecycleEvent]:
    return [started(a, a.worker_id),
            EventFirstToken(request_id=a.request_id, tenant="acme", attempt=a.attempt,
                            worker_id=a.worker_id, ts=T + 1, ttft_s=0.1)]


def test_a_replica_that_read_a_worker_lost_ending_refuses_the_lease_once_it_leads() -> None:
    """The leader declared w0 dead and ended its streamed r1 ``worker_lost`` (nothing is
    requeued, so the log has no second assignment); then leadership moved. The ending's
    event is signed by the leader, not by w0: the new leader refuses w0's incarnation."""
    leader, first = _w0_running_r1()
    leader.observe_event(_streaming(first)[1])
    lost = tick_and_release(leader, T + 3.5)
    assert lost.lost_workers == ["w0"] and lost.requeued == 0
    (ending,) = events(lost.effects)
    assert isinstance(ending, EventFailed) and ending.code == "worker_lost"
    follower = _follower_of(first, *_streaming(first), ending)
    follower.observe_heartbeat(beat("w0", 0, ts=T + 3.6, seq=9, renew=True))
    (answer,) = lease_answers(follower.tick(T + 3.6).effects)
    assert (answer.worker_id, answer.granted) == ("w0", False)
    assert "declared lost" in answer.reason


def test_a_replica_that_read_a_cancelled_requeue_refuses_the_lease_once_it_leads() -> None:
    """r1 was cancelled while running on w0, and w0 died before aborting it: the leader
    ends the would-be requeue (attempt 2, never assigned) ``cancelled``. A replica that
    read only attempt 1's assignment and that ending still knows w0's work was taken."""
    leader, first = _w0_running_r1()
    assert not leader.on_cancel(cancel("r1"), T)
    lost = tick_and_release(leader, T + 3.5)
    assert assignments(lost.effects) == []
    (ending,) = events(lost.effects)
    assert isinstance(ending, EventAborted) and ending.attempt == 2
    follower = _follower_of(first, started(first, "w0"), ending)
    follower.observe_heartbeat(beat("w0", 0, ts=T + 3.6, seq=9, renew=True))
    (answer,) = lease_answers(follower.tick(T + 3.6).effects)
    assert (answer.worker_id, answer.granted) == ("w0", False)


def test_a_workers_own_ending_does_not_cost_it_the_lease() -> None:
    """w0 itself ended r1 ``worker_lost`` (its engine failed) and later asks to renew after
    a pause: its work was never declared lost, so the lease holds."""
    _, first = _w0_running_r1()
    own = EventFailed(request_id="r1", tenant="acme", attempt=1, worker_id="w0", ts=T + 2,
                      code="worker_lost", message="engine died")
    follower = _follower_of(first, *_streaming(first), own)
    assert follower.log.status("r1") == "finished"
    follower.observe_heartbeat(beat("w0", 0, ts=T + 2.9, seq=9, renew=True))
    (answer,) = lease_answers(follower.tick(T + 2.95).effects)
    assert (answer.worker_id, answer.granted) == ("w0", True)


def test_a_worker_whose_clock_runs_behind_is_not_declared_dead_early() -> None:
    """w0's clock is 1 s behind ours. Its beat read at T + 2.5 says T + 1.5; at T + 4.6 that
    ts is 3.1 s old, but we read it 2.1 s ago: its lease (2.75 s, on its own clock) may
    still hold, so its work must stay. Dead once we have not heard from it for the bound."""
    state, _ = _w0_running_r1()
    state.observe_heartbeat(beat("w0", 0, ts=T + 1.5, seq=5), read_at=T + 2.5)
    assert state.tick(T + 4.6).lost_workers == []
    assert state.log.status("r1") == "active"
    assert tick_and_release(state, T + 5.6).lost_workers == ["w0"]


def test_a_request_admitted_by_a_clock_ahead_of_the_schedulers_is_placed_at_its_class() -> None:
    # Ingest stamps admitted_at with its own clock; 5 ms ahead, a low request "waited"
    # −5 ms and aged into class 3, which no assignment can carry: it was dropped.
    state = ready_state(("w0", 0))
    state.on_request(admitted("r-low", priority="low", at=T + 0.005), ("tp", 0), T)
    result = state.tick(T)
    [(_, record)] = assignments(result.effects)
    assert record.engine_priority == 2 and tickets(result.effects) == [("tp", 0)]


def assignment_fails_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the next assignment record raises once (a bug translating a placement)."""
    import services.scheduler.runtime.state as module

    real = module.assignment
    calls = {"n": 0}

    def fails_once(*args: Any, **kwargs: Any) -> Assignment:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("a bug building the record")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "assignment", fails_once)


def test_a_placement_that_cannot_be_sent_goes_back_to_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assignment_fails_once(monkeypatch)
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), ("tp", 0), T)
    first = state.tick(T)
    assert assignments(first.effects) == [] and tickets(first.effects) == []
    assert len(state.pending) == 1 and state.tracked() == 1 and state.reserved_kv("w0") == 0
    second = state.tick(T + 0.1)
    [(_, record)] = assignments(second.effects)
    assert record.request_id == "r1" and tickets(second.effects) == [("tp", 0)]
    assert state.reserved_kv("w0") == record.kv_tokens


def _requeue_waiting_on(leader: SchedulerState, follower: SchedulerState,
                        timeout_s: float = 600.0) -> Assignment:
    """q placed on w0 (both replicas read it); w0 dies with nothing else alive, so the
    leader's requeue of q at attempt 2 waits in its queue. Returns attempt 1's record."""
    leader.on_request(admitted("q", timeout_s=timeout_s), ("tp", 0), T)
    [(_, first)] = assignments(leader.tick(T).effects)
    follower.observe_assignment(first)
    tick_and_release(leader, T + 5)
    assert leader.pending.get("q") is not None and leader.pending.get("q").attempt == 2
    return first


def test_a_replica_that_stops_leading_leaves_its_unplaced_requeues_to_the_new_leader() -> None:
    # Both replicas used to requeue q: the old leader kept its requeue ("requeues stay")
    # and the new one, whose log still showed attempt 1 on dead w0, made its own. When
    # capacity came both placed q#2, on two workers.
    a, b = ready_state(("w0", 0)), ready_state(("w0", 0))
    _requeue_waiting_on(a, b)
    a.tick(T + 6, handle_losses=False)  # a rebalance: b leads now
    assert a.pending.get("q") is None and a.log.status("q") == "active"
    tick_and_release(b, T + 6)
    for replica in (a, b):
        replica.observe_heartbeat(beat("w1", 1, ts=T + 7))
        replica.observe_heartbeat(beat("w2", 2, ts=T + 7))
    from_a = assignments(a.tick(T + 7, handle_losses=False).effects)
    from_b = assignments(b.tick(T + 7).effects)
    assert from_a == [] and [(r.request_id, r.attempt) for _, r in from_b] == [("q", 2)]
    [(_, second)] = from_b
    a.observe_assignment(second)
    assert a.reserved_by_worker() == b.reserved_by_worker() == {
        "w0": 0, "w1": second.kv_tokens, "w2": 0}


def test_a_requeue_check_that_returns_after_leadership_moved_requeues_nothing() -> None:
    a = ready_state(("w0", 0))
    a.on_request(admitted("q"), ("tp", 0), T)
    a.tick(T)
    [held] = a.tick(T + 5).held  # the reply-topic check is out...
    a.tick(T + 5.5, handle_losses=False)  # ...when another replica takes over
    assert a.release(held, False, T + 6) == [] and a.pending.get("q") is None
    assert a.log.status("q") == "active" and a.reserved_kv("w0") > 0  # the leader's to decide


def test_a_follower_that_reads_the_requeues_events_first_frees_the_lost_attempt() -> None:
    # Events are keyed by request, assignments by worker slot: a follower may read attempt
    # 2's terminal event before attempt 2's assignment. Attempt 1 stayed booked on w0.
    a, b = ready_state(("w0", 0), ("w1", 1)), ready_state(("w0", 0), ("w1", 1))
    a.observe_heartbeat(beat("w1", 1, kv_free_tokens=0, kv_total_tokens=10_000))
    a.on_request(admitted("q"), ("tp", 0), T)
    [(_, first)] = assignments(a.tick(T).effects)
    assert first.worker_id == "w0"
    b.observe_assignment(first)
    for replica in (a, b):
        replica.observe_heartbeat(beat("w1", 1, ts=T + 5))
    [(_, second)] = assignments(tick_and_release(a, T + 5).effects)
    assert (second.attempt, second.worker_id) == (2, "w1")
    b.observe_event(started(second, "w1"))
    b.observe_event(done(second, "w1"))
    b.observe_assignment(second)
    assert b.reserved_by_worker() == {"w0": 0, "w1": 0} and len(b.ledger) == 0


def test_a_follower_frees_the_lost_attempt_when_its_requeue_ends_in_the_queue() -> None:
    a, b = ready_state(("w0", 0)), ready_state(("w0", 0))
    _requeue_waiting_on(a, b, timeout_s=10.0)
    ended = events(a.tick(T + 11).effects)  # the deadline passes in the queue
    assert [(e.request_id, e.attempt) for e in ended] == [("q", 2)]
    for event in ended:
        b.observe_event(event)
    assert b.reserved_kv("w0") == 0 and len(b.ledger) == 0


def test_a_cancel_of_a_given_up_requeue_is_remembered() -> None:
    # As when a partition is revoked (drop_sources): the cancel was read here only, and
    # the request goes on elsewhere; remembered, this replica ends it cancelled should it
    # requeue it again.
    a, b = ready_state(("w0", 0)), ready_state(("w0", 0))
    _requeue_waiting_on(a, b)
    assert a.on_cancel(cancel("q", at=T + 5.5), T + 5.5)
    a.tick(T + 6, handle_losses=False)
    assert a.pending.get("q") is None and a.cancels.matches("q", "acme", T + 6)


def test_a_new_request_reusing_a_finished_ones_id_is_answered_invalid_once() -> None:
    # Ingest admits it once the first one's reservation is settled; acked unanswered as a
    # redelivery, its client waited for ever and its tenant's slot stayed taken.
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), ("tp", 0), T)
    [(_, first)] = assignments(state.tick(T).effects)
    state.observe_event(done(first, "w0"))
    assert state.on_request(admitted("r1"), ("tp", 0), T + 3) == [
        Effect(tickets=(("tp", 0),))]  # a redelivery of the first: nothing more
    reuse = state.on_request(admitted("r1", at=T + 60), ("tp", 1), T + 60)
    [error] = replies(reuse)
    assert (error.request_id, error.attempt, error.code) == ("r1", 0, "invalid")
    assert [(e.kind, e.code) for e in events(reuse)] == [("event.failed", "invalid")]
    assert tickets(reuse) == [("tp", 1)]
    again = state.on_request(admitted("r1", at=T + 60), ("tp", 1), T + 61)  # redelivered
    assert replies(again) == [] and tickets(again) == [("tp", 1)]


def _chatty_lost_on_w0() -> tuple[SchedulerState, list[Effect]]:
    """w0 dies holding one request that streamed: the leader's cycle decides its
    worker_lost ending, held for the reply-topic check (the app's background task): its
    attempt marked lost, nothing sent or counted yet."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("chatty"), ("tp", 1), T)
    (placed,) = [a for _, a in assignments(state.tick(T).effects)]
    state.observe_event(started(placed, "w0"))
    state.observe_event(_first_token(placed, "w0"))
    result = state.tick(T + 5)
    checked = [e for e in result.effects if e.unless_answered is not None]
    assert len(checked) == 1 and replies(checked) == [] and events(checked) == []
    assert state.log.status("chatty") == "lost" and state.ended == {}
    assert state.tick(T + 5.5).effects == []  # held: no cycle decides it again
    return state, checked


def test_a_worker_lost_ending_checked_while_leading_goes_out_as_decided() -> None:
    state, checked = _chatty_lost_on_w0()
    out = state.settle_endings(checked, frozenset(), T + 6)
    assert [r.code for r in replies(out)] == ["worker_lost"] and len(events(out)) == 1
    assert state.ended == {"worker_lost": 1} and state.log.status("chatty") == "finished"
    assert state.settle_endings(checked, frozenset(), T + 7) == []  # settled once
    state, checked = _chatty_lost_on_w0()
    answered = state.settle_endings(checked, frozenset({("chatty", 1)}), T + 6)
    assert replies(answered) == [] and len(events(answered)) == 1  # the event only
    assert state.ended == {"worker_lost": 0}


def test_a_worker_lost_ending_whose_worker_answered_meanwhile_is_not_sent() -> None:
    state, checked = _chatty_lost_on_w0()
    state.observe_event(EventDone(request_id="chatty", tenant="acme", attempt=1,
                                  worker_id="w0", ts=T + 5.2, finish_reason="stop",
                                  usage=Usage(prompt_tokens=1, completion_tokens=1)))
    assert state.settle_endings(checked, frozenset(), T + 6) == []
    assert state.ended == {}


def test_a_replica_that_stops_leading_during_the_check_gives_the_loss_back() -> None:
    """docs/live-system.md: a replica that stops leading gives up any reply-topic check
    still out, and the loss goes back to the log, active on its dead worker and booked,
    for whoever leads. Found by an audit: the log kept it ended here, so with one replica
    (whose leadership lapses at every rebalance) nobody ever answered it."""
    state, checked = _chatty_lost_on_w0()
    state.tick(T + 6, handle_losses=False)  # leadership moved while the check ran
    assert state.settle_endings(checked, frozenset(), T + 6.5) == []
    assert state.ended == {} and state.log.status("chatty") == "active"
    assert state.reserved_kv("w0") > 0  # every active assignment is booked
    # Leading again (the same replica, the only one): it decides the loss once more.
    again = [e for e in state.tick(T + 7).effects if e.unless_answered is not None]
    out = state.settle_endings(again, frozenset(), T + 8)
    assert [r.code for r in replies(out)] == ["worker_lost"]
    assert state.log.status("chatty") == "finished" and state.reserved_kv("w0") == 0
    # Another leader's ending, read back instead, would have ended it just the same.
    state, checked = _chatty_lost_on_w0()
    state.tick(T + 6, handle_losses=False)
    state.settle_endings(checked, frozenset(), T + 6.5)
    leader_event = EventFailed(request_id="chatty", tenant="acme", attempt=1,
                               worker_id="sched-other", ts=T + 7, code="worker_lost",
                               message="w0 lost mid-stream")
    state.observe_event(leader_event)
    assert state.log.status("chatty") == "finished" and state.reserved_kv("w0") == 0


def test_a_restart_loss_given_back_at_a_rebalance_is_decided_again() -> None:
    """Found by an audit: a requeue of a restart loss, given back because the replica
    stopped leading during its reply-topic check, left the attempt active on a worker whose
    heartbeats are fresh; the restart rule had fired once, so no cycle found it again, and
    the request was never answered (one replica is enough: its leadership lapses at each
    rebalance). The restart is put back among those to decide."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), ("tp", 0), T)
    [(_, first)] = assignments(state.tick(T).effects)
    state.observe_heartbeat(beat("w0", 0, ts=T + 0.5, started_at=T + 0.5, seq=0))  # restart
    decided = state.tick(T + 1)
    assert decided.restarted_workers == ["w0"] and len(decided.held) == 1
    state.tick(T + 1.1, handle_losses=False)  # a rebalance while the check runs
    assert state.release(decided.held[0], False, T + 1.2) == []
    assert state.log.status("r1") == "active"  # given back
    again = tick_and_release(state, T + 2)  # leading again: decided once more
    assert again.restarted_workers == ["w0"] and again.requeued == 1
    [(_, second)] = assignments(again.effects)
    assert (second.attempt, second.worker_started_at) == (first.attempt + 1, T + 0.5)


def test_a_terminal_event_stamped_far_ahead_counts_when_it_was_read() -> None:
    """Found by an audit: one event a day ahead (a worker's clock far off), first in the
    drain meter's window, kept every later sample in it, and the drain rate ingest
    divides the queue by grew without bound (34 → 10,274 tokens/s in five minutes)."""
    def rates(skew: float) -> list[float]:
        state = ready_state(("w0", 0))
        out = []
        for step in range(181):  # one request finished a second for three minutes
            now = T + step
            state.observe_heartbeat(beat("w0", 0, ts=now))
            state.on_request(admitted(f"r{step}", at=now), ("tp", step), now)
            [(_, a)] = assignments(state.tick(now).effects)
            state.observe_event(started(a, "w0", ts=now), read_at=now)
            ts = now + (skew if step == 0 else 0.5)
            state.observe_event(done(a, "w0", ts=ts), read_at=now + 0.5)
            if step % 60 == 0:
                [status] = state.statuses(now + 0.9)
                out.append(status.drain_tokens_per_s)
        return out

    assert rates(86_400.0) == rates(0.5)


def test_a_finished_request_is_forgotten_on_time_whatever_the_workers_clock() -> None:
    """Found by an audit: the log kept a finished entry until the worker's own time of its
    ending came: with a clock a week ahead, a week of traffic in memory."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1", timeout_s=60.0), ("tp", 0), T)
    [(_, a)] = assignments(state.tick(T).effects)
    week = 7 * 86_400.0
    state.observe_event(started(a, "w0", ts=T + 1 + week), read_at=T + 1)
    state.observe_event(done(a, "w0", ts=T + 2 + week), read_at=T + 2)
    assert state.log.status("r1") == "finished"
    state.prune(T + 2 * 3600)  # an hour past its deadline (finished_memory_s)
    assert len(state.log) == 0


def test_a_reuse_read_before_the_first_ones_ending_is_refused_once_it_is_read() -> None:
    """Found by an audit: ingest admits a reuse of an id once it read the first request's
    ending; this scheduler's log may read that ending later, and the reuse, found with the
    id still active, was acked unanswered: its client waited for ever. Now it is held,
    unacked, and refused invalid (attempt 0) once the log shows the first one ended."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("dup"), ("tp", 0), T)
    [(_, first)] = assignments(state.tick(T).effects)
    state.observe_event(started(first, "w0"))
    assert state.on_request(admitted("dup", at=T + 3), ("tp", 1), T + 3) == []  # held
    assert replies(state.tick(T + 3.5).effects) == []  # the first one has not ended here
    state.observe_event(done(first, "w0", ts=T + 2.5))
    result = state.tick(T + 4)
    [error] = replies(result.effects)
    assert (error.request_id, error.attempt, error.code) == ("dup", 0, "invalid")
    assert ("tp", 1) in tickets(result.effects)
    # Its partition revoked while held instead: it is the new owner's, dropped here.
    state = ready_state(("w0", 0))
    state.on_request(admitted("dup"), ("tp", 0), T)
    [(_, first)] = assignments(state.tick(T).effects)
    state.on_request(admitted("dup", at=T + 3), ("tp", 1), T + 3)
    state.drop_sources({"tp"}, T + 3.2)
    state.observe_event(done(first, "w0", ts=T + 2.5))
    assert replies(state.tick(T + 4).effects) == []


def test_a_held_worker_lost_ending_keeps_its_trace_through_a_prune() -> None:
    """A review of 9e29a3d: prune() (every status interval) drops the trace headers of
    requests not active, and a held ending's attempt is marked lost meanwhile."""
    trace = (("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    state = ready_state(("w0", 0))
    state.on_request(admitted("chatty"), ("tp", 1), T, trace)
    (placed,) = [a for _, a in assignments(state.tick(T).effects)]
    state.observe_event(started(placed, "w0"))
    state.observe_event(_first_token(placed, "w0"))
    checked = [e for e in state.tick(T + 5).effects if e.unless_answered is not None]
    state.prune(T + 5.2)  # while the check runs
    out = state.settle_endings(checked, frozenset(), T + 6)
    headers = [dict(o.headers or ()) for e in out for o in (*e.first, *e.then)]
    assert len(headers) == 2 and all("traceparent" in h for h in headers)


def test_prune_forgets_workers_long_gone_but_not_one_whose_work_the_log_holds() -> None:
    state = ready_state(("w0", 0), ("w1", 1))
    state.on_request(admitted("r1"), ("tp", 0), T)
    ((_, a),) = assignments(state.tick(T).effects)
    state.observe_assignment(a)
    busy = a.worker_id
    idle = "w1" if busy == "w0" else "w0"
    assert state.prune(T + 100.0) == []
    assert state.prune(T + 400.0) == [idle]  # silent 5 min, holding nothing
    assert set(state.fleet.workers()) == {busy}
    assert idle not in state.reserved_by_worker()  # its KV gauge series goes too


def test_a_lost_process_is_refused_its_lease_after_a_newer_one_came_and_was_forgotten(
) -> None:
    # A review of the pruning: a lost incarnation dropped once a newer process beat, and
    # the newer one forgotten 5 min after it left, the thawed lost process was granted.
    state, _ = _w0_running_r1()  # process A (started_at T - 100) runs r1
    assert tick_and_release(state, T + 3.5).lost_workers == ["w0"]
    state.observe_heartbeat(beat("w0", 0, ts=T + 10, started_at=T + 9, seq=0))  # process B
    state.prune(T + 11)
    state.prune(T + 10 + 301)  # B left, silent 5 min: forgotten
    assert "w0" not in state.fleet
    state.observe_heartbeat(beat("w0", 0, ts=T + 400, seq=9, renew=True))  # A asks
    (answer,) = lease_answers(state.tick(T + 400).effects)
    assert not answer.granted


def test_an_admitted_request_that_does_not_decode_is_answered_once() -> None:
    """Found by an audit of the commits: dead-lettered and acked unanswered (a newer wire
    schema during a rolling upgrade), its client and its tenant's reservation waited out
    its timeout. It is ended overloaded (retryable) where it names who waits."""
    import json

    state = new_state(replies_prefix="p.replies.")
    state.restore()
    newer = json.loads(encode(admitted("r1")))
    newer["schema_version"] = 99
    raw = json.dumps(newer).encode()
    with pytest.raises(SchemaError):
        decode(raw, REQUEST_ADAPTER)
    effects = state.on_unreadable(raw, ("tp", 3), T)
    [reply] = replies(effects)
    assert (reply.request_id, reply.attempt, reply.code) == ("r1", 0, "overloaded")
    [event] = events(effects)
    assert isinstance(event, EventFailed)
    assert (event.tenant, event.attempt, event.code) == ("acme", 1, "overloaded")
    assert event.usage is not None and event.usage.total_tokens == 0  # all given back
    assert tickets(effects) == [("tp", 3)] and state.ended["overloaded"] == 1
    state.observe_event(event)  # read back: a redelivery is only acked
    assert state.on_unreadable(raw, ("tp", 3), T + 1) == [Effect(tickets=(("tp", 3),))]
    elsewhere = {**newer, "reply_topic": "other.replies.acme"}
    for broken in (b"{not json", json.dumps(elsewhere).encode(), b'{"request": {}}',
                   encode(admitted("r9"))):  # the last decodes: its handling failed else
        assert state.on_unreadable(broken, ("tp", 4), T) == [Effect(tickets=(("tp", 4),))]


def _unreadable(rid: str) -> bytes:
    import json

    newer = json.loads(encode(admitted(rid)))
    newer["schema_version"] = 99
    return json.dumps(newer).encode()


def test_an_unreadable_copy_of_a_request_known_here_is_only_acked() -> None:
    """Found by a review of the first version, which checked the log's status alone: two
    broken copies read before the first ending came back, a readable copy pending (an old
    ingest's beside a new one's), a placement by another replica seen by its event, and a
    record past the log's memory were each answered overloaded: a second terminal, or one
    for a request that then ran."""
    only_acked = [Effect(tickets=(("tp", 5),))]
    state = new_state(replies_prefix="p.replies.")
    state.restore()
    assert replies(state.on_unreadable(_unreadable("a"), ("tp", 4), T)) != []
    assert state.on_unreadable(_unreadable("a"), ("tp", 5), T) == only_acked  # not read back
    pending = ready_state(replies_prefix="p.replies.")  # no worker: it waits in the queue
    pending.on_request(admitted("b"), ("tp", 0), T)
    assert pending.on_unreadable(_unreadable("b"), ("tp", 5), T) == only_acked
    elsewhere = new_state(replies_prefix="p.replies.")
    elsewhere.restore()
    elsewhere.observe_event(EventStarted(request_id="c", tenant="acme", attempt=1,
                                         worker_id="w9", ts=T))
    assert elsewhere.on_unreadable(_unreadable("c"), ("tp", 5), T + 1) == only_acked
    late = T + 60 + state.log.memory_s + 10
    assert state.on_unreadable(_unreadable("d"), ("tp", 5), late) == only_acked
    huge = _unreadable("e").replace(b'"timeout_s": 60.0', b'"timeout_s": 1' + b"0" * 400)
    assert huge != _unreadable("e")
    assert state.on_unreadable(huge, ("tp", 5), T) == only_acked  # found by a review: raised


def test_a_bug_in_the_salvage_is_logged_not_taken_for_a_record_naming_nobody(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by a review: a catch-all took a bug (a renamed field) for bytes that name
    nobody, silently."""
    import services.scheduler.runtime.messages as messages

    def renamed(**_: Any) -> None:
        raise AttributeError("no such field")

    monkeypatch.setattr(messages, "EventFailed", renamed)
    state = new_state(replies_prefix="p.replies.")
    state.restore()
    with caplog.at_level(logging.ERROR):
        assert state.on_unreadable(_unreadable("a"), ("tp", 4), T) == [
            Effect(tickets=(("tp", 4),))]
    assert "salvaging an undecodable record failed" in caplog.text


def test_an_unreadable_ending_not_sent_before_a_rebalance_is_taken_back() -> None:
    """Found by a review: withdrawn from the outbox at a revoke, it stayed in the log, so
    the redelivered record, back on this replica, was only acked: no terminal at all."""
    state = new_state(replies_prefix="p.replies.")
    state.restore()
    [ending] = state.on_unreadable(_unreadable("a"), ("tp", 4), T)
    assert state.withdraw(ending, T) and state.ended["overloaded"] == 0
    assert replies(state.on_unreadable(_unreadable("a"), ("tp", 4), T + 1)) != []
