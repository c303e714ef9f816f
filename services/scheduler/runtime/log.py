"""The assignment log: what was assigned where, and how each attempt ended.

"Every decision is replayable": the scheduler's decisions are the records of
``llmq.assignments`` (each carries the admitted request verbatim) and its terminal events on
``llmq.events``; the workers' lifecycle events are on ``llmq.events`` too. Reading both
topics from the beginning rebuilds this log, and from it the reservation ledger, after a
restart (kill -9 included). The scheduler also records its own placements here the moment
it decides them, so a redelivered request is recognised before its assignment is read back.

Per request the log keeps the attempts assigned, started, streamed (``first_token``),
prefilled (``event.prefilled``: a prefill stage handed its KV on), ended (a terminal event)
and lost (its worker died and the request was requeued). Records of the two topics may
come in any order; the status is derived, not accumulated:

- ``finished``: some attempt ended, and no later attempt was assigned;
- ``active``: the latest assigned attempt has not ended and was not lost;
- ``lost``: the latest assigned attempt was lost (its requeue waits in the pending queue);
- ``handoff``: the latest assigned attempt was a prefill stage that reported
  ``event.prefilled`` (and was not lost first); its decode stage (the next attempt) waits
  for the leader to place it (:meth:`AssignmentLog.handoffs`, with the parameters it
  reported);
- ``unknown``: never assigned nor ended.

An active entry keeps its :class:`Assignment` (the reservation is rebuilt from it; a requeue
needs the admitted request; so does a hand-off). A finished entry drops it and is forgotten
``memory_s`` after its deadline (:meth:`AssignmentLog.prune`); an active, lost or handoff
one is never pruned. The deadline comes from the request's assignment, or, for a request
the scheduler ended without one, from its terminal event's headers
(:func:`~services.scheduler.runtime.messages.admission_of`): a cancel read long before a
long deadline keeps the entry until then, so a redelivered record of it is still known.

Per request the log also keeps the admissions (``admitted_at``) its records are of — the
assignments' and those the scheduler's own terminal events name in their headers — so a
new request reusing a finished one's id is told from a redelivery of it, after a restart
too: the scheduler's refusal of a reuse names the reuse's admission.

The scheduler's own decision about a request can be taken back while nothing else was
recorded for it since (:meth:`AssignmentLog.forget`): one whose records were never
produced, so that a redelivered record of the request is decided afresh, not skipped.
Plain state, no I/O: one owner feeds it.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import JsonValue

from schemas.base import MAX_TIMEOUT_S
from schemas.requests import Assignment
from schemas.workers import EventFirstToken, EventPrefilled, EventStarted, LifecycleEvent

Status = Literal["unknown", "active", "finished", "lost", "handoff"]


@dataclass(frozen=True, slots=True)
class _Own:
    """The scheduler's own placement or ending of ``attempt``, recorded last."""

    attempt: int
    admitted_at: float | None
    #: It made the entry; else it only added its admission (a reuse of the id refused).
    made: bool


class _Attempts:
    """A set of attempt numbers (small non-negative ints) as the bits of one int: 56 bytes
    where a set takes 216. The log keeps every finished request for its deadline plus
    ``memory_s``, five of these each: as sets that was 1.6 KB a finished request (0.6 GiB
    at 100 requests a second, an audit of unbounded memory found)."""

    __slots__ = ("bits",)

    def __init__(self) -> None:
        self.bits = 0

    def add(self, attempt: int) -> None:
        self.bits |= 1 << attempt

    def discard(self, attempt: int) -> None:
        self.bits &= ~(1 << attempt)

    def clear(self) -> None:
        self.bits = 0

    def __contains__(self, attempt: object) -> bool:
        return isinstance(attempt, int) and attempt >= 0 and bool(self.bits >> attempt & 1)

    def __bool__(self) -> bool:
        return self.bits != 0

    def __iter__(self) -> Iterator[int]:
        bits, attempt = self.bits, 0
        while bits:
            if bits & 1:
                yield attempt
            bits >>= 1
            attempt += 1


