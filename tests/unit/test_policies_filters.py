"""Placement filters, one table per filter (policies.filters)."""

from __future__ import annotations

from types import ModuleType

import pytest

from schemas.common import Lane, Pool
from services.scheduler import Filter, Ledger, PlacementContext, QueuedRequest, WorkerState
from services.scheduler.policies.filters import (
    fresh_heartbeat,
    kv_fits,
    lane_pool,
    model_match,
    not_draining,
    replica_turn,
    seq_slots,
)
from tests.builders import NOW, make_request, make_snapshot, make_worker


def accepts(
    f: Filter,
    worker: WorkerState,
    request: QueuedRequest,
    ledger: Ledger | None = None,
    now: float = NOW,
) -> bool:
    ctx = PlacementContext(make_snapshot([worker], now=now), ledger or Ledger(), now)
    return f.accepts(worker, request, ctx)


@pytest.mark.parametrize(
    ("worker", "request_", "ok"),
    [
        (make_worker(), make_request(), True),
        (make_worker(model="other"), make_request(), False),
        (make_worker(model_version="v1"), make_request(model_version="v1"), True),
        (make_worker(model_version="v1"), make_request(model_version="v2"), False),
        (make_worker(model_version=None), make_request(model_version=None), True),
    ],
)
def test_model_match(worker: WorkerState, request_: QueuedRequest, ok: bool) -> None:
    assert accepts(model_match.factory({}), worker, request_) is ok


@pytest.mark.parametrize(
    ("pool", "lane", "ok"),
    [
        ("any", "short", True),
        ("any", "long", True),
        ("short", "short", True),
        ("short", "long", False),
        ("long", "long", True),
        ("long", "short", False),
    ],
)
def test_lane_pool(pool: Pool, lane: Lane, ok: bool) -> None:
    worker, request = make_worker(pool=pool), make_request(lane=lane)
    assert accepts(lane_pool.factory({}), worker, request) is ok


@pytest.mark.parametrize(
    ("params", "age", "ok"),
    [
        ({}, 0.0, True),
        ({}, 3.0, True),
        ({}, 3.5, False),
        ({"max_age_s": 1.0}, 1.5, False),
        ({"max_age_s": 10.0}, 3.5, False),
    ],  # can only tighten the snapshot's bound
)
def test_fresh_heartbeat(params: dict[str, float], age: float, ok: bool) -> None:
    worker = make_worker(heartbeat_ts=NOW - age)
    assert accepts(fresh_heartbeat.factory(params), worker, make_request()) is ok


@pytest.mark.parametrize(("draining", "ok"), [(False, True), (True, False)])
def test_not_draining(draining: bool, ok: bool) -> None:
    assert accepts(not_draining.factory({}), make_worker(draining=draining), make_request()) is ok


@pytest.mark.parametrize(
    ("reserved", "kv", "ok"),
    [(0, 95_000, True), (0, 95_001, False), (90_000, 5_000, True), (90_000, 5_001, False)],
)
def test_kv_fits_after_reservations(reserved: int, kv: int, ok: bool) -> None:
    ledger, worker = Ledger(), make_worker(kv_total_tokens=100_000)
    if reserved:
        ledger.reserve(worker, make_request("held", kv_tokens=reserved))
    assert accepts(kv_fits.factory({}), worker, make_request(kv_tokens=kv), ledger) is ok


@pytest.mark.parametrize(
    ("running", "waiting", "placed", "ok"),
    [
        (0, 0, 0, True),
        (3, 0, 0, True),
        (3, 0, 1, False),
        (2, 1, 0, True),
        (3, 1, 0, False),
        (4, 0, 0, False),
    ],
)
def test_seq_slots_counts_assigned_not_started(
    running: int, waiting: int, placed: int, ok: bool
) -> None:
    ledger, worker = Ledger(), make_worker(running=running, waiting=waiting, max_num_seqs=4)
    for i in range(placed):
        ledger.reserve(worker, make_request(f"p{i}", kv_tokens=16))
    assert accepts(seq_slots.factory({}), worker, make_request(), ledger) is ok


@pytest.mark.parametrize(
    ("module", "stage"),
    [
        (model_match, "route"),
        (lane_pool, "route"),
        (fresh_heartbeat, "route"),
        (not_draining, "route"),
        (kv_fits, "index"),
        (seq_slots, "index"),
        (replica_turn, "room"),
    ],
)
def test_stage_matches_what_the_filter_reads(module: ModuleType, stage: str) -> None:
    plugin = module.factory({})
    assert isinstance(plugin, Filter) and plugin.stage == stage
