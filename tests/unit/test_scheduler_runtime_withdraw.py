"""SchedulerState.withdraw: a decision whose records were never produced is taken back.

The app withdraws such effects from its outbox when their source partition is revoked:
the partition's new owner decides the request. Should the partition come back here, the
redelivered record must be decided afresh, not acked as done. No Kafka.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from schemas.requests import AdmittedRequest, Assignment
from services.scheduler.runtime.results import Effect
from services.scheduler.runtime.state import SchedulerState
from tests.unit.test_scheduler_runtime_disaggregation import pd_state, place_prefill, prefilled
from tests.unit.test_scheduler_runtime_state import (
    T,
    admitted,
    assignments,
    beat,
    cancel,
    done,
    ready_state,
    replies,
    started,
    tick_and_release,
)

TICKET = ("tp", 0)


def placed(state: SchedulerState, now: float = T) -> tuple[Effect, Assignment]:
    (effect,) = [e for e in state.tick(now).effects if e.first]
    ((_, a),) = assignments([effect])
    return effect, a


def test_a_withdrawn_placement_is_forgotten_and_placed_again_when_redelivered() -> None:
    """... at the next attempt (found by a review): the placement taken back, handed to the
    producer but not acknowledged, may still land, and two runs under one attempt number
    would interleave their chunks for the client (which keeps the newest attempt)."""
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), TICKET, T)
    effect, first = placed(state)
    assert state.drop_sources({"tp"}, T) == 0  # placed: no longer pending
    assert state.withdraw(effect, T)
    assert (state.reserved_kv("w0"), state.log.status("r1"), state.log.workers()) == (
        0, "unknown", [])
    assert (state.tracked(), len(state.pending)) == (0, 0)  # not queued again here
    assert not state.withdraw(effect, T)  # once
    # The partition comes back: its record is decided afresh, not acked as done.
    assert state.on_request(admitted("r1"), TICKET, T + 1) == []
    effect, again = placed(state, T + 1)
    assert (again.attempt, again.worker_id, effect.tickets) == (2, "w0", (TICKET,))
    assert state.reserved_kv("w0") == again.kv_tokens
    state.observe_assignment(again)
    state.observe_assignment(first)  # the one taken back lands after all: superseded
    assert state.log.status("r1") == "active"
    state.observe_event(done(again, "w0"))
    assert (state.log.status("r1"), state.reserved_kv("w0")) == ("finished", 0)


def test_a_withdrawn_prefill_stage_is_forgotten_with_its_booking() -> None:
    state = pd_state()
    state.on_request(admitted("r1"), TICKET, T)
    effect, a = placed(state)
    assert (a.phase, state.reserved_kv("p0")) == ("prefill", 1_008)
    assert state.withdraw(effect, T)
    assert (state.reserved_kv("p0"), state.log.status("r1")) == (0, "unknown")
    assert state.on_request(admitted("r1"), TICKET, T + 1) == []
    assert placed(state, T + 1)[1].phase == "prefill"


def end(state: SchedulerState, request: AdmittedRequest, how: str) -> list[Effect]:
    """``request`` read at T + 2.5 and ended: by the core, or on a cancel before or while
    it waits."""
    if how == "cancelled before":
        state.on_cancel(cancel(request.request_id), T)
    effects = state.on_request(request, TICKET, T + 2.5)
    if how == "cancelled in queue":
        assert state.on_cancel(cancel(request.request_id), T + 2.5)
    return effects or state.tick(T + 2.5).effects


@pytest.mark.parametrize(("admission", "how", "code"), [
    pytest.param(admitted("r1", timeout_s=2.0), "queued", "queue_timeout", id="expired"),
    pytest.param(admitted("r1", model="nobody-serves-this"), "queued", "unknown_model",
                 id="rejected"),
    pytest.param(admitted("r1"), "cancelled in queue", "cancelled", id="cancelled in queue"),
    pytest.param(admitted("r1"), "cancelled before", "cancelled", id="cancelled before"),
])
def test_a_withdrawn_ending_is_forgotten_and_decided_again_when_redelivered(
    admission: AdmittedRequest, how: str, code: str,
) -> None:
    state = ready_state()
    state.observe_heartbeat(beat("w0", 0, ts=T + 2.5))  # (an empty fleet defers them all)
    (effect,) = end(state, admission, how)
    assert [r.code for r in replies([effect])] == [code]
    assert state.withdraw(effect, T + 2.5)
    assert state.log.status("r1") == "unknown" and state.ended == {code: 0}
    # Redelivered: a cancel is remembered again (answered at once), the rest queued again.
    again = state.on_request(admission, TICKET, T + 3) or state.tick(T + 3).effects
    assert [r.code for r in replies(again)] == [code] and again[0].tickets == (TICKET,)


def test_a_withdrawn_refusal_of_a_reused_id_refuses_its_redelivery_again() -> None:
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), TICKET, T)
    _, first = placed(state)
    state.observe_event(done(first, "w0"))
    reuse = admitted("r1", at=T + 60)
    (effect,) = state.on_request(reuse, ("tp", 1), T + 60)
    assert state.withdraw(effect, T + 60)
    assert state.ended == {"invalid": 0}
    (again,) = state.on_request(reuse, ("tp", 1), T + 61)
    assert [r.code for r in replies([again])] == ["invalid"]
    assert state.on_request(admitted("r1"), TICKET, T + 61) == [Effect(tickets=(TICKET,))]


def _read_back(state: SchedulerState, a: Assignment) -> None:
    state.observe_assignment(a)


def _started(state: SchedulerState, a: Assignment) -> None:
    state.observe_event(started(a, a.worker_id))


def _placed_elsewhere(state: SchedulerState, a: Assignment) -> None:
    state.observe_assignment(placement_elsewhere(a.admitted))


def placement_elsewhere(request: AdmittedRequest) -> Assignment:
    """Attempt 1 of ``request`` as another replica placed it (on its w1)."""
    other = ready_state(("w1", 1))
    other.on_request(request, TICKET, T)
    return placed(other)[1]


@pytest.mark.parametrize("news", [_read_back, _started, _placed_elsewhere])
def test_a_placement_is_kept_once_the_log_read_a_record_of_it(
    news: Callable[[SchedulerState, Assignment], None],
) -> None:
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), TICKET, T)
    effect, a = placed(state)
    news(state, a)
    assert not state.withdraw(effect, T)
    assert (state.log.status("r1"), state.reserved_kv("w0")) == ("active", a.kv_tokens)
    assert state.on_request(admitted("r1"), TICKET, T + 1) == [Effect(tickets=(TICKET,))]


def test_a_placement_is_kept_once_its_worker_was_declared_lost() -> None:
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1"), TICKET, T)
    effect, _ = placed(state)
    state.observe_heartbeat(beat("w1", 1, ts=T + 5))
    result = tick_and_release(state, T + 5)  # w0 is stale: r1 requeued, placed on w1
    ((_, requeue),) = assignments(result.effects)
    assert not state.withdraw(effect, T + 5)
    assert state.log.active("r1") == requeue


def test_an_ending_is_kept_once_the_log_read_the_request_placed_elsewhere() -> None:
    state = ready_state()
    request = admitted("r1", timeout_s=2.0)
    (effect,) = end(state, request, "queued")
    state.observe_assignment(placement_elsewhere(request))
    assert not state.withdraw(effect, T + 3)
    assert state.ended == {"queue_timeout": 1}


def test_requeues_and_hand_offs_carry_no_decision() -> None:
    """They ack no request record: no revoked partition takes them elsewhere."""
    state = pd_state()
    a = place_prefill(state)
    state.observe_event(started(a, "p0"))
    state.observe_event(prefilled(a))
    (handoff,) = [e for e in state.tick(T + 1).effects if e.first]
    assert handoff.decision is None and not state.withdraw(handoff, T + 1)
    assert state.log.status("r1") == "active"
    lost = ready_state(("w0", 0))
    lost.on_request(admitted("r2"), TICKET, T)
    placed(lost)
    lost.observe_heartbeat(beat("w1", 1, ts=T + 5))
    result = tick_and_release(lost, T + 5)
    ((_, requeue),) = assignments(result.effects)
    assert requeue.attempt == 2
    assert [e.decision for e in result.effects if e.first] == [None]


def test_a_taken_back_placement_is_remembered_only_until_its_deadline() -> None:
    # Its record may have gone to another replica for good: nothing asks for it again.
    state = ready_state(("w0", 0))
    state.on_request(admitted("r1", timeout_s=60.0), TICKET, T)
    effect, _ = placed(state)
    assert state.withdraw(effect, T)
    state.prune(T + 59)
    assert state._taken_back == {"r1": (1, T + 60)}
    state.prune(T + 61)
    assert state._taken_back == {}
