"""Scorer ``throughput``: prefer the worker that has recently generated tokens fastest.

Formula: ``score = tokens_per_s / max(tokens_per_s over fresh workers)``, clipped to
[0, 1]; a worker running nothing scores 1. Relative to the fleet's best, so the score means
the same on slow and fast hardware.

An idle worker generates nothing, so its measured throughput is 0: scored as such, it lost
every tie to a busy twin, which drew still more work (a live fleet of three showed an idle
worker getting almost none at low load). Its speed is unknown, not slow, so it gets the
benefit of the doubt. Among busy workers the measure still grows with the batch, and at low
load it still decides between two busy ones (one request moves ``queue-depth`` by only
1/max_num_seqs): a live pair of sim workers at 1–4 requests/s split the work 39/21 to 16/44
(60/0 to 0/60 before). Per-sequence speed (tokens/s ÷ running) would favour the lighter
one, but measured mixed on the policy benchmark (docs/benchmarks.md, "Seventh round").

Reads: ``worker.tokens_per_s``, ``worker.running``; the snapshot (its fleet maximum,
computed once).

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
        if not best > 0.0:  # nothing measured (also NaN)
            return [1.0 if w.running <= 0 else 0.0 for w in workers]
        # Divided, not multiplied by 1/best: a best of 5e-324 made 1/best infinite and a
        # busy worker at 0 tokens/s score 0·inf = NaN, which dropped it from the picker.
        return [1.0 if w.running <= 0 else _clip(w.tokens_per_s / best) for w in workers]


def _clip(x: float) -> float:
    """Into [0, 1]; not a number (inf / inf) is 0."""
    if not x >= 0.0:
        return 0.0
    return 1.0 if x > 1.0 else x


def factory(params: Params) -> Throughput:
    only(params, Throughput.name)
    return Throughput()
