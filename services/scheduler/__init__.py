"""llmq's scheduler: pending queue, placement and KV reservations.

This package owns the pure scheduling core (:mod:`.core`: queue with aging and lanes,
reservation ledger, the cycle) and the placement policies (:mod:`.policies`). The service
adapter (``app.py``: Faust agents, a fleet view read from llmq.heartbeats, timers) and the
simulator are its callers: they own one :class:`PendingQueue` and one :class:`Ledger`, build a
:class:`Snapshot` from heartbeats, call :func:`schedule`, publish the decisions, and report
terminal events back with :meth:`Ledger.release`. Nothing here performs I/O.

Typical loop::

    pipeline = build_pipeline(profile_mapping)          # once, from config
    pending, ledger = PendingQueue(QueueConfig()), Ledger(kv_safety_margin=0.05)
    ...
    pending.push(request)                               # admitted request arrives
    snapshot = Snapshot.of(workers, now)                # per batch of heartbeats
    for decision in schedule(snapshot, pending, ledger, pipeline, now, rng):
        publish(decision)                               # Placement / Defer / Reject
    ledger.mark_started(request_id, attempt)            # started event
    ledger.release(request_id, attempt)                 # done / failed / aborted event
    ledger.reconcile(worker_id, held_keys)              # heartbeat
    requeue_lost(ledger, worker_id, streamed)           # worker declared dead
    lease_refusal(asking, lost, newest)                 # a lapsed worker asks to go on
"""

from services.scheduler.core.affinity import AffinityMap
from services.scheduler.core.cycle import schedule
from services.scheduler.core.drain import DrainMeter
from services.scheduler.core.errors import ConfigError
from services.scheduler.core.lanes import DEFAULT_LANE_WEIGHTS, LaneInterleave
from services.scheduler.core.ledger import Ledger, Reservation
from services.scheduler.core.queue import ClassKey, PendingQueue, QueueConfig
from services.scheduler.core.recovery import lease_refusal, requeue_lost
from services.scheduler.core.types import (
    DEFAULT_STALE_AFTER_S,
    HEARTBEAT_INTERVAL_S,
    Decision,
    Defer,
    Placement,
    QueuedRequest,
    Reject,
    Requeue,
    ReservationKey,
    Snapshot,
    WorkerState,
)
from services.scheduler.policies.base import Filter, Picker, PlacementContext, Scorer
from services.scheduler.policies.profile import (
    BASELINE_PROFILES,
    DEFAULT_PROFILE,
    REQUIRED_FILTERS,
    Pipeline,
    Profile,
    build_pipeline,
)
from services.scheduler.policies.registry import REGISTRY, Factory

__all__ = [
    "BASELINE_PROFILES",
    "DEFAULT_LANE_WEIGHTS",
    "DEFAULT_PROFILE",
    "DEFAULT_STALE_AFTER_S",
    "HEARTBEAT_INTERVAL_S",
    "REGISTRY",
    "REQUIRED_FILTERS",
    "AffinityMap",
    "ClassKey",
    "ConfigError",
    "Decision",
    "Defer",
    "DrainMeter",
    "Factory",
    "Filter",
    "LaneInterleave",
    "Ledger",
    "PendingQueue",
    "Picker",
    "Pipeline",
    "Placement",
    "PlacementContext",
    "Profile",
    "QueueConfig",
    "QueuedRequest",
    "Reject",
    "Requeue",
    "Reservation",
    "ReservationKey",
    "Scorer",
    "Snapshot",
    "WorkerState",
    "build_pipeline",
    "lease_refusal",
    "requeue_lost",
    "schedule",
]
