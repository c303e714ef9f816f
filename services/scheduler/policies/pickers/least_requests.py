"""Picker ``least-requests`` (baseline): the worker with the fewest sequences in flight.

Formula: minimise ``ledger.in_flight(worker)`` (running + waiting + placed not yet
started); ties broken uniformly with the seeded ``rng``. Ignores scores.

Reads: ``worker.running``, ``worker.waiting``; the ledger.

Config (use ``candidates = 0`` so every feasible worker is a candidate)::

    picker = "least-requests"
    candidates = 0
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.scheduler.core.types import WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Scored
from services.scheduler.policies.params import only


class LeastRequests:
    name = "least-requests"
    uses_scores = False

    def pick(
        self, candidates: Sequence[Scored], rng: random.Random, ctx: PlacementContext
    ) -> WorkerState:
        in_flight = ctx.ledger.in_flight
        loads = [(in_flight(w), w) for _, w in candidates]
        fewest = min(load for load, _ in loads)
        tied = [w for load, w in loads if load == fewest]
        return tied[0] if len(tied) == 1 else rng.choice(tied)


def factory(params: Params) -> LeastRequests:
    only(params, LeastRequests.name)
    return LeastRequests()