@dataclass(slots=True)
class _Entry:
    assigned: _Attempts = field(default_factory=_Attempts)
    started: _Attempts = field(default_factory=_Attempts)
    streamed: _Attempts = field(default_factory=_Attempts)
    ended: _Attempts = field(default_factory=_Attempts)
    lost: _Attempts = field(default_factory=_Attempts)
    #: Prefill stages that handed their KV on: attempt -> the parameters they reported.
    prefilled: dict[int, Mapping[str, JsonValue]] = field(default_factory=dict)
    #: ... and when (the event's time): how long the prompt's KV has waited.
    prefilled_at: dict[int, float] = field(default_factory=dict)
    #: The prefill stage whose decode stage is assigned and has not started: the prompt's
    #: KV still waits on its worker (booked on a restore).
    pinned: Assignment | None = None
    #: The latest assignment, while it is active or lost (None once finished).
    latest: Assignment | None = None
    model: str | None = None
    #: Worker the entry is indexed under (its active attempt's worker), if any.
    indexed: str | None = None
    expires_at: float = 0.0
    #: ``admitted_at`` of every admission of this id the records are of (placed, or ended
    #: by a scheduler: a reuse refused ``invalid`` included), to tell a redelivery from a
    #: new request that reuses the id. Empty: none known (an ending from a scheduler that
    #: did not name it).
    admissions: set[float] = field(default_factory=set)
    #: What :meth:`AssignmentLog.forget` may take back; anything recorded after clears it.
    own: _Own | None = None

    def status(self) -> Status:
        top = max(self.assigned, default=0)
        if self.ended and max(self.ended) >= top:
            return "finished"
        if top == 0:
            return "unknown"
        if top in self.lost:  # its worker was declared dead: the prompt's KV went with it
            return "lost"
        return "handoff" if top in self.prefilled else "active"


