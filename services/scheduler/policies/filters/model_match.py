"""Filter ``model-match``: the worker serves the request's model, and version if pinned.

Formula: accept ⇔ ``worker.model == request.model`` and (``request.model_version`` is None
or ``worker.model_version == request.model_version``).

Reads: the worker's and the request's model and model_version. Stage ``route``.

Config (required in every profile, no parameters)::

    filters = ["model-match", "lane-pool", "fresh-heartbeat", "not-draining", "kv-fits",
               "seq-slots"]
"""

from __future__ import annotations

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Stage
from services.scheduler.policies.params import only


class ModelMatch:
    name = "model-match"
    stage: Stage = "route"

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        if worker.model != request.model:
            return False
        return request.model_version is None or worker.model_version == request.model_version


def factory(params: Params) -> ModelMatch:
    only(params, ModelMatch.name)
    return ModelMatch()
