"""Filter ``replica-turn``: with several scheduler replicas, each worker takes new work from
one replica at a time, in turns.

Formula: time is cut into slots of ``slot_s`` seconds; in slot ``k`` worker ``W`` is the
turn of replica ``(k + crc32(W)) mod replicas``, except for ``guard_s`` at each end of the
slot, when it is nobody's (:func:`turn_of`). Accept ⇔ it is this replica's turn
(``index``).

Why: replicas share the request topics (one consumer group) and place each from its own
requests; each learns the others' placements only by reading them back from the log. Two
placing on one worker at the same moment both see its KV free and together overcommit it
(measured with two replicas and a burst: 25 of 60 placements went past a worker's usable
KV). In turns, a replica places on a worker only ``2 × guard_s`` after the one before
stopped: time for that one's placements to be written and read back, so the ledger holds
them. Staggered by the worker's hash, every replica has about ``1/replicas`` of the fleet
at any moment; a request waits at most one rotation (``replicas × slot_s``) for a worker
of its route. Releases need no turn: a replica that has not read one yet only sees less
room than there is.

Reads: the worker's id and ``ctx.now``. Stage ``room`` (asked per batch of candidates).

Config: the scheduler adds it when ``LLMQ_SCHEDULER_REPLICAS`` > 1
(:meth:`services.scheduler.settings.SchedulerSettings.profile`); a profile need not name
it::

    filters = [..., "replica-turn"]
    [params.replica-turn]
    replicas = 2        # replicas placing on the fleet, >= 1
    index = 0           # this replica, in [0, replicas)
    slot_s = 0.5        # length of a turn
    guard_s = 0.05      # nobody's at each end of a turn, < slot_s / 2
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

from services.scheduler.core.errors import ConfigError
from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Stage
from services.scheduler.policies.params import number, only

DEFAULT_SLOT_S = 0.5
DEFAULT_GUARD_S = 0.05


def turn_of(worker_id: str, now: float, replicas: int, slot_s: float,
            guard_s: float) -> int | None:
    """The replica whose turn it is on ``worker_id`` at ``now`` (None: between turns)."""
    slot = math.floor(now / slot_s)
    into = now - slot * slot_s
    if into < guard_s or into >= slot_s - guard_s:
        return None
    return (slot + zlib.crc32(worker_id.encode())) % replicas


class ReplicaTurn:
    name = "replica-turn"
    stage: Stage = "room"

    def __init__(self, replicas: int, index: int, slot_s: float = DEFAULT_SLOT_S,
                 guard_s: float = DEFAULT_GUARD_S) -> None:
        self.replicas = replicas
        self.index = index
        self.slot_s = slot_s
        self.guard_s = guard_s

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        return turn_of(worker.worker_id, ctx.now, self.replicas, self.slot_s,
                       self.guard_s) == self.index

    def accepts_each(
        self, workers: Sequence[WorkerState], request: QueuedRequest, ctx: PlacementContext
    ) -> list[bool]:
        return [self.accepts(w, request, ctx) for w in workers]


def factory(params: Params) -> ReplicaTurn:
    name = ReplicaTurn.name
    only(params, name, ("replicas", "index", "slot_s", "guard_s"))
    replicas = number(params, name, "replicas", 1, low=1, high=1024)
    index = number(params, name, "index", 0, low=0, high=1023)
    for key, value in (("replicas", replicas), ("index", index)):
        if value != int(value):
            raise ConfigError(f"params.{name}.{key}", f"must be an integer, got {value!r}")
    if index >= replicas:
        raise ConfigError(f"params.{name}.index", f"must be below replicas ({int(replicas)}), "
                          f"got {int(index)}")
    slot_s = number(params, name, "slot_s", DEFAULT_SLOT_S, low=0.0, high=3600.0,
                    low_open=True)
    guard_s = number(params, name, "guard_s", DEFAULT_GUARD_S, low=0.0, high=3600.0)
    if 2 * guard_s >= slot_s:
        raise ConfigError(f"params.{name}.guard_s", f"must be below slot_s / 2 ({slot_s / 2}), "
                          f"got {guard_s}")
    return ReplicaTurn(int(replicas), int(index), slot_s, guard_s)
