"""Filter ``fresh-heartbeat``: the worker's last heartbeat is recent.

Formula: accept ⇔ ``snapshot.now − worker.heartbeat_ts ≤ min(max_age_s, stale_after_s)``.
Fail closed: a stale worker is treated as full. The core also drops workers older than the
snapshot's ``stale_after_s`` on its own; ``max_age_s`` can only tighten that.

Reads: ``worker.heartbeat_ts``, ``snapshot.now``, ``snapshot.stale_after_s``. Stage
``route`` (judged at the snapshot's ``now``).

Config (required)::

    filters = [..., "fresh-heartbeat", ...]
    [params.fresh-heartbeat]
    max_age_s = 2.0        # > 0; default: the snapshot's stale_after_s (3 intervals)
"""

from __future__ import annotations

import math

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Stage
from services.scheduler.policies.params import number, only


class FreshHeartbeat:
    name = "fresh-heartbeat"
    stage: Stage = "route"

    def __init__(self, max_age_s: float = math.inf) -> None:
        self.max_age_s = max_age_s

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        snapshot = ctx.snapshot
        age = snapshot.now - worker.heartbeat_ts
        return age <= snapshot.stale_after_s and age <= self.max_age_s


def factory(params: Params) -> FreshHeartbeat:
    only(params, FreshHeartbeat.name, ("max_age_s",))
    if "max_age_s" not in params:
        return FreshHeartbeat()
    max_age_s = number(
        params, FreshHeartbeat.name, "max_age_s", 0.0, low=0.0, high=3600.0, low_open=True
    )
    return FreshHeartbeat(max_age_s)
