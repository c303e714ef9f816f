"""Candidate indexes kept in step with the ledger (core.index)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from services.scheduler import Ledger, WorkerState
from services.scheduler.core.index import Route, RouteIndex, capacity, route_index
from tests.builders import NOW, make_request, make_snapshot, make_worker

ROUTE: Route = ("llama-3.1-8b", None, "short")


def admit_all(worker: WorkerState) -> bool:
    return True


def ids(workers: Iterable[WorkerState]) -> list[str]:
    return [w.worker_id for w in workers]


def test_members_exclude_stale_workers_whatever_the_filters_say() -> None:
    snapshot = make_snapshot([make_worker("ok"), make_worker("old", heartbeat_ts=NOW - 60)])
    index = route_index(snapshot, ROUTE, Ledger(), admit_all, owner="p")
    assert ids(index.members) == ["ok"]


def test_index_is_memoised_per_snapshot_and_follows_the_ledger() -> None:
    ledger = Ledger()
    a, b = make_worker("a", kv_total_tokens=10_000), make_worker("b", kv_total_tokens=20_000)
    snapshot = make_snapshot([a, b])
    index = route_index(snapshot, ROUTE, ledger, admit_all, owner="p")
    assert index.top_room() == 19_000
    ledger.reserve(b, make_request("x", kv_tokens=15_000))
    again = route_index(snapshot, ROUTE, ledger, admit_all, owner="p")
    assert again is index and index.top_room() == 9_500
    assert ids(index.roomiest(1)) == ["a", "b"]
    ledger.release("x", 0)
    route_index(snapshot, ROUTE, ledger, admit_all, owner="p")
    assert ids(index.roomiest(1)) == ["b", "a"]
    assert ids(index.roomiest(10_000)) == ["b"]
    assert ids(index.fitting(9_500)) == ["a", "b"]


def test_roomiest_leaves_the_index_intact_when_stopped_early() -> None:
    ledger = Ledger()
    workers = [make_worker(f"w{i}", kv_total_tokens=1_000 * (i + 1)) for i in range(10)]
    index = RouteIndex(workers, ledger)
    walk = index.roomiest(1)
    assert [next(walk).worker_id for _ in range(3)] == ["w9", "w8", "w7"]
    walk.close()
    assert ids(index.roomiest(1)) == [f"w{i}" for i in range(9, -1, -1)]


def test_many_changes_compact_the_heap_without_losing_order() -> None:
    ledger = Ledger()
    workers = [make_worker(f"w{i}") for i in range(5)]
    index = RouteIndex(workers, ledger)
    for round_ in range(100):
        worker = workers[round_ % 5]
        ledger.reserve(worker, make_request(f"r{round_}", kv_tokens=100 + round_))
        index.sync()
        ledger.release(f"r{round_}", 0)
        index.sync()
    assert index.top_room() == 95_000 and len(ids(index.roomiest(1))) == 5


def test_a_trimmed_change_log_makes_the_index_rescan() -> None:
    ledger = Ledger(log_limit=16)
    a = make_worker("a")
    index = RouteIndex([a], ledger)
    for i in range(40):
        ledger.reserve(make_worker(f"x{i}"), make_request(f"x{i}"))
    ledger.reserve(a, make_request("on-a", kv_tokens=5_000))
    index.sync()
    assert index.top_room() == 90_000


@pytest.mark.parametrize(
    ("workers", "accepting", "max_usable"),
    [
        # draining: serves the model, but takes nothing new
        ([make_worker("big", kv_total_tokens=200_000, draining=True)], 0, 0),
        (
            [
                make_worker("big", kv_total_tokens=200_000, draining=True),
                make_worker("small", kv_total_tokens=10_000),
            ],
            1,
            9_500,
        ),
        # stale and other-model workers do not count at all
        (
            [
                make_worker("old", kv_total_tokens=900_000, heartbeat_ts=NOW - 60),
                make_worker("other", model="other", kv_total_tokens=800_000),
                make_worker("small", kv_total_tokens=10_000),
            ],
            1,
            9_500,
        ),
    ],
)
def test_capacity_counts_fresh_workers_that_take_work(
    workers: list[WorkerState], accepting: int, max_usable: int
) -> None:
    fleet = capacity(make_snapshot(workers), ROUTE, Ledger())
    assert fleet.any_live and fleet.model_served and fleet.lane_served
    assert (fleet.accepting, fleet.max_usable) == (accepting, max_usable)
