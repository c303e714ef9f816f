"""SchedulerState: one placement per attempt, one terminal per request, across replicas,
leaders and restarts.

Replicas read ``llmq.assignments`` and ``llmq.events`` in no particular order between the
two topics: a queued copy of a request leaves the queue whichever record of its placement
elsewhere comes first; a hand-off or requeue that the previous leader placed is not placed
again; a cancel or a failed publish does not bring back what the queue no longer holds;
a reused request id gets one ``invalid``, a redelivery none, after a restart too. No Kafka.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from schemas.codec import decode
from schemas.messages import EVENT_ADAPTER
from schemas.requests import Assignment
from schemas.workers import EventFirstToken, LifecycleEvent
from services.scheduler.runtime.messages import (
    ADMITTED_AT_HEADER,
    DEADLINE_HEADER,
    admission_of,
)
from services.scheduler.runtime.results import Effect
from services.scheduler.runtime.state import SchedulerState
from tests.unit.test_scheduler_runtime_disaggregation import (
    pd_beat,
    pd_state,
    place_prefill,
    prefilled,
)
from tests.unit.test_scheduler_runtime_state import (
    T,
    admitted,
    assignment_fails_once,
    assignments,
    beat,
    cancel,
    done,
    events,
    lease_answers,
    new_state,
    ready_state,
    replies,
    started,
    tick_and_release,
    tickets,
)

FULL: dict[str, Any] = {"kv_free_tokens": 0, "running": 64}


def read_events(effects: list[Effect]) -> list[tuple[LifecycleEvent, tuple[Any, ...]]]:
    """The terminal events ``effects`` produce, each with the headers its record carries
    (as the app hands them to ``observe_event``)."""
    return [(decode(o.value, EVENT_ADAPTER), o.headers) for e in effects for o in e.then]


def first_token(a: Assignment) -> EventFirstToken:
    return EventFirstToken(request_id=a.request_id, tenant="acme", attempt=a.attempt,
                           worker_id=a.worker_id, ts=T + 1, ttft_s=0.1)


# -- a queued copy of a request placed by another replica ----------------------------------

def _owner_and_waiting_copy(pd: bool) -> tuple[SchedulerState, SchedulerState, Assignment]:
    """Replica ``a`` placed r1 (attempt 1); replica ``b`` holds a copy of its record (a
    redelivery after a rebalance) in its queue, waiting for room."""
    if pd:
        a, b = pd_state(), pd_state()
        b.observe_heartbeat(pd_beat("p0", 0, "prefill", T, seq=3, **FULL))
        b.observe_heartbeat(pd_beat("d0", 1, "decode", T, seq=3, **FULL))
    else:
        a, b = ready_state(("w0", 0)), ready_state(("w0", 0))
        b.observe_heartbeat(beat("w0", 0, seq=3, **FULL))
    a.on_request(admitted("r1"), ("tp", 0), T)
    ((_, placed),) = assignments(a.tick(T).effects)
    assert b.on_request(admitted("r1"), ("tp", 0), T) == []
    assert assignments(b.tick(T).effects) == [] and b.tracked() == 1
    return a, b, placed


def _room(state: SchedulerState, pd: bool, ts: float) -> None:
    if pd:
        state.observe_heartbeat(pd_beat("p0", 0, "prefill", ts, seq=9))
        state.observe_heartbeat(pd_beat("d0", 1, "decode", ts, seq=9))
    else:
        state.observe_heartbeat(beat("w0", 0, ts=ts, seq=9))


COPY_CASES: list[tuple[str, bool, tuple[str, ...], dict[str, int]]] = [
    # name, P/D fleet, records of a's attempt read by b (in order), b's bookings after
    ("assignment", False, ("assignment",), {"w0": 1_024}),
    ("started, then the assignment", False, ("started", "assignment"), {"w0": 1_024}),
    ("started only", False, ("started",), {"w0": 0}),
    ("first token only", False, ("first_token",), {"w0": 0}),
    ("done, then the assignment", False, ("started", "done", "assignment"), {"w0": 0}),
    ("done only", False, ("done",), {"w0": 0}),
    ("prefilled, then the assignment", True, ("started", "prefilled", "assignment"),
     {"p0": 1_008, "d0": 0}),  # the prompt's KV waits on p0 for the decode stage
    ("prefilled only", True, ("prefilled",), {"p0": 0, "d0": 0}),
]


@pytest.mark.parametrize(("name", "pd", "read", "booked"), COPY_CASES,
                         ids=[c[0] for c in COPY_CASES])
def test_a_queued_copy_leaves_the_queue_whichever_record_of_its_placement_comes_first(
    name: str, pd: bool, read: tuple[str, ...], booked: dict[str, int]
) -> None:
    # b used to place attempt 1 a second time when the attempt's events came before its
    # assignment (the assignment, read then, did not become active: it returned early).
    _, b, placed = _owner_and_waiting_copy(pd)
    records: dict[str, Any] = {
        "assignment": placed, "started": started(placed, placed.worker_id),
        "first_token": first_token(placed), "done": done(placed, placed.worker_id),
        "prefilled": prefilled(placed)}
    acked = []
    for what in read:
        record = records[what]
        if isinstance(record, Assignment):
            acked += tickets(b.observe_assignment(record))
        else:
            b.observe_event(record)
    assert b.tracked() == 0 and len(b.pending) == 0, name
    _room(b, pd, T + 1)
    result = b.tick(T + 1, handle_losses=False)
    assert assignments(result.effects) == [] and replies(result.effects) == []
    assert acked + tickets(result.effects) == [("tp", 0)]  # its record is done here, once
    assert {w: b.reserved_kv(w) for w in booked} == booked


def test_a_record_whose_attempt_the_log_shows_started_is_acked_at_once() -> None:
    # The events of another replica's placement were read before the record came here.
    a, b = ready_state(("w0", 0)), ready_state(("w0", 0))
    a.on_request(admitted("r1"), ("tp", 0), T)
    ((_, placed),) = assignments(a.tick(T).effects)
    b.observe_event(started(placed, "w0"))
    assert b.on_request(admitted("r1"), ("tp", 0), T) == [Effect(tickets=(("tp", 0),))]
    assert assignments(b.tick(T + 1).effects) == [] and b.tracked() == 0


def test_a_queued_copy_withdrawn_with_a_cancel_waiting_leaves_the_cancel_to_the_worker() -> None:
    _, b, placed = _owner_and_waiting_copy(pd=False)
    assert b.on_cancel(cancel("r1"), T)  # queued here: the next cycle would answer it
    b.observe_event(started(placed, "w0"))
    result = b.tick(T + 1, handle_losses=False)
    assert replies(result.effects) == [] and events(result.effects) == []
    assert tickets(result.effects) == [("tp", 0)]
    assert b.cancels.matches("r1", "acme", T + 1)  # should w0 die before it aborts it


# -- a hand-off or requeue the previous leader placed --------------------------------------

@pytest.mark.parametrize("ended", [False, True], ids=["started", "done"])
def test_a_new_leader_does_not_place_a_decode_stage_whose_events_it_read(ended: bool) -> None:
    # old placed r1#2 (the decode stage); new had adopted the hand-off (d0 looked full to
    # it) and reads the stage's events before its assignment. It used to place r1#2 again
    # (of a finished request, when done was read) and keep that booking on d0 for good.
    old, new = pd_state(), pd_state()
    a = place_prefill(old)
    new.observe_assignment(a)
    for state in (old, new):
        state.observe_event(started(a, "p0"))
        state.observe_event(prefilled(a))
    ((_, stage),) = assignments(old.tick(T + 1).effects)
    new.observe_heartbeat(pd_beat("d0", 1, "decode", T + 1, seq=5, **FULL))
    assert assignments(new.tick(T + 1).effects) == [] and new.tracked() == 1
    new.observe_event(started(stage, "d0"))
    if ended:
        new.observe_event(done(stage, "d0"))
    assert new.tracked() == 0 and len(new.pending) == 0
    new.observe_heartbeat(pd_beat("d0", 1, "decode", T + 3, seq=9))
    assert assignments(new.tick(T + 3).effects) == []
    new.observe_assignment(stage)  # old's record, read at last
    assert new.reserved_by_worker() == {"p0": 0, "d0": 0 if ended else stage.kv_tokens}
    assert len(new.ledger) == (0 if ended else 1)


def test_a_new_leader_does_not_adopt_a_hand_off_whose_decode_stage_started() -> None:
    old, new = pd_state(), pd_state()
    a = place_prefill(old)
    new.observe_assignment(a)
    for state in (old, new):
        state.observe_event(prefilled(a))
    ((_, stage),) = assignments(old.tick(T + 1).effects)
    new.observe_event(started(stage, "d0"))  # before its assignment
    assert assignments(new.tick(T + 2).effects) == [] and new.tracked() == 0
    assert new.reserved_kv("p0") == 0  # the decode stage pulled the prompt's KV


@pytest.mark.parametrize("ended", [False, True], ids=["started", "done"])
def test_a_new_leader_does_not_requeue_an_attempt_whose_next_one_it_read(ended: bool) -> None:
    # a requeued q (w0 died) and placed q#2 on w1; b, leading now, read q#2's events but
    # not its assignment, and still saw q#1 on dead w0: it requeued and placed q#2 again.
    a, b = ready_state(("w0", 0)), ready_state(("w0", 0))
    a.on_request(admitted("q"), ("tp", 0), T)
    ((_, first),) = assignments(a.tick(T).effects)
    b.observe_assignment(first)
    for state in (a, b):
        state.observe_heartbeat(beat("w1", 1, ts=T + 5))
        state.observe_heartbeat(beat("w2", 2, ts=T + 5))
    ((_, second),) = assignments(tick_and_release(a, T + 5).effects)
    b.observe_event(started(second, second.worker_id))
    if ended:
        b.observe_event(done(second, second.worker_id))
    for worker, partition in (("w1", 1), ("w2", 2)):
        b.observe_heartbeat(beat(worker, partition, ts=T + 6, seq=20))
    result = tick_and_release(b, T + 6)
    assert assignments(result.effects) == [] and replies(result.effects) == []
    assert len(b.pending) == b.tracked() == 0
    b.observe_assignment(second)
    assert b.reserved_by_worker() == {
        "w0": 0, "w1": 0 if ended else second.kv_tokens, "w2": 0}


def test_a_requeue_check_answered_after_leadership_moved_keeps_no_booking_on_the_dead_worker(
) -> None:
    # The check of q#1 comes back after b led and placed q#2 (read here): re-booking q#1
    # on dead w0 ("the leader's to decide") stayed there for good.
    a = ready_state(("w0", 0))
    a.on_request(admitted("q"), ("tp", 0), T)
    ((_, first),) = assignments(a.tick(T).effects)
    a.observe_heartbeat(beat("w1", 1, ts=T + 5))
    (held,) = a.tick(T + 5).held
    a.tick(T + 5.5, handle_losses=False)  # b leads now
    second = first.evolve(attempt=2, worker_id="w1", partition=1, assigned_at=T + 6)
    a.observe_assignment(second)
    assert a.release(held, False, T + 7) == []
    assert a.reserved_by_worker() == {"w0": 0, "w1": second.kv_tokens}


# -- a new leader's takeover ------------------------------------------------------------------

def _lost_on_w0(streamed: bool) -> tuple[SchedulerState, SchedulerState, Assignment]:
    """Leader ``a`` placed q on w0, which then died; ``b`` (``takeover_s`` 15 s) read the
    placement (and q's first token, when ``streamed``), and nothing of a's loss yet."""
    a = ready_state(("w0", 0))
    b = ready_state(("w0", 0), takeover_s=15.0)
    a.on_request(admitted("q"), ("tp", 0), T)
    ((_, first),) = assignments(a.tick(T).effects)
    b.observe_assignment(first)
    if streamed:
        for state in (a, b):
            state.observe_event(first_token(first))
    for state in (a, b):
        state.observe_heartbeat(beat("w1", 1, ts=T + 5))
    return a, b, first


def test_a_new_leader_does_not_requeue_a_loss_the_last_leader_requeued_before_it_read_that(
) -> None:
    # b began to lead before reading a's requeue of q (q#2 on w1): deciding from its log at
    # once, it found q#1 on dead w0 still, requeued it and placed q a second time (found
    # by the scheduler audit; a constructed run sent two queue_timeout replies).
    a, b, _ = _lost_on_w0(streamed=False)
    ((_, second),) = assignments(tick_and_release(a, T + 5).effects)
    a.tick(T + 6, handle_losses=False)  # a rebalance: b leads now
    b.observe_heartbeat(beat("w1", 1, ts=T + 6))
    effects = tick_and_release(b, T + 6).effects  # q#2 not read yet
    b.observe_assignment(second)  # read within the takeover
    for at in (T + 10, T + 21, T + 22):
        b.observe_heartbeat(beat("w1", 1, ts=at))
        effects += tick_and_release(b, at).effects
    assert assignments(effects) == [] and replies(effects) == []
    assert len(b.pending) == b.tracked() == 0
    assert b.reserved_by_worker() == {"w0": 0, "w1": second.kv_tokens}


def test_a_new_leader_does_not_end_again_a_streamed_loss_the_last_leader_ended() -> None:
    # The same with q streamed: a ended it worker_lost; b, deciding at once, sent a second.
    a, b, _ = _lost_on_w0(streamed=True)
    ending = tick_and_release(a, T + 5).effects
    assert [r.code for r in replies(ending)] == ["worker_lost"]
    a.tick(T + 6, handle_losses=False)
    b.observe_heartbeat(beat("w1", 1, ts=T + 6))
    effects = tick_and_release(b, T + 6).effects
    for event, headers in read_events(ending):
        b.observe_event(event, headers)
    for at in (T + 10, T + 21, T + 22):
        b.observe_heartbeat(beat("w1", 1, ts=at))
        effects += tick_and_release(b, at).effects
    assert replies(effects) == [] and read_events(effects) == []
    assert b.reserved_by_worker() == {"w0": 0, "w1": 0}


@pytest.mark.parametrize("streamed", [False, True], ids=["requeued", "ended worker_lost"])
def test_a_new_leader_decides_a_loss_nobody_decided_once_it_has_led_takeover_s(
        streamed: bool) -> None:
    _, b, first = _lost_on_w0(streamed)  # a stopped before deciding anything
    decided = {}
    for offset in (6.0, 10.0, 20.5, 21.0, 22.0):  # leading from T + 6
        b.observe_heartbeat(beat("w1", 1, ts=T + offset))
        effects = tick_and_release(b, T + offset).effects
        decided[offset] = ([(r.code, r.attempt) for r in replies(effects)]
                           + [(a.worker_id, a.attempt) for _, a in assignments(effects)])
    loss = [("worker_lost", first.attempt)] if streamed else [("w1", first.attempt + 1)]
    assert decided == {6.0: [], 10.0: [], 20.5: [], 21.0: loss, 22.0: []}


def test_a_new_leader_refuses_leases_until_it_has_led_takeover_s() -> None:
    # a declared w0 dead and requeued r1 on w1; b led before reading that, and granted w0's
    # renewal (w0 not among its lost incarnations): attempt 1 ran on under a valid lease
    # beside attempt 2 (found by a review).
    a = ready_state(("w0", 0), control_topic="p.control")
    b = ready_state(("w0", 0), control_topic="p.control", takeover_s=15.0)
    a.on_request(admitted("r1"), ("tp", 0), T)
    ((_, first),) = assignments(a.tick(T).effects)
    b.observe_assignment(first)
    for state in (a, b):
        state.observe_heartbeat(beat("w1", 1, ts=T + 3.5))
    assert len(assignments(tick_and_release(a, T + 3.6).effects)) == 1  # r1#2 on w1
    a.tick(T + 3.7, handle_losses=False)  # a rebalance: b leads, a's requeue not read yet
    b.tick(T + 3.8)
    b.observe_heartbeat(beat("w0", 0, ts=T + 4.0, seq=9, renew=True))
    (answer,) = lease_answers(b.tick(T + 4.0).effects)
    assert not answer.granted and "takeover_s (15 s)" in answer.reason
    # Past the takeover a renewal is answered as before: granted to a worker never lost.
    b.observe_heartbeat(beat("w1", 1, ts=T + 19.0, seq=30, renew=True))
    (answer,) = lease_answers(b.tick(T + 19.0).effects)
    assert (answer.worker_id, answer.granted) == ("w1", True)


@pytest.mark.parametrize("continued", [True, False], ids=["led through", "another led"])
def test_a_leader_whose_leadership_continued_through_rebalances_takes_over_once(
        continued: bool) -> None:
    # Found by a review: leadership lapses at every rebalance, one replica's too, and each
    # lapse restarted the takeover: rebalances every 10 s held a dead worker's work (and
    # hand-offs, lease renewals) for good.
    _, b, first = _lost_on_w0(streamed=False)
    decided = []
    for offset in range(6, 40):  # b leads from T + 6; a rebalance every 10 s
        at = T + offset
        b.observe_heartbeat(beat("w1", 1, ts=at))
        if offset % 10 == 0:
            b.tick(at, handle_losses=False)
            if continued:
                b.leadership_continued()  # it held faust's leader partition throughout
        effects = tick_and_release(b, at).effects
        decided += [(offset, a.worker_id, a.attempt) for _, a in assignments(effects)]
    # Another leader between: each lapse is a new leader's, which waits takeover_s again.
    assert decided == ([(21, "w1", first.attempt + 1)] if continued else [])


# -- a cancelled hand-off whose prefill worker goes ---------------------------------------

@pytest.mark.parametrize("mixed_free", [True, False], ids=["mixed worker free", "all full"])
def test_a_cancelled_hand_off_whose_prefill_worker_goes_ends_once(
    mixed_free: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Starting over used to push the whole request back while its cancel waited: placed
    # too (then a KeyError), or left in the queue untracked until its deadline.
    state = pd_state()
    state.observe_heartbeat(beat("m0", 2, **FULL))
    a = place_prefill(state)
    state.observe_event(started(a, "p0"))
    state.observe_event(prefilled(a))
    state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 1, seq=5, **FULL))
    state.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 1, seq=5))
    assert assignments(state.tick(T + 1).effects) == [] and state.tracked() == 1
    assert state.on_cancel(cancel("r1", at=T + 2), T + 2)
    state.observe_heartbeat(beat("m0", 2, ts=T + 6, seq=9, **({} if mixed_free else FULL)))
    state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 6, seq=9, **FULL))
    endings = []
    with caplog.at_level(logging.ERROR):
        for now in (T + 6, T + 30, T + 61):  # p0 stale from T + 6; deadline T + 60
            result = state.tick(now)
            assert assignments(result.effects) == []
            endings += [(r.code, r.attempt) for r in replies(result.effects)]
    assert endings == [("cancelled", 2)]
    assert len(state.pending) == state.tracked() == sum(state.depth().values()) == 0
    assert caplog.records == []


# -- a placement that cannot be sent --------------------------------------------------------

@pytest.mark.parametrize("fleet", ["prefill and decode", "mixed only"])
def test_a_prefill_stage_that_cannot_be_sent_puts_the_request_back_whole(
    fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The staged prefill (1,008 tokens, max_tokens 1) went back instead: a mixed worker
    # then ran the prefill stage as if it were the request.
    assignment_fails_once(monkeypatch)
    state = pd_state()
    state.on_request(admitted("r1"), ("tp", 0), T)
    first = state.tick(T)
    assert assignments(first.effects) == [] and state.reserved_kv("p0") == 0
    queued = state.pending.get("r1")
    assert queued is not None
    assert (queued.phase, queued.kv_tokens, queued.decode_kv_tokens) == ("whole", 1_024, None)
    expected = ("p0", "prefill", 1_008)
    if fleet == "mixed only":
        state.observe_heartbeat(pd_beat("p0", 0, "prefill", T + 1, draining=True))
        state.observe_heartbeat(pd_beat("d0", 1, "decode", T + 1, draining=True))
        state.observe_heartbeat(beat("m0", 2, ts=T + 1))
        expected = ("m0", "whole", 1_024)
    second = state.tick(T + 1)
    ((_, record),) = assignments(second.effects)
    assert (record.worker_id, record.phase, record.kv_tokens) == expected
    assert state.reserved_kv(record.worker_id) == record.kv_tokens
    assert tickets(second.effects) == [("tp", 0)]


# -- a reused request id --------------------------------------------------------------------

def test_a_schedulers_terminal_event_names_the_admission_it_ended() -> None:
    state = ready_state()
    state.on_request(admitted("r1", timeout_s=2.0, at=T - 0.25), ("tp", 0), T)
    ((event, headers),) = read_events(state.tick(T + 3).effects)
    assert event.code == "queue_timeout"
    assert admission_of(headers) == (T - 0.25, T + 1.75)
    assert admission_of([(ADMITTED_AT_HEADER, b"junk"), (DEADLINE_HEADER, b"nan")]) == (
        None, None)
    assert admission_of([]) == (None, None)
    # A header with no value (Kafka allows it): raised AttributeError and the guard
    # dead-lettered a valid event (found by an audit).
    assert admission_of([(ADMITTED_AT_HEADER, None)]) == (None, None)  # type: ignore[list-item]


def _ended_unplaced_by_another_replica() -> tuple[SchedulerState, SchedulerState]:
    """r1 timed out in a's queue (never placed); b read only its event."""
    a, b = ready_state(), ready_state()
    a.on_request(admitted("r1", timeout_s=2.0), ("tp", 0), T)
    for event, headers in read_events(a.tick(T + 3).effects):
        b.observe_event(event, headers)
    return a, b


@pytest.mark.parametrize("replica", ["the one that ended it", "another one"])
def test_a_reuse_of_an_id_ended_unplaced_is_refused_once_by_any_replica(replica: str) -> None:
    # The other replica had no admitted_at for r1 (no assignment): it acked the reuse
    # unanswered, and the reuse's client waited for ever.
    a, b = _ended_unplaced_by_another_replica()
    state = a if replica == "the one that ended it" else b
    assert state.on_request(admitted("r1"), ("tp", 0), T + 4) == [
        Effect(tickets=(("tp", 0),))]  # a redelivery of the first: nothing more
    reuse = state.on_request(admitted("r1", at=T + 60), ("tp", 5), T + 60)
    assert [(r.code, r.attempt) for r in replies(reuse)] == [("invalid", 0)]
    assert tickets(reuse) == [("tp", 5)]
    again = state.on_request(admitted("r1", at=T + 60), ("tp", 5), T + 61)
    assert again == [Effect(tickets=(("tp", 5),))]


@pytest.mark.parametrize("order", ["assignment first", "refusal first"])
def test_a_refused_reuse_redelivered_after_a_restart_is_not_answered_again(order: str) -> None:
    # The memory of answered reuses was the process's only: a restarted scheduler answered
    # the redelivered reuse a second time.
    before = ready_state(("w0", 0))
    before.on_request(admitted("r1"), ("tp", 0), T)
    ((_, first),) = assignments(before.tick(T).effects)
    before.observe_event(done(first, "w0"))
    refusal = read_events(before.on_request(admitted("r1", at=T + 60), ("tp", 1), T + 60))
    after = new_state()
    after.observe_heartbeat(beat("w0", 0, ts=T + 61))
    if order == "refusal first":
        for event, headers in refusal:
            after.observe_event(event, headers)
    after.observe_assignment(first)
    after.observe_event(done(first, "w0"))
    if order == "assignment first":
        for event, headers in refusal:
            after.observe_event(event, headers)
    after.restore()
    for admitted_at, ticket in ((T + 60, ("tp", 1)), (T, ("tp", 0))):  # reuse, first
        assert after.on_request(admitted("r1", at=admitted_at), ticket, T + 62) == [
            Effect(tickets=(ticket,))]
    assert after.on_request(admitted("r1", at=T + 90), ("tp", 2), T + 90)[0].first  # a third


# -- what the log forgot ----------------------------------------------------------------------

def test_a_record_unknown_to_the_log_and_long_past_its_deadline_is_acked_unanswered() -> None:
    # Its log entry was pruned (memory_s past its deadline) after it finished; the
    # redelivered record was queued again and answered queue_timeout: a second terminal.
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1", timeout_s=60.0), ("tp", 0), T)
    ((_, a),) = assignments(state.tick(T).effects)
    state.observe_event(done(a, "w0"))
    later = T + 60 + 3_600 + 5
    state.observe_heartbeat(beat("w0", 0, ts=later))
    state.prune(later)
    assert state.log.status("r1") == "unknown"
    assert state.on_request(admitted("r1", timeout_s=60.0), ("tp", 0), later) == [
        Effect(tickets=(("tp", 0),))]
    result = state.tick(later)
    assert replies(result.effects) == [] and assignments(result.effects) == []
    # One the log can still know of (deadline + memory_s ahead) is queued and answered.
    state.on_request(admitted("r2", timeout_s=60.0, at=later - 3_000), ("tp", 1), later)
    assert [r.code for r in replies(state.tick(later).effects)] == ["queue_timeout"]


def test_a_request_cancelled_in_the_queue_is_remembered_until_its_deadline() -> None:
    # Another replica read only the cancel's event: its entry lasted memory_s from the
    # event, not from the request's (24 h) deadline, so a redelivered record an hour later
    # was queued as new and ran: a second terminal.
    a, b = ready_state(), ready_state(("w0", 0))
    a.on_request(admitted("r1", timeout_s=86_400.0), ("tp", 0), T)
    assert a.on_cancel(cancel("r1"), T + 1)
    for event, headers in read_events(a.tick(T + 1).effects):
        b.observe_event(event, headers)
    later = T + 2 * 3_600
    b.observe_heartbeat(beat("w0", 0, ts=later))
    b.prune(later)
    assert b.log.status("r1") == "finished"
    assert b.on_request(admitted("r1", timeout_s=86_400.0), ("tp", 0), later) == [
        Effect(tickets=(("tp", 0),))]
    assert assignments(b.tick(later).effects) == []


def test_a_redelivered_reuse_placed_after_the_first_was_forgotten_is_not_refused() -> None:
    # A scheduler whose log had forgotten r1 placed a reuse of its id as attempt 1; a
    # restarted one (which replays both) refused the reuse's redelivered record as
    # invalid while it ran: a second terminal.
    a = ready_state(("w0", 0))
    a.on_request(admitted("r1"), ("tp", 0), T)
    ((_, first),) = assignments(a.tick(T).effects)
    a.observe_event(done(first, "w0"))
    t2 = T + 2 * 3_600
    a.observe_heartbeat(beat("w0", 0, ts=t2))
    a.prune(t2)
    a.on_request(admitted("r1", at=t2), ("tp", 9), t2)
    ((_, second),) = assignments(a.tick(t2).effects)
    after = new_state()
    after.observe_heartbeat(beat("w0", 0, ts=t2 + 2))
    for record in (first, second):
        after.observe_assignment(record)
    after.observe_event(done(first, "w0"))
    after.restore()
    assert after.on_request(admitted("r1", at=t2), ("tp", 9), t2 + 3) == [
        Effect(tickets=(("tp", 9),))]
