"""The reservation ledger: KV and sequence slots promised to each worker.

The scheduler reserves a request's ``kv_tokens`` on a worker when it places it and releases
them on the request's terminal event. The ledger is the scheduler's own record of what it
sent where, so it is ahead of the heartbeats (which lag by up to an interval and do not yet
show assignments still in flight on Kafka).

Invariant: for every worker, Σ reservations ≤ usable KV = ⌊total × (1 − kv_safety_margin)⌋.
:meth:`Ledger.reserve` refuses rather than overcommit. Releases are idempotent per
(request_id, attempt): duplicates and releases of unknown keys change nothing.

Free KV for placement (:meth:`Ledger.free_kv`) is the *minimum* of two estimates:

* ledger: ``usable − Σ reservations`` — exact for the work we placed, and pessimistic
  because a reservation covers prompt + max_tokens while the engine allocates blocks as
  tokens are generated;
* heartbeat: ``kv_free − (total − usable) − KV reserved but not yet started`` — sees work
  the ledger does not know (a scheduler restart, another client of an external server).

Taking the minimum fails closed: whichever view is tighter wins. Sequence slots work the
same way: in flight = max(running + waiting, reservations started) + reservations not yet
started, and a worker has a slot while that is below ``max_num_seqs``.

Releases since the heartbeat. A heartbeat at ``h`` still counts the KV and the sequence of
every request the worker held at ``h``; one that finished after ``h`` is freed in the
ledger at once but would stay "used" in the heartbeat view until the next heartbeat, which
made the tighter-of-two rule hide freed capacity for up to an interval. When the caller
gives times (``mark_started(..., at=s)`` and ``release(..., at=t)``, on the workers'
clock, as ``heartbeat_ts`` is), a released reservation with ``s < h < t`` is credited back
to the heartbeat view of a worker whose heartbeat is at ``h``: one sequence to ``running +
waiting``, and to the free KV what the request can have held at ``h`` — its ``kv_tokens``,
or less when the caller tells how many tokens it ended with (``held_tokens``: prompt +
generated, in whole blocks of the worker's size): the heartbeat counted the blocks the
engine had allocated, not the reservation, and crediting the whole reservation of a
request that stopped early overstated the free KV of a worker whose KV something outside
llmq also uses (the case the heartbeat view is there for). The bounds are strict — a request
started at ``h`` may be missing from that heartbeat, one ended at ``h`` is already freed
in it — and without both times there is no credit (the old behaviour). Credits are kept
per worker until a heartbeat later than their release is seen, then dropped. The ledger
view is unchanged, so Σ reservations ≤ usable KV still holds whatever the credits; they
only stop the heartbeat view from double-counting work that has ended.

Prompt work. Each worker's book also counts the prompt tokens placed on it that it has
not computed yet (whole requests and prefill stages, from reservation to first token or
release; a decode stage's prompt arrives computed). On a disaggregated fleet that is the
load of a prefill worker, and a decode worker with none may take a long request whole
(:mod:`.cycle`, "Prefill and decode apart").

The ledger also keeps the scheduler's other per-worker placement memory, so one owner holds
it all: holds (a worker kept free for one overdue request, see :mod:`.cycle`), prefix
affinity (:mod:`.affinity`), the last worker placed on (round-robin), and a change log
that lets candidate indexes update incrementally instead of rescanning the fleet. The same
changes expire its cache of each worker's free KV and in-flight count (:meth:`Ledger._load`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from services.scheduler.core.affinity import AffinityMap
from services.scheduler.core.errors import ConfigError
from services.scheduler.core.types import QueuedRequest, ReservationKey, WorkerState


@dataclass(frozen=True, slots=True)
class Reservation:
    """``request`` (at its current attempt) holds ``request.kv_tokens`` on ``worker_id``."""

    request: QueuedRequest
    worker_id: str

    @property
    def key(self) -> ReservationKey:
        return self.request.key

    @property
    def kv_tokens(self) -> int:
        return self.request.kv_tokens


class _Book:
    """One worker's reservations and their running totals."""

    __slots__ = (
        "block_size",
        "computing",
        "entries",
        "lanes",
        "reserved",
        "seen",
        "started",
        "started_at",
        "uncomputed",
        "unstarted_kv",
        "unstarted_n",
    )

    def __init__(self) -> None:
        self.entries: dict[ReservationKey, Reservation] = {}
        self.computing: dict[ReservationKey, int] = {}  # prompt tokens not computed yet
        self.uncomputed = 0  # their sum
        self.started: set[ReservationKey] = set()  # the worker has begun it
        self.started_at: dict[ReservationKey, float] = {}  # ... at this time, when told
        self.seen: set[ReservationKey] = set()  # a heartbeat listed it
        self.lanes: dict[str, int] = {}  # reservations per lane
        self.block_size = 1  # the worker's KV block, as of its last reservation
        self.reserved = 0
        self.unstarted_kv = 0
        self.unstarted_n = 0


