"""The pending queue: priority classes with aging, FCFS within a class, bounded.

Structure. One FIFO per *class* = (lane, priority, model, model version, stage). Requests for
different models never compete for the same workers, so keeping models apart stops a
blocked model from holding up another one's requests; so does a version pin (a request
pinned to the version of the last, draining worker of a rolling upgrade must not hold up
unpinned ones the new version's workers could take); so does the stage: a request whose
prompt a prefill worker computed (``phase == "decode"``, waiting for a decode worker) is
in a class of its own, so that a full decode pool never holds up new prompts that only
need a prefill worker. Decode stages rank as high whatever their priority, so hand-offs
go first: the prefill side already served the request by its class, and a waiting
hand-off pins its prompt's KV on the prefill worker (vLLM's KV connectors free it only
when the decode side has pulled it). Among themselves hand-offs age like any class, on a
short scale: oldest first, but ``handoff_step_s`` (1 s) later per class below high, so a
high request's hand-off overtakes a normal one admitted up to 1 s before it (a low one, 2
s) and no hand-off waits for more than that many later ones. Within a class the order is
FCFS by ``enqueued_at`` (ties by arrival), so requeued requests (which keep their original
``enqueued_at``) go back near the front. Each FIFO is a binary heap (keyed by the order
key below) with lazy deletion: push, pop and remove by id are O(log n) (remove is O(1)
plus amortised cleanup).

Aging. Effective priority ``e(r, now) = rank(r) - (now - r.enqueued_at) / A`` with
``rank`` = 0 high, 1 normal, 2 low and ``A = aging_s_per_class`` (default 30 s): a request
gains one class per A seconds waited; smaller ``e`` is served first. Comparing two requests
at the same ``now``, ``e(a) < e(b)`` exactly when ``a.enqueued_at + rank(a)·A <
b.enqueued_at + rank(b)·A``, so the order does not depend on ``now`` and the queue never
needs re-sorting. Aging is monotone in wait, so each class's head is its most-aged member
and choosing across classes only compares heads (at most 6 per model).

Aging bound. ``aging_bound_s(c) = rank(c) · A`` (high 0 s, normal 30 s, low 60 s by
default): after waiting that long a request of class c has reached the effective priority
of a fresh high-priority request, so nothing that arrives later can overtake it — only the
finitely many requests already ahead of it are served first. The cycle uses the same bound
to stop backfill past a blocked head (see :mod:`.cycle`). A decode stage's offset is
``rank(priority) · handoff_step_s`` instead of ``rank · A``, in its order key, its
effective priority and its bound alike (:meth:`PendingQueue.overdue`).

Capacity. ``max_pending`` bounds the queue; ``push`` refuses new work when full (the
service pauses consumption, lowest priority first, and Kafka keeps the backlog), while
requeues after worker loss are forced in: that work was already admitted.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from schemas.common import LANES, PRIORITIES, Lane, Priority, priority_rank
from services.scheduler.core.errors import ConfigError
from services.scheduler.core.lanes import DEFAULT_LANE_WEIGHTS, LaneInterleave
from services.scheduler.core.types import QueuedRequest

#: A FIFO of the pending queue: (lane, priority rank, model, model version or None for
#: any, True for decode stages); see the module docstring.
ClassKey = tuple[Lane, int, str, str | None, bool]

_RANK: dict[Priority, int] = {p: priority_rank(p) for p in PRIORITIES}


def _rank(request: QueuedRequest) -> int:
    """The class a request is queued and run at: its priority's rank, but 0 (high) for a
    decode stage (module docstring)."""
    return 0 if request.phase == "decode" else _RANK[request.priority]


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Validated settings of the pending queue.

    Example (TOML)::

        [scheduler.queue]
        aging_s_per_class = 30.0
        max_pending = 100000
        lane_weights = { short = 3.0, long = 1.0 }
    """

    aging_s_per_class: float = 30.0
    max_pending: int = 100_000
    lane_weights: Mapping[Lane, float] = field(default_factory=lambda: dict(DEFAULT_LANE_WEIGHTS))
    #: How much later per class below high a decode stage is ordered (module docstring).
    handoff_step_s: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.aging_s_per_class) and self.aging_s_per_class > 0):
            raise ConfigError("queue.aging_s_per_class", "must be a finite number > 0")
        if not (math.isfinite(self.handoff_step_s) and self.handoff_step_s >= 0):
            raise ConfigError("queue.handoff_step_s", "must be a finite number >= 0")
        if self.max_pending < 1:
            raise ConfigError("queue.max_pending", "must be >= 1")
        for lane in LANES:
            weight = self.lane_weights.get(lane)
            if weight is None or not (math.isfinite(weight) and weight > 0):
                raise ConfigError(f"queue.lane_weights.{lane}", "must be a finite number > 0")
        unknown = set(self.lane_weights) - set(LANES)
        if unknown:
            raise ConfigError("queue.lane_weights", f"unknown lanes {sorted(unknown)}")

    def aging_bound_s(self, priority: Priority) -> float:
        """Seconds a request of ``priority`` waits before no later arrival can outrank it."""
        return _RANK[priority] * self.aging_s_per_class


