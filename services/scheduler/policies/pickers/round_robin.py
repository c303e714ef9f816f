"""Picker ``round-robin`` (baseline): the next worker after the last one placed on.

Formula: among the candidates, the smallest ``worker_id`` greater than the worker of the
last placement on the request's route (model, version, lane); wrap around to the smallest
``worker_id`` when none is greater. Over a stable fleet this visits every feasible worker of
the route in turn. One cursor per route: with a fleet-wide cursor, lanes (or models) taking
turns would each find the other's last worker and keep wrapping to their own first one.
Ignores scores.

Reads: ``worker.worker_id``; ``ledger.last_worker_on(ctx.route)`` (the cursors live in the
ledger, so the picker stays stateless; without a route, the fleet-wide
``ledger.last_worker_id``).

Config (use ``candidates = 0`` so every feasible worker is a candidate)::

    picker = "round-robin"
    candidates = 0
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.scheduler.core.types import WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Scored
from services.scheduler.policies.params import only


class RoundRobin:
    name = "round-robin"
    uses_scores = False

    def pick(
        self, candidates: Sequence[Scored], rng: random.Random, ctx: PlacementContext
    ) -> WorkerState:
        ledger = ctx.ledger
        last = (ledger.last_worker_id if ctx.route is None
                else ledger.last_worker_on(ctx.route)) or ""
        after = [w for _, w in candidates if w.worker_id > last]
        pool = after if after else [w for _, w in candidates]
        return min(pool, key=lambda w: w.worker_id)


def factory(params: Params) -> RoundRobin:
    only(params, RoundRobin.name)
    return RoundRobin()
