"""Filter ``not-draining``: the worker is not draining.

Formula: accept ⇔ ``not worker.draining``. A draining worker finishes its in-flight work
and leaves; it takes nothing new.

Reads: ``worker.draining``. Stage ``route``.

Config (required, no parameters)::

    filters = [..., "not-draining", ...]
"""

from __future__ import annotations

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Stage
from services.scheduler.policies.params import only


class NotDraining:
    name = "not-draining"
    stage: Stage = "route"

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        return not worker.draining


def factory(params: Params) -> NotDraining:
    only(params, NotDraining.name)
    return NotDraining()
