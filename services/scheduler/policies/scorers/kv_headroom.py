"""Scorer ``kv-headroom``: prefer the worker with the most free KV, relative to its size.

Formula: ``score = free_kv / usable_kv`` in [0, 1] (0 when usable is 0), with ``free_kv``
and ``usable_kv`` as the ledger computes them. Spreading load by headroom leaves every
worker slack for decode growth (reservations cover max_tokens, engines allocate as they
go) and keeps preemption rare; a large request that finds no room anywhere is protected by
the cycle's hold instead of by packing.

Reads: the ledger's reservations on the worker; ``worker.kv_total_tokens``,
``worker.kv_free_tokens``.

Config (no parameters)::

    [scorers]
    kv-headroom = 2.0
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext
from services.scheduler.policies.params import only


class KvHeadroom:
    name = "kv-headroom"

    def scores(
        self, workers: Sequence[WorkerState], request: QueuedRequest, ctx: PlacementContext
    ) -> list[float]:
        headroom = ctx.ledger.headroom
        return [headroom(w) for w in workers]


def factory(params: Params) -> KvHeadroom:
    only(params, KvHeadroom.name)
    return KvHeadroom()