class AssignmentLog:
    """Per-request record of assignments and lifecycle events (module docstring)."""

    def __init__(self, memory_s: float = 3600.0) -> None:
        self.memory_s = memory_s
        self._entries: dict[str, _Entry] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._handoffs: set[str] = set()

    def __len__(self) -> int:
        return len(self._entries)

    # -- feeding ----------------------------------------------------------------------

    def observe_assignment(self, assignment: Assignment, *, own: bool = False) -> bool:
        """Record an assignment (``own``: this scheduler's placement, not read back);
        True if it became the active attempt."""
        made = assignment.request_id not in self._entries
        entry = self._entry(assignment.request_id)
        attempt = assignment.attempt
        entry.admissions.add(assignment.admitted.admitted_at)
        if attempt in entry.assigned:
            return False
        if own and made:
            entry.own = _Own(attempt, assignment.admitted.admitted_at, made=True)
        entry.assigned.add(attempt)
        request = assignment.request
        entry.model = request.model
        entry.expires_at = max(entry.expires_at, request.created_at + request.timeout_s)
        if attempt == max(entry.assigned):
            previous, entry.latest = entry.latest, assignment
            # Pinned only while the newest attempt is the decode stage of that prefill.
            entry.pinned = previous if (
                assignment.phase == "decode" and previous is not None
                and previous.attempt == attempt - 1 and attempt not in entry.started) else None
        elif assignment.phase == "prefill" and entry.latest is not None \
                and entry.latest.phase == "decode" and entry.latest.attempt == attempt + 1 \
                and attempt + 1 not in entry.started:
            entry.pinned = assignment  # read after its decode stage (replay order)
        self._settle(assignment.request_id, entry)
        return self.active(assignment.request_id) is assignment

    def observe_event(self, event: LifecycleEvent, admitted_at: float | None = None,
                      deadline: float | None = None, at: float | None = None) -> bool:
        """Record a lifecycle event; True if it is news (not a duplicate). ``admitted_at``
        and ``deadline``: of the admission a scheduler's terminal event ended (its headers),
        when it names them. ``at``: the event's time, no later than it was read (None: its
        ``ts``): a worker's clock far ahead kept a finished entry until its own time came
        (found by an audit: a week ahead, a week of traffic held in memory)."""
        entry = self._entry(event.request_id)
        attempt = event.attempt
        at = event.ts if at is None else at
        entry.expires_at = max(entry.expires_at, at)
        if deadline is not None:
            # No request lives longer than the wire's longest timeout: a header naming a
            # deadline further out (any producer to llmq.events can write one) kept its
            # entry for good (found by an audit of unbounded memory).
            entry.expires_at = max(entry.expires_at, min(deadline, at + MAX_TIMEOUT_S))
        if admitted_at is not None:
            entry.admissions.add(admitted_at)
        if isinstance(event, EventPrefilled):
            if attempt in entry.prefilled:
                return False
            entry.prefilled[attempt] = event.kv_transfer
            entry.prefilled_at[attempt] = at
            self._settle(event.request_id, entry)
            return True
        if isinstance(event, EventStarted):
            target = entry.started
            if entry.pinned is not None and entry.pinned.attempt < attempt:
                entry.pinned = None  # the decode stage pulls the prompt's KV
        elif isinstance(event, EventFirstToken):
            target = entry.streamed
        else:
            target = entry.ended
        if attempt in target:
            return False
        target.add(attempt)
        self._settle(event.request_id, entry)
        return True

    def mark_lost(self, request_id: str, attempt: int) -> None:
        """The attempt's worker died; its requeue (attempt + 1) waits in memory."""
        entry = self._entry(request_id)
        entry.lost.add(attempt)
        self._settle(request_id, entry)

    def unmark_lost(self, request_id: str, attempt: int) -> None:
        """The requeue was given up (this replica stopped leading): active again, for the
        leader to decide."""
        entry = self._entries.get(request_id)
        if entry is not None and attempt in entry.lost:
            entry.lost.discard(attempt)
            self._settle(request_id, entry)

    def mark_ended(self, request_id: str, attempt: int, expires_at: float,
                   admitted_at: float | None = None) -> None:
        """The scheduler itself ended the request (its terminal event is on its way)."""
        made = request_id not in self._entries
        entry = self._entry(request_id)
        if made or (admitted_at is not None and admitted_at not in entry.admissions):
            entry.own = _Own(attempt, admitted_at, made)
        if admitted_at is not None:
            entry.admissions.add(admitted_at)
        entry.ended.add(attempt)
        entry.expires_at = max(entry.expires_at, expires_at)
        self._settle(request_id, entry)

    def forget(self, request_id: str, attempt: int, admitted_at: float) -> bool:
        """Take back this scheduler's placement or ending of ``attempt`` of the admission
        ``admitted_at``, whose records were never produced: ``status`` and the rest read
        as before it. True if taken back.

        Only while nothing else was recorded for the request since (:class:`_Own`), and
        only what it recorded: the whole entry when it made it, or the admission it added
        (the refusal of a reuse of a finished id; the ending it marked is left, the entry
        being finished either way). A record read since (another replica placed or ended
        the request too) or a later decision (its worker was lost) is kept, and with it
        the decision: forgetting it would forget what came after."""
        entry = self._entries.get(request_id)
        own = None if entry is None else entry.own
        if entry is None or own is None or (own.attempt, own.admitted_at) != (
                attempt, admitted_at):
            return False
        entry.own = None
        if not own.made:
            entry.admissions.discard(admitted_at)
            return True
        entry.assigned.clear()  # all it holds: the decision made it, nothing came since
        entry.ended.clear()
        self._settle(request_id, entry)  # unindexed
        del self._entries[request_id]
        return True

    # -- reading ----------------------------------------------------------------------

    def status(self, request_id: str) -> Status:
        entry = self._entries.get(request_id)
        return "unknown" if entry is None else entry.status()

    def admitted_at(self, request_id: str) -> float | None:
        """``admitted_at`` of the first admission the request's records are of, if known."""
        entry = self._entries.get(request_id)
        return None if entry is None else min(entry.admissions, default=None)

    def is_reuse(self, request_id: str, admitted_at: float) -> bool:
        """Whether an admission (``admitted_at``) of a finished request's id is a new
        request reusing the id: the log knows the admissions of that id and this is none
        of them. False when it knows none (it cannot tell: taken for a redelivery)."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.status() == "finished" \
            and bool(entry.admissions) and admitted_at not in entry.admissions

    def is_new_admission(self, request_id: str, admitted_at: float) -> bool:
        """Whether an admission (``admitted_at``) of a request the log shows not finished
        is another request with its id: the log knows the id's admissions and this is none
        of them (ingest admits a reuse once it read the first one's ending, which this log
        may not have read yet). False when it knows none."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.status() in ("active", "lost", "handoff") \
            and bool(entry.admissions) and admitted_at not in entry.admissions

    def reached(self, request_id: str, attempt: int) -> bool:
        """Whether the log shows ``attempt``, or a later one, assigned, started, streamed,
        prefilled, ended or lost: that attempt was placed (or ended) already, whichever
        record of it was read first."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        return any(seen and max(seen) >= attempt for seen in (
            entry.assigned, entry.started, entry.streamed, entry.ended, entry.lost,
            entry.prefilled))

    def active(self, request_id: str) -> Assignment | None:
        """The assignment of the active attempt, if the request has one."""
        entry = self._entries.get(request_id)
        if entry is None or entry.status() != "active":
            return None
        return entry.latest

    def latest(self, request_id: str) -> Assignment | None:
        """The latest assignment while the request is active or lost."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry.latest

    def started(self, request_id: str, attempt: int) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and attempt in entry.started

    def handoffs(self, skip: Container[str] = ()) -> list[Assignment]:
        """The prefill assignments whose decode stage waits to be placed, oldest first,
        but for the requests in ``skip``."""
        found = [e.latest for rid in self._handoffs
                 if rid not in skip and (e := self._entries[rid]).latest is not None]
        found.sort(key=lambda a: (a.assigned_at, a.request_id))
        return found

    def pinned(self) -> list[Assignment]:
        """Prefill stages whose decode stage is assigned and not started: the prompt's KV
        still waits on their worker."""
        return [e.pinned for e in self._entries.values()
                if e.pinned is not None and e.status() == "active"]

    def prefilled(self, request_id: str, attempt: int) -> Mapping[str, JsonValue] | None:
        """What the prefill stage ``attempt`` reported when it handed its KV on, if it did."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry.prefilled.get(attempt)

    def prefilled_at(self, request_id: str, attempt: int) -> float | None:
        """When the prefill stage ``attempt`` handed its KV on (its event's time), if it did."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry.prefilled_at.get(attempt)

    def streamed(self, request_id: str, attempt: int) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and attempt in entry.streamed

    def model_of(self, request_id: str) -> str | None:
        entry = self._entries.get(request_id)
        return None if entry is None else entry.model

    def active_on(self, worker_id: str) -> list[Assignment]:
        """Active assignments on ``worker_id``."""
        found = []
        for request_id in self._by_worker.get(worker_id, ()):
            assignment = self.active(request_id)
            if assignment is not None:
                found.append(assignment)
        return found

    def workers(self) -> list[str]:
        """Workers holding at least one active assignment."""
        return list(self._by_worker)

    def all_active(self) -> list[Assignment]:
        """Every active assignment, oldest placement first."""
        found = [
            a for w in self._by_worker for a in self.active_on(w)
        ]
        found.sort(key=lambda a: (a.assigned_at, a.request_id))
        return found

    def prune(self, now: float) -> int:
        """Forget finished (and never-assigned) entries ``memory_s`` past their deadline."""
        horizon = now - self.memory_s
        stale = [
            rid
            for rid, e in self._entries.items()
            if e.expires_at < horizon and e.status() in ("finished", "unknown")
        ]
        for request_id in stale:
            del self._entries[request_id]
        return len(stale)

    # -- internals --------------------------------------------------------------------

    def _entry(self, request_id: str) -> _Entry:
        """The entry to record news in: the news ends what :meth:`forget` may take back
        (the feeding method that records an own decision sets it again)."""
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._entries[request_id] = _Entry()
        entry.own = None
        return entry

    def _settle(self, request_id: str, entry: _Entry) -> None:
        """Re-derive what the entry is indexed under; drop the payload once finished."""
        status = entry.status()
        if status == "finished":
            entry.latest = entry.pinned = None
            entry.prefilled.clear()
            entry.prefilled_at.clear()
        if status == "handoff":
            self._handoffs.add(request_id)
        else:
            self._handoffs.discard(request_id)
        worker = entry.latest.worker_id if status == "active" and entry.latest else None
        if worker == entry.indexed:
            return
        if entry.indexed is not None:
            held = self._by_worker.get(entry.indexed)
            if held is not None:
                held.discard(request_id)
                if not held:
                    del self._by_worker[entry.indexed]
        if worker is not None:
            self._by_worker.setdefault(worker, set()).add(request_id)
        entry.indexed = worker
