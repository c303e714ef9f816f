"""Scorer ``prefix-affinity``: prefer the worker that last served the same prompt prefix.

Formula: ``score = 1`` if ``request.prefix_hash`` is set and the ledger's affinity map
names this worker as the last one placed with that prefix, else ``0``. The cycle also
adds that worker to the candidates when it has room, even if it is not among the roomiest,
so affinity can win whenever its weight allows.

Reads: ``request.prefix_hash``; the ledger's affinity map (scheduler state, updated on
every placement).

Config (no parameters)::

    [scorers]
    prefix-affinity = 1.0
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext
from services.scheduler.policies.params import only


class PrefixAffinity:
    name = "prefix-affinity"

    def scores(
        self, workers: Sequence[WorkerState], request: QueuedRequest, ctx: PlacementContext
    ) -> list[float]:
        last = ctx.ledger.affinity.get(request.prefix_hash)
        if last is None:  # no prefix, or none remembered: nothing to compare
            return [0.0] * len(workers)
        return [1.0 if w.worker_id == last else 0.0 for w in workers]


def factory(params: Params) -> PrefixAffinity:
    only(params, PrefixAffinity.name)
    return PrefixAffinity()
