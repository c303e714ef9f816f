"""Every placement plugin by name — the one place plugins are registered.

A profile names plugins; :func:`services.scheduler.policies.profile.build_pipeline` looks
them up here and calls the factory with the plugin's ``params`` table (empty by default).
Adding a policy = one module under filters/, scorers/ or pickers/ + one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from services.scheduler.policies.base import Params, Plugin
from services.scheduler.policies.filters import (
    class_reserve,
    fresh_heartbeat,
    kv_fits,
    lane_pool,
    model_match,
    not_draining,
    replica_turn,
    seq_slots,
)
from services.scheduler.policies.pickers import least_requests, max_score, random_pick, round_robin
from services.scheduler.policies.scorers import (
    kv_headroom,
    prefix_affinity,
    queue_depth,
    throughput,
)

Factory = Callable[[Params], Plugin]

REGISTRY: Final[dict[str, Factory]] = {
    # filters
    "model-match": model_match.factory,
    "lane-pool": lane_pool.factory,
    "fresh-heartbeat": fresh_heartbeat.factory,
    "not-draining": not_draining.factory,
    "kv-fits": kv_fits.factory,
    "seq-slots": seq_slots.factory,
    "class-reserve": class_reserve.factory,
    "replica-turn": replica_turn.factory,
    # scorers
    "kv-headroom": kv_headroom.factory,
    "queue-depth": queue_depth.factory,
    "throughput": throughput.factory,
    "prefix-affinity": prefix_affinity.factory,
    # pickers
    "max-score": max_score.factory,
    "round-robin": round_robin.factory,
    "least-requests": least_requests.factory,
    "random": random_pick.factory,
}
