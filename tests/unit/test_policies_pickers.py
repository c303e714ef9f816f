"""Pickers: max-score with seeded ties, and the baselines (policies.pickers)."""

from __future__ import annotations

import math
import random
from collections import Counter

from services.scheduler import Ledger, Picker, Placement, PlacementContext, build_pipeline, schedule
from services.scheduler.policies.pickers import least_requests, max_score, random_pick, round_robin
from services.scheduler.policies.profile import REQUIRED_FILTERS
from tests.builders import NOW, make_queue, make_request, make_snapshot, make_worker

A, B, C = make_worker("a"), make_worker("b", running=3), make_worker("c", running=1)


def ctx(ledger: Ledger | None = None) -> PlacementContext:
    return PlacementContext(make_snapshot([A, B, C]), ledger or Ledger(), NOW)


def test_max_score_takes_the_best() -> None:
    picker = max_score.factory({})
    assert picker.pick([(0.2, A), (0.9, B), (0.5, C)], random.Random(1), ctx()) is B


def test_max_score_breaks_ties_with_the_seeded_rng() -> None:
    picker = max_score.factory({"tie_epsilon": 0.05})
    tied = [(0.5, A), (0.52, B), (0.1, C)]
    chosen = {picker.pick(tied, random.Random(seed), ctx()).worker_id for seed in range(40)}
    assert chosen == {"a", "b"}
    first = [picker.pick(tied, random.Random(3), ctx()).worker_id for _ in range(5)]
    assert len(set(first)) == 1  # same seed, same choice


def test_round_robin_walks_worker_ids_from_the_last_placement() -> None:
    ledger, picker = Ledger(), round_robin.factory({})
    candidates = [(0.0, C), (0.0, A), (0.0, B)]
    order = []
    for i in range(4):
        worker = picker.pick(candidates, random.Random(0), ctx(ledger))
        ledger.reserve(worker, make_request(f"r{i}"))
        order.append(worker.worker_id)
    assert order == ["a", "b", "c", "a"]


def test_least_requests_counts_in_flight() -> None:
    ledger = Ledger()
    ledger.reserve(A, make_request("x"))
    ledger.reserve(A, make_request("y"))  # a: 2 in flight; c: 1 running; b: 3
    assert (
        least_requests.factory({}).pick(
            [(1.0, A), (0.0, B), (0.0, C)], random.Random(0), ctx(ledger)
        )
        is C
    )


def test_random_uses_only_the_rng() -> None:
    picker = random_pick.factory({})
    candidates = [(1.0, A), (0.0, B), (0.0, C)]
    seen = {picker.pick(candidates, random.Random(s), ctx()).worker_id for s in range(30)}
    assert seen == {"a", "b", "c"}


def test_baselines_ignore_scores_and_max_score_does_not() -> None:
    for module, uses in [
        (max_score, True),
        (round_robin, False),
        (least_requests, False),
        (random_pick, False),
    ]:
        picker = module.factory({})
        assert isinstance(picker, Picker) and picker.uses_scores is uses


def test_round_robin_keeps_one_cursor_per_route() -> None:
    # Short and long requests take turns; with a fleet-wide cursor the long pool's worker
    # (z0, sorting after the short ones) sent every short request back to s0.
    workers = [make_worker(f"s{i}", pool="short", partition=i) for i in range(3)]
    workers.append(make_worker("z0", pool="long", partition=3))
    snapshot = make_snapshot(workers)
    pipeline = build_pipeline({"filters": list(REQUIRED_FILTERS), "scorers": {},
                               "picker": "round-robin", "candidates": 0})
    ledger, rng = Ledger(), random.Random(1)
    used: Counter[str] = Counter()
    for i in range(12):
        lane = "short" if i % 2 == 0 else "long"
        queue = make_queue(make_request(f"r{i}", lane=lane, enqueued_at=NOW + i))
        for d in schedule(snapshot, queue, ledger, pipeline, NOW + i, rng):
            if isinstance(d, Placement) and lane == "short":
                used[d.worker_id] += 1
    assert used == Counter({"s0": 2, "s1": 2, "s2": 2})


def test_max_score_ignores_a_nan_score() -> None:
    picker = max_score.factory({})
    assert picker.pick([(math.nan, A), (0.5, B)], random.Random(1), ctx()) is B
    everyone = {picker.pick([(math.nan, A), (math.nan, B)], random.Random(s), ctx()).worker_id
                for s in range(20)}
    assert everyone == {"a", "b"}  # none finite: every candidate ties
