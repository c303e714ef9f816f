"""Filter ``lane-pool``: the worker's pool takes the request's lane.

Formula: accept ⇔ ``worker.pool == "any"`` or ``worker.pool == request.lane`` — a ``short``
pool takes only the short lane, a ``long`` pool only the long lane, ``any`` both (where the
lanes interleave by weight, see :mod:`services.scheduler.core.lanes`).

Reads: ``worker.pool``, ``request.lane``. Stage ``route``.

Config (required, no parameters)::

    filters = [..., "lane-pool", ...]
"""

from __future__ import annotations

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Stage
from services.scheduler.policies.params import only


class LanePool:
    name = "lane-pool"
    stage: Stage = "route"

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        return worker.pool == "any" or worker.pool == request.lane


def factory(params: Params) -> LanePool:
    only(params, LanePool.name)
    return LanePool()
