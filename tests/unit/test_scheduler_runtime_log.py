"""AssignmentLog: the status of a request from its assignments and events, in any order.

This is the restart rebuild: the log is fed the records of ``llmq.assignments`` and
``llmq.events`` as they come (two topics, so in no particular order between them), and the
status of each request must not depend on that order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from schemas.base import MAX_TIMEOUT_S
from schemas.replies import Usage
from schemas.requests import Assignment
from schemas.workers import (
    EventAborted,
    EventDone,
    EventFailed,
    EventFirstToken,
    EventStarted,
    LifecycleEvent,
)
from services.scheduler.runtime.log import AssignmentLog
from tests.builders_schemas import make_admitted, make_assignment, make_request

T = 1_000_000.0


def assigned(rid: str, attempt: int = 1, worker: str = "w0", **changes: Any) -> Assignment:
    request = make_request(request_id=rid, created_at=T, timeout_s=60.0)
    return make_assignment(admitted=make_admitted(request=request), attempt=attempt,
                           worker_id=worker, assigned_at=T + attempt, **changes)


def event(kind: str, rid: str, attempt: int = 1, worker: str = "w0") -> LifecycleEvent:
    base: dict[str, Any] = {"request_id": rid, "tenant": "acme", "attempt": attempt,
                            "worker_id": worker, "ts": T + 10}
    if kind == "started":
        return EventStarted(**base)
    if kind == "first_token":
        return EventFirstToken(**base, ttft_s=0.1)
    if kind == "done":
        return EventDone(**base, finish_reason="stop",
                         usage=Usage(prompt_tokens=1, completion_tokens=1))
    if kind == "failed":
        return EventFailed(**base, code="queue_timeout", message="late")
    return EventAborted(**base, code="cancelled")


Record = Assignment | LifecycleEvent


def feed(log: AssignmentLog, records: tuple[Record, ...]) -> None:
    for record in records:
        if isinstance(record, Assignment):
            log.observe_assignment(record)
        else:
            log.observe_event(record)


CASES: list[tuple[str, list[Record], str, int | None]] = [
    ("never seen", [], "unknown", None),
    ("assigned", [assigned("r")], "active", 1),
    ("assigned and started", [assigned("r"), event("started", "r")], "active", 1),
    ("done", [assigned("r"), event("started", "r"), event("done", "r")], "finished", None),
    ("failed on the worker", [assigned("r"), event("failed", "r")], "finished", None),
    ("ended by the scheduler, never assigned", [event("failed", "r")], "finished", None),
    ("cancelled while pending", [event("aborted", "r")], "finished", None),
    ("requeued and placed again", [assigned("r", 1), assigned("r", 2, "w1")], "active", 2),
    ("old attempt ends after the requeue was placed",
     [assigned("r", 1), assigned("r", 2, "w1"), event("done", "r", 1)], "active", 2),
    ("second attempt done", [assigned("r", 1), assigned("r", 2, "w1"),
                             event("done", "r", 2, "w1")], "finished", None),
    ("requeue timed out in the queue", [assigned("r", 1), event("failed", "r", 2)],
     "finished", None),
    ("a duplicate record changes nothing",
     [assigned("r"), assigned("r"), event("started", "r"), event("started", "r")], "active", 1),
]


@pytest.mark.parametrize(("name", "records", "status", "active"), CASES, ids=[c[0] for c in CASES])
def test_status_does_not_depend_on_the_order_records_arrive(
    name: str, records: list[Record], status: str, active: int | None
) -> None:
    for order in itertools.permutations(records):
        log = AssignmentLog()
        feed(log, order)
        assert log.status("r") == status, order
        found = log.active("r")
        assert (found.attempt if found else None) == active, order


def test_lost_attempts_and_the_worker_index() -> None:
    log = AssignmentLog()
    log.observe_assignment(assigned("a", worker="w0"))
    log.observe_assignment(assigned("b", worker="w0"))
    log.observe_assignment(assigned("c", worker="w1"))
    assert sorted(log.workers()) == ["w0", "w1"]
    assert sorted(a.request_id for a in log.active_on("w0")) == ["a", "b"]
    log.mark_lost("a", 1)
    assert log.status("a") == "lost" and log.latest("a") is not None
    assert [a.request_id for a in log.active_on("w0")] == ["b"]
    log.observe_event(event("done", "b"))
    assert log.workers() == ["w1"]
    log.observe_assignment(assigned("a", 2, "w1"))
    assert sorted(a.request_id for a in log.active_on("w1")) == ["a", "c"]
    assert [a.request_id for a in log.all_active()] == ["c", "a"]  # by placement time


def test_started_and_streamed_per_attempt() -> None:
    log = AssignmentLog()
    feed(log, (assigned("r"), event("started", "r"), event("first_token", "r")))
    assert log.started("r", 1) and log.streamed("r", 1)
    assert not log.started("r", 2) and not log.streamed("r", 2)
    assert log.model_of("r") is not None and log.model_of("x") is None


def test_finished_entries_drop_their_payload_and_are_pruned_after_memory() -> None:
    log = AssignmentLog(memory_s=100.0)
    feed(log, (assigned("done"), event("done", "done"), assigned("running")))
    log.mark_ended("ours", 1, expires_at=T + 60.0)
    assert log.latest("done") is None  # finished: payload dropped
    assert log.prune(T + 100.0) == 0  # not yet past deadline + memory
    assert log.prune(T + 170.0) == 2  # "done" (deadline T+60, event T+10) and "ours"
    assert log.status("done") == "unknown"
    assert log.status("running") == "active"  # an active entry is never pruned
    assert len(log) == 1


REACHED: list[tuple[str, list[Record], dict[int, bool]]] = [
    # name, records, attempt -> whether the log shows it (or a later one) placed or ended
    ("never seen", [], {1: False}),
    ("assigned", [assigned("r")], {1: True, 2: False}),
    ("started before its assignment", [event("started", "r", 2)], {2: True, 3: False}),
    ("first token only", [event("first_token", "r", 2)], {2: True, 3: False}),
    ("ended only", [event("done", "r", 2)], {1: True, 2: True, 3: False}),
    ("requeued: attempt 1 assigned", [assigned("r", 1), event("started", "r", 1)],
     {1: True, 2: False}),
]


@pytest.mark.parametrize(("name", "records", "expected"), REACHED, ids=[c[0] for c in REACHED])
def test_reached_tells_an_attempt_placed_elsewhere_from_any_of_its_records(
    name: str, records: list[Record], expected: dict[int, bool]
) -> None:
    for order in itertools.permutations(records):
        log = AssignmentLog()
        feed(log, order)
        assert {a: log.reached("r", a) for a in expected} == expected, order


def test_a_reuse_is_told_from_a_redelivery_by_the_admissions_the_log_holds() -> None:
    log = AssignmentLog()
    first = assigned("r")
    log.observe_event(event("done", "r"))
    assert not log.is_reuse("r", first.admitted.admitted_at + 5)  # none known: can't tell
    log.observe_assignment(first)
    assert not log.is_reuse("r", first.admitted.admitted_at)  # a redelivery
    assert log.is_reuse("r", first.admitted.admitted_at + 5)
    log.mark_ended("r", 1, expires_at=T + 60.0, admitted_at=first.admitted.admitted_at + 5)
    assert not log.is_reuse("r", first.admitted.admitted_at + 5)  # answered once already
    # A scheduler's ending read from the topic names the admission (its headers).
    other = AssignmentLog(memory_s=100.0)
    other.observe_event(event("aborted", "r"), admitted_at=T - 1, deadline=T + 500.0)
    assert not other.is_reuse("r", T - 1) and other.is_reuse("r", T + 30)
    assert other.prune(T + 500.0 + 99.0) == 0  # kept until its deadline + memory_s
    assert other.prune(T + 500.0 + 101.0) == 1


def test_an_own_decision_never_produced_is_forgotten_while_nothing_came_after_it() -> None:
    log = AssignmentLog()
    a = assigned("r1")
    at = a.admitted.admitted_at
    log.observe_assignment(a, own=True)
    assert log.forget("r1", 1, at)
    assert (log.status("r1"), log.reached("r1", 1), len(log), log.workers()) == (
        "unknown", False, 0, [])
    assert not log.forget("r1", 1, at)  # once
    log.mark_ended("r2", 1, T + 60, at)  # an ending of a request never placed
    assert log.forget("r2", 1, at) and log.status("r2") == "unknown" and len(log) == 0


@pytest.mark.parametrize("news", [
    pytest.param(lambda log: log.observe_assignment(assigned("r1")), id="read back"),
    pytest.param(lambda log: log.observe_event(event("started", "r1")), id="started"),
    pytest.param(lambda log: log.mark_lost("r1", 1), id="lost"),
])
def test_an_own_placement_is_kept_once_anything_came_after_it(
    news: Callable[[AssignmentLog], object],
) -> None:
    log = AssignmentLog()
    a = assigned("r1")
    log.observe_assignment(a, own=True)
    news(log)
    assert not log.forget("r1", 1, a.admitted.admitted_at)
    assert log.latest("r1") is a


def test_forgetting_a_refused_reuse_forgets_only_its_admission() -> None:
    log = AssignmentLog()
    first = assigned("r1")
    feed(log, (first, event("done", "r1")))
    log.mark_ended("r1", 1, T + 120, admitted_at=T + 60)  # a reuse of the id, refused
    assert not log.is_reuse("r1", T + 60)
    assert log.forget("r1", 1, T + 60)
    assert log.status("r1") == "finished" and log.is_reuse("r1", T + 60)
    assert not log.is_reuse("r1", first.admitted.admitted_at)


def test_a_deadline_header_past_the_longest_timeout_is_capped() -> None:
    # Any producer to llmq.events can write the header: 1e15 kept the entry for good.
    log = AssignmentLog(memory_s=100.0)
    log.observe_event(event("aborted", "r"), admitted_at=T - 1, deadline=1e15)
    read_at = T + 10  # the event's ts
    assert log.prune(read_at + MAX_TIMEOUT_S + 99.0) == 0
    assert log.prune(read_at + MAX_TIMEOUT_S + 101.0) == 1


def test_attempt_sets_behave_as_sets_of_ints() -> None:
    # The log's per-request attempt sets are ints' bits (memory: 56 bytes, not 216).
    from services.scheduler.runtime.log import _Attempts

    seen = _Attempts()
    assert not seen and list(seen) == [] and max(seen, default=0) == 0 and 1 not in seen
    for attempt in (3, 1, 64, 1):
        seen.add(attempt)
    assert seen and list(seen) == [1, 3, 64] and max(seen) == 64
    assert 3 in seen and 2 not in seen and -1 not in seen and "3" not in seen
    seen.discard(3)
    seen.discard(7)  # absent: nothing
    assert list(seen) == [1, 64]
    seen.clear()
    assert not seen
