"""Picker ``max-score``: the candidate with the highest combined score.

Formula: choose uniformly (with the seeded ``rng``) among candidates whose score is within
``tie_epsilon`` of the best score. Deterministic for a given seed and candidate order.

Reads: the candidates' scores only.

Config::

    picker = "max-score"
    [params.max-score]
    tie_epsilon = 1e-9     # in [0, 0.5]; scores this close count as a tie
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from operator import itemgetter

from services.scheduler.core.types import WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Scored
from services.scheduler.policies.params import number, only


class MaxScore:
    name = "max-score"
    uses_scores = True

    def __init__(self, tie_epsilon: float = 1e-9) -> None:
        self.tie_epsilon = tie_epsilon

    def pick(
        self, candidates: Sequence[Scored], rng: random.Random, ctx: PlacementContext
    ) -> WorkerState:
        # A NaN score (a custom scorer's 0/0) would make max() NaN and tie nobody: only
        # finite scores compete, and with none every candidate ties.
        finite = [scored for scored in candidates if math.isfinite(scored[0])]
        if not finite:
            return rng.choice([w for _, w in candidates])
        floor = max(map(itemgetter(0), finite)) - self.tie_epsilon
        tied = [worker for score, worker in finite if score >= floor]
        return tied[0] if len(tied) == 1 else rng.choice(tied)


def factory(params: Params) -> MaxScore:
    only(params, MaxScore.name, ("tie_epsilon",))
    return MaxScore(number(params, MaxScore.name, "tie_epsilon", 1e-9, low=0.0, high=0.5))
