"""Picker ``random`` (baseline): a uniformly random feasible worker.

Formula: ``rng.choice(candidates)`` with the seeded ``rng``. Ignores scores.

Reads: nothing but the candidate list.

Config (use ``candidates = 0`` so every feasible worker is a candidate)::

    picker = "random"
    candidates = 0
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.scheduler.core.types import WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Scored
from services.scheduler.policies.params import only


class RandomPick:
    name = "random"
    uses_scores = False

    def pick(
        self, candidates: Sequence[Scored], rng: random.Random, ctx: PlacementContext
    ) -> WorkerState:
        return rng.choice(candidates)[1]


def factory(params: Params) -> RandomPick:
    only(params, RandomPick.name)
    return RandomPick()
