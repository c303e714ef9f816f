"""Scorer ``queue-depth``: prefer the worker with fewer sequences running or queued.

Formula: ``score = 1 − min(1, in_flight / max_num_seqs)`` (0 when max_num_seqs is 0)
where ``in_flight = max(running + waiting, reservations started) + reservations not yet
started`` (the ledger's count), so assignments still on their way count as load even
before the next heartbeat shows them.

Reads: ``worker.running``, ``worker.waiting``, ``worker.max_num_seqs``; the ledger.

Config (no parameters)::

    [scorers]
    queue-depth = 1.0
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext
from services.scheduler.policies.params import only


class QueueDepth:
    name = "queue-depth"

    def scores(
        self, workers: Sequence[WorkerState], request: QueuedRequest, ctx: PlacementContext
    ) -> list[float]:
        in_flight_of = ctx.ledger.in_flight
        shares: list[float] = []
        for worker in workers:  # the formula inline: a helper call per worker cost ~1 %
            in_flight, slots = in_flight_of(worker), worker.max_num_seqs
            shares.append(1.0 - in_flight / slots if 0 <= in_flight < slots else 0.0)
        return shares


def factory(params: Params) -> QueueDepth:
    only(params, QueueDepth.name)
    return QueueDepth()