class _Entry:
    """A live request in the queue; ``seq`` tells live heap entries from stale ones."""

    __slots__ = ("klass", "request", "seq")

    def __init__(self, request: QueuedRequest, klass: ClassKey, seq: int) -> None:
        self.request = request
        self.klass = klass
        self.seq = seq


class _Fifo:
    """One class: heap of (order key, seq, request_id), lazily cleaned."""

    __slots__ = ("heap", "live")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, str]] = []
        self.live = 0


class PendingQueue:
    """Admitted requests waiting for placement; owned by one scheduler agent.

    Not thread-safe, no I/O: the owner calls ``push`` as requests arrive, ``cancel`` on
    client cancellation, and ``schedule()`` takes heads out as it places them.
    """

    def __init__(self, config: QueueConfig | None = None) -> None:
        self.config = config if config is not None else QueueConfig()
        self.lanes = LaneInterleave(self.config.lane_weights)
        self._aging = self.config.aging_s_per_class
        self._handoff_step = self.config.handoff_step_s
        self._seq = itertools.count()
        self._entries: dict[str, _Entry] = {}
        self._classes: dict[ClassKey, _Fifo] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._counts: dict[tuple[Priority, Lane], int] = {
            (p, lane): 0 for p in PRIORITIES for lane in LANES
        }
        self._cancelled: list[QueuedRequest] = []
        #: Requests pending per (lane, model): whether a lane has work to lend a pool for.
        self._lane_models: dict[tuple[Lane, str], int] = {}

    # -- size and pressure ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    @property
    def is_full(self) -> bool:
        """True at ``max_pending``: the owner should pause the lowest-priority topics."""
        return len(self._entries) >= self.config.max_pending

    def counts(self) -> dict[tuple[Priority, Lane], int]:
        """Requests pending per (priority, lane) — one Kafka topic each."""
        return dict(self._counts)

    # -- ordering ---------------------------------------------------------------------

    def aging_bound_s(self, priority: Priority) -> float:
        return self.config.aging_bound_s(priority)

    def overdue(self, request: QueuedRequest, now: float) -> bool:
        """True once ``request`` has waited the aging bound of the class it is queued at
        (for a decode stage, which ranks as high, its class's ``handoff_step_s`` steps)."""
        return now >= self.order_key(request)

    def effective_priority(self, request: QueuedRequest, now: float) -> float:
        """``rank - wait / aging_s_per_class`` (a decode stage's rank: its offset over
        the aging scale); smaller is served first."""
        return (self.order_key(request) - now) / self._aging

    def engine_priority(self, request: QueuedRequest, now: float) -> int:
        """The class ``request`` has aged into at ``now`` — ``max(0, ceil(effective
        priority))``: 2 low, 1 normal, 0 high — which the worker hands its engine as vLLM's
        request priority. A request at its aging bound gets 0, and the engine breaks ties by
        arrival, so nothing placed after it overtakes it there either. Never worse than
        its own class: ``enqueued_at`` is stamped by ingest's clock, which may run ahead of
        the scheduler's (a low request "waited" −5 ms would otherwise come out as 3). A
        decode stage is always 0: in its engine, hand-offs go first."""
        aged = math.ceil(self.effective_priority(request, now) - 1e-9)
        return min(_rank(request), max(0, aged))

    def order_key(self, request: QueuedRequest) -> float:
        """A time-free key with the same order as effective priority at any ``now``."""
        # Its class's offset: rank · aging_s_per_class, or for a decode stage
        # rank(priority) · handoff_step_s (module docstring).
        step = self._handoff_step if request.phase == "decode" else self._aging
        return request.enqueued_at + _RANK[request.priority] * step

    # -- mutation ---------------------------------------------------------------------

    def push(self, request: QueuedRequest, *, force: bool = False) -> bool:
        """Enqueue ``request``; False (nothing changed) when the queue is full.

        Idempotent for at-least-once delivery: a duplicate of a pending request (same id,
        same or older attempt) is ignored and reports True; a newer attempt replaces it.
        ``force`` admits past ``max_pending`` (requeues of already-admitted work).
        """
        current = self._entries.get(request.request_id)
        if current is not None:
            if request.attempt <= current.request.attempt:
                return True
            self.remove(request.request_id)
        elif not force and self.is_full:
            return False
        klass: ClassKey = (request.lane, _rank(request), request.model,
                           request.model_version, request.phase == "decode")
        seq = next(self._seq)
        self._entries[request.request_id] = _Entry(request, klass, seq)
        fifo = self._classes.get(klass)
        if fifo is None:
            fifo = self._classes[klass] = _Fifo()
        heapq.heappush(fifo.heap, (self.order_key(request), seq, request.request_id))
        fifo.live += 1
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, seq, request.request_id))
        self._counts[(request.priority, request.lane)] += 1
        lane_model = (request.lane, request.model)
        self._lane_models[lane_model] = self._lane_models.get(lane_model, 0) + 1
        return True

    def remove(self, request_id: str) -> QueuedRequest | None:
        """Take a request out by id (placed, rejected or cancelled); None if absent."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        request = entry.request
        self._counts[(request.priority, request.lane)] -= 1
        self._lane_models[(request.lane, request.model)] -= 1
        fifo = self._classes[entry.klass]
        fifo.live -= 1
        if fifo.live == 0:
            del self._classes[entry.klass]  # drops its stale heap entries with it
        elif len(fifo.heap) > 2 * fifo.live + 32:
            self._compact(fifo)
        if len(self._deadlines) > 2 * len(self._entries) + 32:
            self._deadlines = [d for d in self._deadlines if self._is_live(d[1], d[2])]
            heapq.heapify(self._deadlines)
        return request

    def cancel(self, request_id: str) -> bool:
        """Drop a pending request; ``schedule()`` reports it as ``Reject(cancelled)``.

        False when the request is not pending (already placed: the owner must abort it on
        its worker instead).
        """
        request = self.remove(request_id)
        if request is None:
            return False
        self._cancelled.append(request)
        return True

    def withdraw_cancelled(self, request_id: str) -> bool:
        """Forget a cancel not yet reported (its owner hands the request to another):
        ``schedule()`` will not report it. False when no such cancel is waiting."""
        kept = [r for r in self._cancelled if r.request_id != request_id]
        found = len(kept) < len(self._cancelled)
        self._cancelled = kept
        return found

    def take_cancelled(self) -> list[QueuedRequest]:
        """Requests cancelled since the last call, oldest first."""
        taken, self._cancelled = self._cancelled, []
        return taken

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every request whose deadline is at or before ``now``."""
        expired: list[QueuedRequest] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, seq, request_id = heapq.heappop(deadlines)
            if self._is_live(seq, request_id):
                removed = self.remove(request_id)
                if removed is not None:
                    expired.append(removed)
        return expired

    # -- reading ----------------------------------------------------------------------

    def get(self, request_id: str) -> QueuedRequest | None:
        entry = self._entries.get(request_id)
        return None if entry is None else entry.request

    def class_keys(self) -> list[ClassKey]:
        """The non-empty classes."""
        return list(self._classes)

    def head(self, klass: ClassKey) -> QueuedRequest | None:
        """The first request of ``klass`` by order key (its most-aged one), or None."""
        fifo = self._classes.get(klass)
        found = None if fifo is None else self._top(fifo)
        return None if found is None else found[1]

    def keyed_head(self, klass: ClassKey) -> tuple[float, QueuedRequest] | None:
        """:meth:`head` with its :meth:`order_key` (read from the FIFO, not computed)."""
        fifo = self._classes.get(klass)
        return None if fifo is None else self._top(fifo)

    def keyed_heads(self) -> dict[ClassKey, tuple[float, QueuedRequest]]:
        """Every non-empty class's :meth:`keyed_head`, in :meth:`class_keys` order: where a
        scheduling cycle starts, in one pass over the classes."""
        found: dict[ClassKey, tuple[float, QueuedRequest]] = {}
        for klass, fifo in self._classes.items():
            top = self._top(fifo)
            if top is not None:
                found[klass] = top
        return found

    def has_lane_work(self, lane: Lane, model: str) -> bool:
        """True while a request of ``lane`` for ``model`` is pending (any class): O(1)."""
        return self._lane_models.get((lane, model), 0) > 0

    def heads(self) -> list[QueuedRequest]:
        """Each class's head, best effective priority first."""
        found = [h for k in self._classes if (h := self.head(k)) is not None]
        found.sort(key=self._sort_key)
        return found

    def ordered(self) -> Iterator[QueuedRequest]:
        """Every pending request in effective-priority order: O(n log n), for tests/tools."""
        requests = [e.request for e in self._entries.values()]
        requests.sort(key=self._sort_key)
        return iter(requests)

    # -- internals --------------------------------------------------------------------

    def _sort_key(self, request: QueuedRequest) -> tuple[float, int, int]:
        entry = self._entries[request.request_id]
        return (self.order_key(request), _rank(request), entry.seq)

    def _top(self, fifo: _Fifo) -> tuple[float, QueuedRequest] | None:
        """The live head of ``fifo`` and its order key; drops stale entries on the way."""
        heap = fifo.heap
        while heap:
            key, seq, request_id = heap[0]
            entry = self._entries.get(request_id)
            if entry is not None and entry.seq == seq:
                return key, entry.request
            heapq.heappop(heap)
        return None  # pragma: no cover - a non-empty class always has a live entry

    def _is_live(self, seq: int, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry.seq == seq

    def _compact(self, fifo: _Fifo) -> None:
        fifo.heap = [item for item in fifo.heap if self._is_live(item[1], item[2])]
        heapq.heapify(fifo.heap)
