"""Picker ``round-robin`` (baseline): the next worker after the last one placed on.

Formula: among the candidates, the smallest ``worker_id`` greater than the ledger's
``last_worker_id``; wrap around to the smallest ``worker_id`` when none is greater. Over a
stable fleet this visits every feasible worker in turn. Ignores scores.

Reads: ``worker.worker_id``; ``ledger.last_worker_id`` (the cursor lives in the ledger, so
the picker stays stateless).

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
        last = ctx.ledger.last_worker_id or ""
        after = [w for _, w in candidates if w.worker_id > last]
        pool = after if after else [w for _, w in candidates]
        return min(pool, key=lambda w: w.worker_id)


def factory(params: Params) -> RoundRobin:
    only(params, RoundRobin.name)
    return RoundRobin()