#: Releases remembered per worker before the oldest are forgotten (forgetting a credit is
#: conservative: the heartbeat view merely lags again, as it did without credits).
_CREDIT_LIMIT = 4096

#: Workers whose load figures are cached at most (:meth:`Ledger._load`); far above a fleet.
_LOADS_LIMIT = 65_536


class _Credit:
    """Started reservations of one worker released at known times, not yet in a heartbeat.

    ``ended`` holds (started_at, released_at, kv_tokens); ``at``/``kv``/``n`` cache the sum
    for the heartbeat time last asked about (the common case: one snapshot, many calls).
    """

    __slots__ = ("at", "ended", "kv", "n")

    def __init__(self) -> None:
        self.ended: deque[tuple[float, float, int]] = deque()
        self.at = -math.inf
        self.kv = 0
        self.n = 0

    def add(self, started_at: float, released_at: float, kv_tokens: int) -> None:
        if len(self.ended) >= _CREDIT_LIMIT:
            self.ended.popleft()
            self.at = math.nan  # cache no longer matches: recompute on the next read
        self.ended.append((started_at, released_at, kv_tokens))
        if started_at < self.at < released_at:
            self.kv += kv_tokens
            self.n += 1

    def for_heartbeat(self, heartbeat_ts: float) -> _Credit:
        """Bring the cached sums to ``heartbeat_ts``; returns self."""
        if heartbeat_ts != self.at:
            ended = self.ended
            if heartbeat_ts > self.at:  # a newer heartbeat: what ended before it is in it
                while ended and ended[0][1] <= heartbeat_ts:
                    ended.popleft()
            kv = n = 0
            for started_at, released_at, kv_tokens in ended:
                if started_at < heartbeat_ts < released_at:
                    kv += kv_tokens
                    n += 1
            self.at, self.kv, self.n = heartbeat_ts, kv, n
        return self


