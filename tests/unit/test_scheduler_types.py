"""Snapshot and request values (services.scheduler.core.types)."""

from __future__ import annotations

import pytest

from services.scheduler import Snapshot
from tests.builders import NOW, make_request, make_snapshot, make_worker


@pytest.mark.parametrize(
    ("kv_tokens", "attempt", "message"),
    [(0, 0, "kv_tokens"), (-16, 0, "kv_tokens"), (1_024, -1, "attempt")],
)
def test_request_rejects_impossible_values(kv_tokens: int, attempt: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_request(kv_tokens=kv_tokens, attempt=attempt)


def test_request_key_is_id_and_attempt() -> None:
    assert make_request("r1", attempt=2).key == ("r1", 2)


@pytest.mark.parametrize(
    ("heartbeat_ts", "fresh"),
    [(NOW, True), (NOW - 3.0, True), (NOW - 3.001, False), (NOW + 1.0, True)],
)
def test_heartbeat_older_than_the_bound_is_stale(heartbeat_ts: float, fresh: bool) -> None:
    worker = make_worker(heartbeat_ts=heartbeat_ts)
    assert make_snapshot([worker]).is_fresh(worker) is fresh


def test_snapshot_workers_are_read_only_and_keyed_by_id() -> None:
    snapshot = make_snapshot([make_worker("a"), make_worker("b"), make_worker("a", partition=3)])
    assert sorted(snapshot.workers) == ["a", "b"]
    assert snapshot.workers["a"].partition == 3  # a later duplicate wins
    with pytest.raises(TypeError):
        snapshot.workers["c"] = make_worker("c")  # type: ignore[index]  # the point: read-only


def test_snapshot_rejects_a_non_positive_staleness_bound() -> None:
    with pytest.raises(ValueError, match="stale_after_s"):
        Snapshot({}, NOW, 0.0)
