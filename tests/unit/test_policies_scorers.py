"""Scorers: formulas and the [0, 1] range (policies.scorers)."""

from __future__ import annotations

from types import ModuleType

import pytest

from services.scheduler import Ledger, PlacementContext, QueuedRequest, Scorer, WorkerState
from services.scheduler.policies.scorers import (
    kv_headroom,
    prefix_affinity,
    queue_depth,
    throughput,
)
from tests.builders import NOW, make_request, make_snapshot, make_worker


def scores(
    scorer: Scorer,
    workers: list[WorkerState],
    request: QueuedRequest | None = None,
    ledger: Ledger | None = None,
) -> list[float]:
    ctx = PlacementContext(make_snapshot(workers), ledger or Ledger(), NOW)
    return scorer.scores(workers, request or make_request(), ctx)


def test_kv_headroom_is_free_over_usable() -> None:
    ledger = Ledger()
    a, b, c = make_worker("a"), make_worker("b"), make_worker("c", kv_total_tokens=0)
    ledger.reserve(b, make_request("x", kv_tokens=47_500))
    assert scores(kv_headroom.factory({}), [a, b, c], ledger=ledger) == [1.0, 0.5, 0.0]


@pytest.mark.parametrize(
    ("running", "waiting", "max_num_seqs", "score"),
    [(0, 0, 4, 1.0), (1, 0, 4, 0.75), (2, 2, 4, 0.0), (9, 0, 4, 0.0), (0, 0, 0, 0.0)],
)
def test_queue_depth(running: int, waiting: int, max_num_seqs: int, score: float) -> None:
    worker = make_worker(running=running, waiting=waiting, max_num_seqs=max_num_seqs)
    assert scores(queue_depth.factory({}), [worker]) == [score]


def test_throughput_is_relative_to_the_fleet_best() -> None:
    workers = [
        make_worker("a", running=8, tokens_per_s=2_000.0),
        make_worker("b", running=8, tokens_per_s=500.0),
        make_worker("c", running=8, tokens_per_s=0.0),  # all of them in prefill
    ]
    assert scores(throughput.factory({}), workers) == [1.0, 0.25, 0.0]
    stuck = [make_worker("a", running=3, tokens_per_s=0.0)]
    assert scores(throughput.factory({}), stuck) == [0.0]


def test_throughput_scores_are_numbers_in_0_1_at_the_float_edges() -> None:
    # A fleet best of 5e-324 made 1/best infinite: 0 tokens/s scored 0·inf = NaN, and the
    # picker dropped that worker. Infinite rates (never on the wire, but a core input).
    tiny = [make_worker("a", running=3, tokens_per_s=5e-324),
            make_worker("b", running=3, tokens_per_s=0.0)]
    assert scores(throughput.factory({}), tiny) == [1.0, 0.0]
    huge = [make_worker("a", running=3, tokens_per_s=float("inf")),
            make_worker("b", running=3, tokens_per_s=1.0)]
    assert scores(throughput.factory({}), huge) == [0.0, 0.0]  # inf / inf is unknown


def test_throughput_of_an_idle_worker_is_unknown_not_zero() -> None:
    """Running nothing, it generates nothing: scoring that 0 made its busy twin win every
    tie and draw still more work."""
    busy, idle = make_worker("busy", running=4, tokens_per_s=900.0), \
        make_worker("idle", running=0, tokens_per_s=0.0)
    assert scores(throughput.factory({}), [busy, idle]) == [1.0, 1.0]
    assert scores(throughput.factory({}), [idle]) == [1.0]


def test_prefix_affinity_names_the_last_worker_for_the_prefix() -> None:
    ledger = Ledger()
    a, b = make_worker("a"), make_worker("b")
    ledger.reserve(b, make_request("x", prefix_hash="p"))
    scorer = prefix_affinity.factory({})
    assert scores(scorer, [a, b], make_request(prefix_hash="p"), ledger) == [0.0, 1.0]
    assert scores(scorer, [a, b], make_request(prefix_hash="q"), ledger) == [0.0, 0.0]
    assert scores(scorer, [a, b], make_request(), ledger) == [0.0, 0.0]


@pytest.mark.parametrize("module", [kv_headroom, queue_depth, throughput, prefix_affinity])
def test_every_scorer_stays_in_the_unit_interval(module: ModuleType) -> None:
    ledger = Ledger()
    workers = [
        make_worker("a", kv_free_tokens=0, running=300, tokens_per_s=-5.0),
        make_worker("b", kv_total_tokens=7, kv_free_tokens=100),
        make_worker("c", tokens_per_s=1e9),
    ]
    ledger.reserve(workers[2], make_request("x", prefix_hash="p", kv_tokens=95_000))
    scorer = module.factory({})
    assert isinstance(scorer, Scorer)
    values = scores(scorer, workers, make_request(prefix_hash="p"), ledger)
    assert len(values) == 3 and all(0.0 <= v <= 1.0 for v in values)
