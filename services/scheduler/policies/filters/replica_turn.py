"""Filter ``replica-turn``: with several scheduler replicas, each worker takes new work from
one replica at a time, in turns.

Formula: each worker's time is cut into slots of ``slot_s`` seconds, shifted by a phase
``φ(W)`` in [0, 1) of a slot; in its slot ``k`` worker ``W`` is the turn of replica
``(k + s(W)) mod replicas``, except for ``guard_s`` at each end of the slot, when it is
nobody's (:func:`turn_of`). ``φ`` and ``s`` come from a hash of the worker's id (blake2b:
crc32, used before, is linear, and similar ids such as ``fake-0`` … ``fake-3`` all got
the same turns). Accept ⇔ it is this replica's turn (``index``) and the log of
placements was read up to the start of this turn (``snapshot.log_read_at``, below).

Why: replicas share the request topics (one consumer group) and place each from its own
requests; each learns the others' placements only by reading them back from the log. Two
placing on one worker at the same moment both see its KV free and together overcommit it
(measured with two replicas and a burst: 25 of 60 placements went past a worker's usable
KV). In turns, a replica places on a worker only ``2 × guard_s`` after the one before
stopped, and only once its log reader has read, in a fetch answered ``guard_s`` or more
after the turn began, every assignment written before it (``Snapshot.log_read_at``: the
runtime's ``LogReader.caught_up_at``; infinite in the simulator and for one replica): the
last placements of the replica before are then in its ledger. The budget for them:
placed by the other replica before ``b - guard_s`` on its clock (``b``, the turn's
start), read here in a fetch the broker answered by ``b + guard_s``, less the fetch's
round trip (``caught_up_at`` is when the answer was read, not when the broker built it):
the clocks' difference, the write and that round trip must fit in ``2 × guard_s``
together (with ``b`` alone, as first written, in one ``guard_s``; found by an audit).
Releases need no turn: a replica that has not read one yet only sees less room than
there is.

Staggered in phase as well as in order, the turns of a fleet's workers begin at different
moments: every replica has about ``1/replicas`` of the fleet at any moment, and a replica
with none of a route's workers waits for the next one whose turn comes to it, not for a
slot boundary shared by the whole fleet (when every worker was between turns, and then
every replica waited for its log read: measured with two replicas and four idle workers,
high-class requests waited p50 168 ms, p99 631 ms for a placement). A request still waits
at most one rotation (``replicas × slot_s``) for a given worker of its route.

Reads: the worker's id, ``ctx.now`` and ``ctx.snapshot.log_read_at``. Stage ``room``
(asked per batch of candidates).

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

import hashlib
import math
from collections.abc import Sequence
from functools import lru_cache

from services.scheduler.core.errors import ConfigError
from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Stage
from services.scheduler.policies.params import number, only

DEFAULT_SLOT_S = 0.5
DEFAULT_GUARD_S = 0.05


@lru_cache(maxsize=1 << 16)
def _spread(worker_id: str) -> tuple[float, int]:
    """The worker's phase (a fraction of a slot) and first turn, from a hash of its id:
    the same in every replica and process."""
    value = int.from_bytes(hashlib.blake2b(worker_id.encode(), digest_size=8).digest(), "big")
    return (value & 0xFFFF_FFFF) / 2**32, value >> 32


def _slot(worker_id: str, now: float, slot_s: float) -> tuple[int, float]:
    """The worker's slot at ``now``, and when (wall time) that slot began."""
    phase, _ = _spread(worker_id)
    slot = math.floor(now / slot_s + phase)
    return slot, (slot - phase) * slot_s


def _turn(worker_id: str, now: float, replicas: int, slot_s: float,
          guard_s: float) -> tuple[int | None, float]:
    """:func:`turn_of` and :func:`turn_began` in one (the filter asks both per candidate)."""
    slot, began = _slot(worker_id, now, slot_s)
    into = now - began
    if into < guard_s or into >= slot_s - guard_s:
        return None, began
    return (slot + _spread(worker_id)[1]) % replicas, began


def turn_of(worker_id: str, now: float, replicas: int, slot_s: float,
            guard_s: float) -> int | None:
    """The replica whose turn it is on ``worker_id`` at ``now`` (None: between turns)."""
    return _turn(worker_id, now, replicas, slot_s, guard_s)[0]


def turn_began(worker_id: str, now: float, slot_s: float) -> float:
    """When the slot of ``worker_id`` that holds ``now`` began (wall time, seconds): the
    assignments written before then must have been read before placing in its turn."""
    return _slot(worker_id, now, slot_s)[1]


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
        turn, began = _turn(worker.worker_id, ctx.now, self.replicas, self.slot_s,
                            self.guard_s)
        return turn == self.index and ctx.snapshot.log_read_at >= began + self.guard_s

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
    guard_s = number(params, name, "guard_s", DEFAULT_GUARD_S, low=0.0, high=3600.0,
                     low_open=True)  # 0: no time to read the last turn's placements back
    if 2 * guard_s >= slot_s:
        raise ConfigError(f"params.{name}.guard_s", f"must be below slot_s / 2 ({slot_s / 2}), "
                          f"got {guard_s}")
    return ReplicaTurn(int(replicas), int(index), slot_s, guard_s)
