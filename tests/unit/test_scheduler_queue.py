"""The pending queue: aging, FCFS, cancellation, expiry, capacity (core.queue)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from schemas.common import Priority
from services.scheduler import ConfigError, PendingQueue, QueueConfig
from tests.builders import NOW, make_queue, make_request


@pytest.mark.parametrize(
    ("aging_s", "priority", "bound"),
    [(30.0, "high", 0.0), (30.0, "normal", 30.0), (30.0, "low", 60.0), (5.0, "low", 10.0)],
)
def test_aging_bound_is_rank_times_aging_interval(
    aging_s: float, priority: Priority, bound: float
) -> None:
    assert QueueConfig(aging_s_per_class=aging_s).aging_bound_s(priority) == bound


@pytest.mark.parametrize(
    ("waited", "expected"),
    [(0.0, 2.0), (30.0, 1.0), (60.0, 0.0), (75.0, -0.5)],
)
def test_effective_priority_gains_one_class_per_interval(waited: float, expected: float) -> None:
    queue = make_queue()
    request = make_request(priority="low", enqueued_at=NOW - waited)
    assert queue.effective_priority(request, NOW) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("priority", "waited", "expected"),
    [("low", 0.0, 2), ("low", 29.9, 2), ("low", 30.0, 1), ("low", 59.0, 1), ("low", 60.0, 0),
     ("low", 500.0, 0), ("normal", 0.0, 1), ("normal", 30.0, 0), ("high", 0.0, 0),
     # enqueued in the scheduler's future (ingest's clock ahead): never below its class
     ("low", -0.005, 2), ("normal", -0.005, 1), ("high", -3.0, 0)],
)
def test_engine_priority_is_the_class_aged_into(
    priority: Priority, waited: float, expected: int
) -> None:
    queue = make_queue()
    request = make_request(priority=priority, enqueued_at=NOW - waited)
    assert queue.engine_priority(request, NOW) == expected


@pytest.mark.parametrize(
    ("requests", "order"),
    [
        # (id, priority, seconds waited): higher class first when equally old
        ([("n", "normal", 0), ("h", "high", 0), ("l", "low", 0)], ["h", "n", "l"]),
        # a low request that waited 61 s outranks a fresh high one (bound 60 s)
        ([("h", "high", 0), ("l", "low", 61)], ["l", "h"]),
        # ... but not one that waited 59 s
        ([("h", "high", 0), ("l", "low", 59)], ["h", "l"]),
        # normal aged 31 s beats a high aged 0.5 s
        ([("h", "high", 0.5), ("n", "normal", 31)], ["n", "h"]),
    ],
)
def test_heads_follow_effective_priority(
    requests: list[tuple[str, Priority, float]], order: list[str]
) -> None:
    queue = make_queue(
        *(make_request(rid, priority=p, enqueued_at=NOW - w) for rid, p, w in requests)
    )
    assert [r.request_id for r in queue.heads()] == order


def test_fcfs_within_a_class_by_enqueue_time_then_arrival() -> None:
    queue = make_queue(
        make_request("b", enqueued_at=NOW),
        make_request("c", enqueued_at=NOW),
        make_request("a", enqueued_at=NOW - 5),  # e.g. a requeue keeps its original time
    )
    assert [r.request_id for r in queue.ordered()] == ["a", "b", "c"]
    klass = queue.class_keys()[0]
    for expected in ["a", "b", "c"]:
        head = queue.head(klass)
        assert head is not None and head.request_id == expected
        queue.remove(expected)
    assert queue.head(klass) is None and len(queue) == 0


def test_classes_are_split_by_lane_priority_and_model() -> None:
    queue = make_queue(
        make_request(lane="short"),
        make_request(lane="long"),
        make_request(priority="high"),
        make_request(model="other"),
        make_request(),
    )
    assert len(queue.class_keys()) == 4


def test_cancel_removes_and_reports_once() -> None:
    queue = make_queue(make_request("a"), make_request("b"))
    assert queue.cancel("a") is True
    assert queue.cancel("a") is False
    assert queue.cancel("nope") is False
    assert [r.request_id for r in queue.take_cancelled()] == ["a"]
    assert queue.take_cancelled() == []
    assert "a" not in queue and "b" in queue


@pytest.mark.parametrize(
    ("deadlines", "now", "expired"),
    [
        ({"a": NOW + 1, "b": NOW + 2, "c": None}, NOW + 1.5, ["a"]),
        ({"a": NOW + 1, "b": NOW + 2, "c": None}, NOW + 2, ["a", "b"]),  # at the deadline
        ({"a": NOW + 1}, NOW, []),
    ],
)
def test_expire_takes_requests_whose_deadline_passed(
    deadlines: dict[str, float | None], now: float, expired: list[str]
) -> None:
    queue = make_queue(*(make_request(rid, deadline=d) for rid, d in deadlines.items()))
    assert [r.request_id for r in queue.expire(now)] == expired
    assert len(queue) == len(deadlines) - len(expired)


def test_expire_ignores_requests_already_removed() -> None:
    queue = make_queue(make_request("a", deadline=NOW + 1))
    queue.remove("a")
    assert queue.expire(NOW + 10) == []


def test_capacity_refuses_new_work_but_takes_requeues() -> None:
    queue = make_queue(make_request("a"), max_pending=2)
    assert not queue.is_full
    assert queue.push(make_request("b"))
    assert queue.is_full
    assert queue.push(make_request("c")) is False
    assert queue.push(make_request("d", attempt=1), force=True)
    assert len(queue) == 3


def test_counts_per_priority_and_lane() -> None:
    queue = make_queue(
        make_request(priority="high"), make_request(lane="long"), make_request(lane="long")
    )
    counts = queue.counts()
    assert counts[("high", "short")] == 1
    assert counts[("normal", "long")] == 2
    assert sum(counts.values()) == 3 and len(counts) == 6


def test_duplicate_push_is_ignored_and_a_newer_attempt_replaces() -> None:
    queue = make_queue(make_request("a", attempt=1, enqueued_at=NOW - 1))
    assert queue.push(make_request("a", attempt=1))
    assert queue.push(make_request("a", attempt=0))
    assert len(queue) == 1 and queue.get("a") is not None
    assert queue.push(make_request("a", attempt=2, enqueued_at=NOW - 1))
    request = queue.get("a")
    assert len(queue) == 1 and request is not None and request.attempt == 2


def test_many_removals_keep_heads_right() -> None:
    queue = make_queue(*(make_request(f"r{i}", enqueued_at=NOW + i) for i in range(500)))
    for i in range(0, 499, 1):
        if i % 3:
            queue.remove(f"r{i}")
    remaining = [r.request_id for r in queue.ordered()]
    assert remaining[0] == "r0" and len(remaining) == len(queue)
    assert queue.heads()[0].request_id == "r0"


@pytest.mark.parametrize(
    ("config", "setting"),
    [
        ({"aging_s_per_class": 0.0}, "queue.aging_s_per_class"),
        ({"aging_s_per_class": float("nan")}, "queue.aging_s_per_class"),
        ({"max_pending": 0}, "queue.max_pending"),
        ({"lane_weights": {"short": 3.0}}, "queue.lane_weights.long"),
        ({"lane_weights": {"short": 3.0, "long": -1.0}}, "queue.lane_weights.long"),
        ({"lane_weights": {"short": 1.0, "long": 1.0, "huge": 1.0}}, "queue.lane_weights"),
        ({"handoff_step_s": -1.0}, "queue.handoff_step_s"),
    ],
)
def test_bad_queue_config_names_the_setting(config: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        PendingQueue(QueueConfig(**config))
    assert caught.value.setting == setting


def _handoff(rid: str, priority: Priority, enqueued_at: float) -> Any:
    return replace(make_request(rid, priority=priority, enqueued_at=enqueued_at),
                   phase="decode")


def test_hand_offs_go_first_and_among_themselves_by_class_within_a_short_step() -> None:
    # Admitted 0.5 s before the high one, a normal hand-off still goes after it; one
    # admitted 1.5 s before does not (handoff_step_s = 1 s per class); a low one steps 2 s.
    queue = make_queue(_handoff("normal-early", "normal", NOW - 1.5),
                       _handoff("normal", "normal", NOW - 0.5),
                       _handoff("low", "low", NOW - 1.5),
                       _handoff("high", "high", NOW),
                       make_request("fresh-high", priority="high", enqueued_at=NOW - 0.1))
    assert [r.request_id for r in queue.ordered()] == [
        "normal-early", "fresh-high", "high", "normal", "low"]  # (the last two tie: FCFS)
    assert {r.request_id for r in queue.heads()} == {"fresh-high", "normal-early"}
    # Its bound is its step: once waited, nothing admitted later overtakes it ...
    assert not queue.overdue(queue.get("normal"), NOW)
    assert queue.overdue(queue.get("normal"), NOW + 0.5)
    assert queue.overdue(queue.get("high"), NOW)
    # ... and in its engine every hand-off goes first.
    assert {queue.engine_priority(r, NOW) for r in queue.ordered()} == {0}
    # A step of 0: oldest first, whatever the class (as before the step).
    flat = make_queue(_handoff("normal", "normal", NOW - 0.5), _handoff("high", "high", NOW),
                      handoff_step_s=0.0)
    assert [r.request_id for r in flat.ordered()] == ["normal", "high"]