class Ledger:
    """Per-worker reservations, holds and affinity; owned by one scheduler agent."""

    def __init__(
        self,
        *,
        kv_safety_margin: float = 0.05,
        affinity_capacity: int = 65_536,
        log_limit: int = 65_536,
    ) -> None:
        if not 0.0 <= kv_safety_margin < 1.0:
            raise ConfigError("ledger.kv_safety_margin", "must be in [0, 1)")
        self.kv_safety_margin = kv_safety_margin
        self.affinity = AffinityMap(affinity_capacity)
        #: Where the last reservation went, fleet-wide and per route (model, version, lane):
        #: the round-robin picker's cursors.
        self.last_worker_id: str | None = None
        self._last_on: dict[tuple[str, str | None, str], str] = {}
        self._keep = 1.0 - kv_safety_margin
        self._books: dict[str, _Book] = {}
        self._credits: dict[str, _Credit] = {}
        self._where: dict[ReservationKey, str] = {}
        self._holds_by_worker: dict[str, str] = {}
        self._holds_by_request: dict[str, str] = {}
        self._log: list[str] = []
        self._log_start = 0
        self._log_limit = max(16, log_limit)
        #: worker_id -> (worker, free_kv, in_flight, headroom): see :meth:`_load`.
        self._loads: dict[str, tuple[WorkerState, int, int, float]] = {}

    # -- capacity views ---------------------------------------------------------------

    def usable_kv(self, worker: WorkerState) -> int:
        """KV tokens the scheduler may promise on ``worker`` at most."""
        return int(worker.kv_total_tokens * self._keep)

    def reserved_kv(self, worker_id: str) -> int:
        book = self._books.get(worker_id)
        return 0 if book is None else book.reserved

    def last_worker_on(self, route: tuple[str, str | None, str]) -> str | None:
        """The worker of the last reservation of a request of ``route`` (model, version,
        lane); None before the first."""
        return self._last_on.get(route)

    def free_kv(self, worker: WorkerState) -> int:
        """KV free for a new placement: min(ledger, heartbeat) view, never negative."""
        return self._load(worker)[1]

    def headroom(self, worker: WorkerState) -> float:
        """``free_kv / usable_kv`` in [0, 1]; 0 for a worker with no usable KV."""
        return self._load(worker)[3]

    def in_flight(self, worker: WorkerState) -> int:
        """Sequences on the worker or on their way to it."""
        return self._load(worker)[2]

    def room(self, worker: WorkerState) -> int:
        """Free KV if the worker also has a sequence slot, else 0: what indexes sort by."""
        _, free, in_flight, _ = self._load(worker)
        return 0 if in_flight >= worker.max_num_seqs else free

    def _load(self, worker: WorkerState) -> tuple[WorkerState, int, int, float]:
        """(``worker``, its free KV, its sequences in flight, its headroom), kept until its
        book changes.

        A decision reads these for the same few workers many times over (the candidate
        index, room filters, scorers), and between two decisions only the workers placed on
        or released change; recomputing them each time was a large share of a decision.
        The entry is for one ``WorkerState`` object: a newer heartbeat (another object, or
        an older one read again) is computed afresh, which also keeps the credits' own
        per-heartbeat cache (:meth:`_Credit.for_heartbeat`) in charge of its state.
        Every change to a book or to the credits goes through :meth:`_touch` or
        :meth:`drop_worker`, which forget the entry.
        """
        found = self._loads.get(worker.worker_id)
        if found is not None and found[0] is worker:
            return found
        if len(self._loads) >= _LOADS_LIMIT:  # workers gone without drop_worker: forget all
            self._loads.clear()
        found = self._loads[worker.worker_id] = self._compute_load(worker)
        return found

    def _compute_load(self, worker: WorkerState) -> tuple[WorkerState, int, int, float]:
        """:meth:`_load`'s figures from the book and the credits (module docstring): both
        views of free KV and of sequences in flight, in one pass over the worker's state.

        Plain arithmetic, no min()/max() calls: this runs on every change of a book.
        """
        worker_id, total = worker.worker_id, worker.kv_total_tokens
        usable = int(total * self._keep)
        heartbeat_free = worker.kv_free_tokens - total + usable
        engine = worker.running + worker.waiting  # the heartbeat's sequences
        credit = self._credits.get(worker_id)
        if credit is not None:
            credit = credit.for_heartbeat(worker.heartbeat_ts)
            heartbeat_free += credit.kv
            engine -= credit.n
            if not credit.ended:  # a newer heartbeat shows all of it: nothing left to keep
                del self._credits[worker_id]
        book = self._books.get(worker_id)
        if book is None:
            free = usable if usable < heartbeat_free else heartbeat_free
            in_flight = engine if engine > 0 else 0
        else:
            free = usable - book.reserved
            heartbeat_free -= book.unstarted_kv
            if heartbeat_free < free:
                free = heartbeat_free
            started = len(book.started)
            in_flight = (engine if engine > started else started) + book.unstarted_n
        free = free if free > 0 else 0
        headroom = free / usable if usable > 0 else 0.0
        return worker, free, in_flight, headroom

    # -- reservations -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def reserve(self, worker: WorkerState, request: QueuedRequest) -> bool:
        """Reserve ``request.kv_tokens`` on ``worker``; False if that would overcommit.

        A duplicate of an existing reservation is a no-op: True if it names the same worker,
        False if the request (same attempt) is already reserved elsewhere.
        """
        key = request.key
        where = self._where.get(key)
        if where is not None:
            return where == worker.worker_id
        worker_id = worker.worker_id
        book = self._books.get(worker_id)
        if book is None:
            book = self._books[worker_id] = _Book()
        if book.reserved + request.kv_tokens > self.usable_kv(worker):
            return False
        book.entries[key] = Reservation(request, worker_id)
        book.block_size = max(1, worker.block_size)
        book.reserved += request.kv_tokens
        book.lanes[request.lane] = book.lanes.get(request.lane, 0) + 1
        book.unstarted_kv += request.kv_tokens
        book.unstarted_n += 1
        if request.phase != "decode":
            book.computing[key] = request.prompt_tokens
            book.uncomputed += request.prompt_tokens
        self._where[key] = worker_id
        self.last_worker_id = worker_id
        self._last_on[(request.model, request.model_version, request.lane)] = worker_id
        if request.prefix_hash is not None:
            self.affinity.record(request.prefix_hash, worker_id)
        self.unhold(request.request_id)
        self._touch(worker_id)
        return True

    def release(
        self, request_id: str, attempt: int, *, at: float | None = None,
        held_tokens: int | None = None,
    ) -> int:
        """Release a terminal request's reservation; returns the KV freed (0 if none).

        ``at``: when the request ended on the worker (the worker's clock). With it, and a
        start time from :meth:`mark_started`, heartbeats older than ``at`` get the freed KV
        and sequence slot credited back (module docstring). Without it, they do not.
        ``held_tokens``: the tokens the request ended with (its usage: prompt + generated);
        the KV credited is at most those, in whole blocks (None: its whole reservation).
        """
        key = (request_id, attempt)
        worker_id = self._where.pop(key, None)
        if worker_id is None:
            return 0
        book = self._books[worker_id]
        reservation = book.entries.pop(key)
        book.reserved -= reservation.kv_tokens
        book.lanes[reservation.request.lane] -= 1
        book.uncomputed -= book.computing.pop(key, 0)
        if key in book.started:
            book.started.discard(key)
            started_at = book.started_at.pop(key, None)
            if started_at is not None and at is not None and at > started_at:
                credit = self._credits.get(worker_id)
                if credit is None:
                    credit = self._credits[worker_id] = _Credit()
                kv = reservation.kv_tokens
                if held_tokens is not None:
                    size = book.block_size
                    kv = min(kv, -(-held_tokens // size) * size)
                credit.add(started_at, at, kv)
        else:
            book.unstarted_kv -= reservation.kv_tokens
            book.unstarted_n -= 1
        book.seen.discard(key)
        if not book.entries:
            del self._books[worker_id]
        self._touch(worker_id)
        return reservation.kv_tokens

    def mark_started(self, request_id: str, attempt: int, *, at: float | None = None) -> bool:
        """The worker began the request (its ``started`` event); False if unknown.

        ``at``: when it started on the worker (the worker's clock); see :meth:`release`.
        A duplicate keeps the first start time.
        """
        key = (request_id, attempt)
        worker_id = self._where.get(key)
        if worker_id is None:
            return False
        book = self._books[worker_id]
        if at is not None and key not in book.started:
            book.started_at[key] = at
        self._start(book, key)
        self._touch(worker_id)
        return True

    def mark_first_token(self, request_id: str, attempt: int) -> bool:
        """The worker computed the request's prompt (its first token); False if unknown.
        Its prompt no longer counts in :meth:`uncomputed_prompt`."""
        key = (request_id, attempt)
        worker_id = self._where.get(key)
        if worker_id is None:
            return False
        book = self._books[worker_id]
        book.uncomputed -= book.computing.pop(key, 0)  # room is unchanged: nothing to log
        return True

    def uncomputed_prompt(self, worker_id: str) -> int:
        """Prompt tokens reserved on ``worker_id`` and not computed yet (module doc)."""
        book = self._books.get(worker_id)
        return 0 if book is None else book.uncomputed

    def reconcile(self, worker_id: str, held: Collection[ReservationKey]) -> list[Reservation]:
        """Align with a heartbeat listing the (request_id, attempt) the worker holds.

        Listed reservations count as started and seen. A reservation seen in an earlier
        heartbeat and absent now has ended (its terminal event may still be on its way):
        it is released and returned. One never seen yet is still in flight on Kafka and
        stays. Keys the ledger does not know are ignored (the heartbeat's own kv_free
        already accounts for them).
        """
        book = self._books.get(worker_id)
        if book is None:
            return []
        ended = [r for k, r in book.entries.items() if k not in held and k in book.seen]
        for key in held:
            if key in book.entries:
                book.seen.add(key)
                self._start(book, key)
        for reservation in ended:
            self.release(*reservation.key)
        self._touch(worker_id)
        return ended

    def drop_worker(self, worker_id: str) -> list[Reservation]:
        """Release everything on a dead worker and forget its hold; returns what it held."""
        book = self._books.get(worker_id)
        held = [] if book is None else list(book.entries.values())
        for reservation in held:
            self.release(*reservation.key)
        self._credits.pop(worker_id, None)
        self._loads.pop(worker_id, None)
        holder = self._holds_by_worker.pop(worker_id, None)
        if holder is not None:
            del self._holds_by_request[holder]
        self.affinity.forget_worker(worker_id)
        return held

    def drop(self, keys: Collection[ReservationKey]) -> list[Reservation]:
        """Release the reservations ``keys`` (unknown ones are skipped); returns them."""
        dropped = []
        for key in keys:
            worker_id = self._where.get(key)
            if worker_id is not None:
                dropped.append(self._books[worker_id].entries[key])
                self.release(*key)
        return dropped

    def lane_count(self, worker_id: str, lane: str) -> int:
        """Reservations of ``lane`` on ``worker_id`` (bounds cross-pool spill, see cycle)."""
        book = self._books.get(worker_id)
        return 0 if book is None else book.lanes.get(lane, 0)

    def reservations(self, worker_id: str) -> tuple[Reservation, ...]:
        book = self._books.get(worker_id)
        return () if book is None else tuple(book.entries.values())

    def worker_of(self, request_id: str, attempt: int) -> str | None:
        """Where (request_id, attempt) is reserved, if anywhere."""
        return self._where.get((request_id, attempt))

    # -- holds ------------------------------------------------------------------------

    def hold(self, worker_id: str, request_id: str) -> None:
        """Keep ``worker_id`` free of new work until ``request_id`` is placed (anywhere)."""
        self.unhold(request_id)
        previous = self._holds_by_worker.get(worker_id)
        if previous is not None:
            del self._holds_by_request[previous]
        self._holds_by_worker[worker_id] = request_id
        self._holds_by_request[request_id] = worker_id

    def unhold(self, request_id: str) -> None:
        worker_id = self._holds_by_request.pop(request_id, None)
        if worker_id is not None:
            del self._holds_by_worker[worker_id]

    def holder(self, worker_id: str) -> str | None:
        """The request ``worker_id`` is held for, if any."""
        return self._holds_by_worker.get(worker_id)

    def hold_of(self, request_id: str) -> str | None:
        """The worker held for ``request_id``, if any."""
        return self._holds_by_request.get(request_id)

    def holds(self) -> Mapping[str, str]:
        """worker_id -> request_id, read-only."""
        return MappingProxyType(self._holds_by_worker)

    def hold_count(self) -> int:
        """How many workers are held (``len(holds())`` without building the view: the
        cycle asks several times per decision)."""
        return len(self._holds_by_worker)

    # -- change log -------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """Position after the latest change; pass it back to :meth:`changes_since`."""
        return self._log_start + len(self._log)

    def changes_since(self, cursor: int) -> Sequence[str] | None:
        """Worker ids whose books changed since ``cursor`` (repeats possible).

        None when the log no longer reaches back that far: the caller must rescan.
        """
        if cursor < self._log_start:
            return None
        return self._log[cursor - self._log_start :]

    # -- internals --------------------------------------------------------------------

    def _start(self, book: _Book, key: ReservationKey) -> None:
        if key not in book.started:
            book.started.add(key)
            book.unstarted_kv -= book.entries[key].kv_tokens
            book.unstarted_n -= 1

    def _touch(self, worker_id: str) -> None:
        self._loads.pop(worker_id, None)
        self._log.append(worker_id)
        if len(self._log) > self._log_limit:
            half = len(self._log) // 2
            del self._log[:half]
            self._log_start += half
