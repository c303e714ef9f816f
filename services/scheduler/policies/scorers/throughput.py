"""Scorer ``throughput``: prefer the worker that has recently generated tokens fastest.

Formula: ``score = tokens_per_s / max(tokens_per_s over fresh workers)``, clipped to
[0, 1]; 0 when no fresh worker reports any throughput. Relative to the fleet's best, so
the score means the same on slow and fast hardware.

Reads: ``worker.tokens_per_s``; the snapshot (its fleet maximum, computed once).

Config (no parameters)::

    [scorers]
    throughput = 0.5
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext
from services.scheduler.policies.params import only


class Throughput:
    name = "throughput"

    def scores(
        self, workers: Sequence[WorkerState], request: QueuedRequest, ctx: PlacementContext
    ) -> list[float]:
        best = ctx.max_tokens_per_s
        if best <= 0.0:
            return [0.0] * len(workers)
        scale = 1.0 / best
        return [_clip(w.tokens_per_s * scale) for w in workers]


def _clip(x: float) -> float:
    return 0.0 if x < 0.0 else (1.0 if x > 1.0 else x)


def factory(params: Params) -> Throughput:
    only(params, Throughput.name)
    return Throughput()
