"""The values the scheduler decides over, and the decisions it returns.

Everything here is a frozen, slotted dataclass: a request waiting in the pending queue, a
worker's state as its last heartbeat reported it, the snapshot of the fleet one cycle sees,
and the four decision kinds. Adapters turn decisions into Kafka messages; the core never
performs a side effect.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final

from schemas.common import ErrorCode, Lane, Phase, Pool, Priority, Role

#: Heartbeats are sent every second; three missed ones make a worker stale (DESIGN.md).
HEARTBEAT_INTERVAL_S: Final = 1.0
DEFAULT_STALE_AFTER_S: Final = 3 * HEARTBEAT_INTERVAL_S

#: A reservation's identity: a request may be placed again (attempt + 1) after worker loss.
ReservationKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """An admitted request waiting for a worker.

    ``kv_tokens`` is the KV reservation ingest computed (prompt + max_tokens, rounded up to
    whole blocks); the scheduler reserves exactly that. ``enqueued_at`` and ``deadline`` are
    absolute times in seconds on the same clock as ``now``. ``attempt`` grows by one each
    time the request is requeued after a worker loss.

    ``phase`` is ``whole`` for a request as admitted. On a fleet with prefill and decode
    workers the cycle places it as a ``prefill`` stage (``kv_tokens`` = the prompt's
    blocks, ``decode_kv_tokens`` = the whole reservation it had); when the prompt is
    computed, :meth:`handoff` gives the ``decode`` stage (the next attempt) that goes back
    into the queue. A decode stage's ``kv_engine`` names the engine that holds its prompt's
    KV (the prefill's ``kv_transfer["engine"]``): only a decode worker of that engine can
    pull it (None: unknown, any decode worker); ``kv_version``, the prefill worker's model
    version: only a decode worker of that version may decode it, with the weights that
    computed it (None: unknown, any).
    """

    request_id: str
    tenant: str
    model: str
    model_version: str | None
    priority: Priority
    lane: Lane
    prompt_tokens: int
    max_tokens: int
    kv_tokens: int
    enqueued_at: float
    deadline: float | None = None
    attempt: int = 0
    prefix_hash: str | None = None
    phase: Phase = "whole"
    decode_kv_tokens: int | None = None
    kv_engine: str | None = None
    kv_version: str | None = None

    def __post_init__(self) -> None:
        # A zero reservation would "fit" a worker with no free sequence slot.
        if self.kv_tokens < 1:
            raise ValueError(f"{self.request_id}: kv_tokens must be >= 1, got {self.kv_tokens}")
        if self.attempt < 0:
            raise ValueError(f"{self.request_id}: attempt must be >= 0, got {self.attempt}")

    @property
    def key(self) -> ReservationKey:
        return (self.request_id, self.attempt)

    def as_whole(self, attempt: int) -> QueuedRequest:
        """This request at ``attempt`` as a whole request again (a lost stage is placed
        from the start: its prompt's KV went with the worker)."""
        if self.phase == "prefill":
            if self.decode_kv_tokens is None:
                raise ValueError(f"{self.request_id}: a prefill stage without its reservation")
            return replace(self, phase="whole", kv_tokens=self.decode_kv_tokens,
                           decode_kv_tokens=None, attempt=attempt)
        return replace(self, phase="whole", attempt=attempt, kv_engine=None, kv_version=None)

    def handoff(self, kv_engine: str | None = None,
                kv_version: str | None = None) -> QueuedRequest:
        """The decode stage of this placed prefill stage: the next attempt (a new
        placement of the request, as after a requeue), same times, the whole reservation
        again; ``kv_engine`` and ``kv_version``: the engine and model version of the
        prefill worker, which holds the prompt's KV."""
        if self.phase != "prefill" or self.decode_kv_tokens is None:
            raise ValueError(f"{self.request_id}: only a prefill stage hands off")
        return replace(self, phase="decode", kv_tokens=self.decode_kv_tokens,
                       decode_kv_tokens=None, attempt=self.attempt + 1, kv_engine=kv_engine,
                       kv_version=kv_version)


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One worker as its latest heartbeat describes it.

    ``kv_free_tokens`` is what the engine reports free right now; it is advisory (see
    :meth:`Ledger.free_kv`). ``running`` and ``waiting`` are the engine's own sequence
    counts, ``tokens_per_s`` its recent generation throughput. ``role`` says which phases
    it runs (``schemas.common.Role``; ``mixed``, the default, runs requests whole).
    ``engine`` is the heartbeat's (``sim``, ``vllm``, ``openai``): a prompt's KV passes
    only between a prefill and a decode worker of the same engine (None: not reported,
    which pairs only with another None).
    """

    worker_id: str
    model: str
    model_version: str | None
    pool: Pool
    partition: int
    kv_total_tokens: int
    kv_free_tokens: int
    block_size: int
    running: int
    waiting: int
    max_num_seqs: int
    draining: bool
    heartbeat_ts: float
    tokens_per_s: float
    role: Role = "mixed"
    engine: str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    """The fleet as one scheduling cycle sees it; never changes while the cycle runs.

    Fail closed: a worker whose heartbeat is older than ``stale_after_s`` at ``now`` counts
    as full — it is never a candidate, whatever the profile says — and an empty fleet is a
    saturated fleet (requests are deferred, not rejected).

    ``memo`` holds indexes derived from the snapshot (candidate lists per route, fleet
    maxima). They are built on first use, so a caller that reuses one snapshot across many
    ``schedule()`` calls — between two batches of heartbeats — pays for them once.

    ``recent`` are workers heard from lately but not fresh now (restarting, late): never a
    candidate either, but a request only they could take waits for them (Defer) instead of
    being refused as one no worker serves (``unknown_model`` / ``too_large``, which clients
    do not retry): a rolling restart of a model's only worker refused its queue.
    """

    workers: Mapping[str, WorkerState]
    now: float
    stale_after_s: float = DEFAULT_STALE_AFTER_S
    #: Every assignment written before this wall time (seconds) is in the ledger. With
    #: several scheduler replicas, a worker takes work from a replica in its turn only
    #: once that replica read the log up to the turn's start (filter ``replica-turn``).
    #: Infinite: the ledger is the whole truth (one replica; the simulator).
    log_read_at: float = math.inf
    recent: tuple[WorkerState, ...] = ()
    memo: dict[object, object] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {self.stale_after_s}")
        # Read-only view: the indexes in ``memo`` assume the fleet does not change.
        object.__setattr__(self, "workers", MappingProxyType(dict(self.workers)))

    @classmethod
    def of(
        cls,
        workers: Iterable[WorkerState],
        now: float,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        log_read_at: float = math.inf,
        recent: Iterable[WorkerState] = (),
    ) -> Snapshot:
        """A snapshot of ``workers`` (later duplicates of a worker_id win)."""
        return cls({w.worker_id: w for w in workers}, now, stale_after_s, log_read_at,
                   tuple(recent))

    def is_fresh(self, worker: WorkerState) -> bool:
        """True when the worker's heartbeat is recent enough to trust."""
        return abs(self.now - worker.heartbeat_ts) <= self.stale_after_s  # a clock ahead too


@dataclass(frozen=True, slots=True)
class Placement:
    """Send ``request`` to ``worker_id`` (its assignments partition), reserving ``kv_tokens``.

    ``request.phase`` says what the worker runs: the whole request, its prefill stage (the
    prompt; the caller hands the KV on with ``request.handoff()`` when it is computed) or
    its decode stage.
    """

    request: QueuedRequest
    worker_id: str
    partition: int
    kv_tokens: int
    attempt: int

    @property
    def phase(self) -> Phase:
        return self.request.phase


@dataclass(frozen=True, slots=True)
class Defer:
    """The request stays queued; ``reason`` says what blocked it this cycle."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Reject:
    """The request ends with an error ``code``; it has left the pending queue."""

    request_id: str
    code: ErrorCode
    reason: str
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Requeue:
    """Put ``request`` (already at its new attempt) back into the pending queue."""

    request: QueuedRequest
    reason: str


Decision = Placement | Defer | Reject
