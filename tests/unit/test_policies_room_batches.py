"""Room filters are asked about a batch of candidates at once, with the verdicts of
``accepts`` (policies.base.RoomFilter, core.cycle)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.scheduler import (
    ConfigError,
    Defer,
    Ledger,
    Placement,
    PlacementContext,
    QueuedRequest,
    WorkerState,
    build_pipeline,
    schedule,
)
from services.scheduler.policies import registry
from services.scheduler.policies.base import Params, RoomFilter, Stage
from services.scheduler.policies.filters.class_reserve import ClassReserve
from services.scheduler.policies.filters.replica_turn import ReplicaTurn
from tests.builders import NOW, make_queue, make_request, make_snapshot, make_worker, seeded

FILTERS = ["model-match", "lane-pool", "fresh-heartbeat", "not-draining", "kv-fits",
           "seq-slots"]


def busy_workers() -> list[WorkerState]:
    """Workers from idle to nearly full, so the reserve refuses some of them."""
    return [make_worker(f"w{i}", kv_total_tokens=10_000, kv_free_tokens=10_000 - 1_200 * i,
                        running=i * 7, max_num_seqs=64) for i in range(8)]


@pytest.mark.parametrize("priority", ["high", "normal", "low"])
@pytest.mark.parametrize("waited", [0.0, 45.0, 100.0])
def test_class_reserve_batch_verdicts_are_its_one_by_one_verdicts(
    priority: str, waited: float
) -> None:
    workers = busy_workers()
    ctx = PlacementContext(make_snapshot(workers), Ledger(), NOW,
                           make_queue().engine_priority)
    request = make_request(priority=priority, kv_tokens=900,  # type: ignore[arg-type]
                           enqueued_at=NOW - waited)
    reserve = ClassReserve()
    assert reserve.accepts_each(workers, request, ctx) == [
        reserve.accepts(w, request, ctx) for w in workers]


@pytest.mark.parametrize("now", [NOW, NOW + 0.02, NOW + 0.3, NOW + 0.49])
def test_replica_turn_batch_verdicts_are_its_one_by_one_verdicts(now: float) -> None:
    workers = busy_workers()
    ctx = PlacementContext(make_snapshot(workers, now=now), Ledger(), now)
    turn = ReplicaTurn(replicas=3, index=1)
    request = make_request()
    assert turn.accepts_each(workers, request, ctx) == [
        turn.accepts(w, request, ctx) for w in workers]


class _Counting:
    """A room filter that refuses the workers named, and records what it was asked."""

    name = "counting"
    stage: Stage = "room"

    def __init__(self, refused: Sequence[str]) -> None:
        self.refused = set(refused)
        self.batches: list[list[str]] = []

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        return worker.worker_id not in self.refused

    def accepts_each(
        self, workers: Sequence[WorkerState], request: QueuedRequest, ctx: PlacementContext
    ) -> list[bool]:
        self.batches.append([w.worker_id for w in workers])
        return [self.accepts(w, request, ctx) for w in workers]


class _PerWorkerOnly:
    name = "per-worker-only"
    stage: Stage = "room"

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        return True


def with_filter(monkeypatch: pytest.MonkeyPatch, plugin: object, candidates: int) -> object:
    def factory(params: Params) -> object:
        return plugin

    monkeypatch.setitem(registry.REGISTRY, plugin.name, factory)  # type: ignore[attr-defined]
    return build_pipeline({"filters": [*FILTERS, plugin.name],  # type: ignore[attr-defined]
                           "candidates": candidates, "spill": {}})


def roomy_fleet() -> list[WorkerState]:
    """w0 roomiest, then w1, ... (one candidate order for every test)."""
    return [make_worker(f"w{i}", kv_total_tokens=100_000 - 1_000 * i, partition=i)
            for i in range(6)]


def test_a_room_filter_is_asked_per_batch_and_never_past_the_kth_admitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counting = _Counting(refused=["w0", "w2"])
    pipeline = with_filter(monkeypatch, counting, candidates=3)
    decisions = schedule(make_snapshot(roomy_fleet()), make_queue(make_request("r")), Ledger(),
                         pipeline, NOW, seeded(), max_placements=1)  # type: ignore[arg-type]
    assert isinstance(decisions[0], Placement)
    assert decisions[0].worker_id in {"w1", "w3", "w4"}
    # 3 wanted: w0..w2 give one, then 2 more (w3, w4) fill it; w5 is never asked about.
    assert counting.batches == [["w0", "w1", "w2"], ["w3", "w4"]]


def test_a_refusal_names_the_last_worker_refused_as_one_by_one_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counting = _Counting(refused=[f"w{i}" for i in range(6)])
    pipeline = with_filter(monkeypatch, counting, candidates=2)
    queue = make_queue(make_request("r"), make_request("h", priority="low"))
    ledger = Ledger()
    ledger.hold("w5", "h")  # w5, the last worker either is judged on, is kept for h
    decisions = schedule(make_snapshot(roomy_fleet()), queue, ledger, pipeline, NOW,
                         seeded())  # type: ignore[arg-type]
    assert {d.request_id: d for d in decisions} == {
        "r": Defer("r", "refused by hold"),
        "h": Defer("h", "refused by counting"),
    }


def test_a_room_filter_without_accepts_each_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugin = _PerWorkerOnly()
    assert not isinstance(plugin, RoomFilter)
    with pytest.raises(ConfigError, match="accepts_each"):
        with_filter(monkeypatch, plugin, candidates=8)
