"""The scheduler's runtime state: one owner of the queue, the ledger and what feeds them.

:class:`SchedulerState` sits between Faust and the pure core. It owns the
:class:`PendingQueue`, the :class:`Ledger`, the :class:`FleetView`, the
:class:`AssignmentLog`, the drain meter and the cancel memory, and it turns inputs into
calls of the core and the core's decisions into :class:`Effect` values — records to produce
plus the source records to acknowledge once the broker has them. It decides nothing
itself: placement, ordering, expiry, cancellation, worker-loss fates and lease answers are
the core's (``schedule``, ``requeue_lost``, ``lease_refusal``); this class translates,
records and keeps the books consistent. Synchronous and I/O-free: the Faust app calls it
from one event loop, tests drive it directly.

Invariants kept here:

- every request in the pending queue is tracked here (its admitted request and the
  tickets of its source records), and nothing else is;
- every active assignment in the log holds a reservation in the ledger (after
  :meth:`SchedulerState.restore`), placed by the core or restored from the log;
- a request gets one terminal from the scheduler at most: each one is recorded in the
  log before it is sent, and a redelivered copy of a finished request is acked unanswered;
- no attempt is placed twice: a queued request whose attempt the log shows assigned,
  started, streamed, prefilled, ended or lost (placed by another replica, whichever of its
  records was read first), or whose request finished, leaves the queue as soon as that
  record is read (:meth:`SchedulerState._withdraw_decided`), and nothing that the log shows
  decided enters it.

Tracing without OTel: a request's W3C trace context travels as opaque Kafka headers
(:data:`TraceHeaders`) — in with its record, out on every record produced for it. Spans
are written through a :class:`SpanRecorder` the app passes in (the no-op
:class:`NoSpans` by default): at placement, ``llmq.queue`` (from admission, or from the
requeue, to the placement) and under it ``llmq.placement`` (the ``schedule()`` call that
placed it), whose context the assignment carries to the worker; a request the scheduler
ends itself gets its ``llmq.queue`` span with the outcome. Figures for metrics come back
in :class:`TickResult` and the cumulative :attr:`SchedulerState.ended` counts.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from pydantic import JsonValue

from schemas.common import ErrorCode, Lane, Priority
from schemas.control import CancelRequest, LeaseAnswer
from schemas.requests import AdmittedRequest, Assignment
from schemas.status import QueueStatus
from schemas.workers import (
    EventAborted,
    EventDone,
    EventFailed,
    EventFirstToken,
    EventPrefilled,
    EventStarted,
    LifecycleEvent,
    WorkerHeartbeat,
)
from services.scheduler import (
    DrainMeter,
    Ledger,
    PendingQueue,
    Pipeline,
    Placement,
    QueueConfig,
    QueuedRequest,
    Reject,
    Requeue,
    WorkerState,
    lease_refusal,
    requeue_lost,
    schedule,
)
from services.scheduler.policies.filters.replica_turn import turn_of
from services.scheduler.runtime.fleet import FleetView, worker_state
from services.scheduler.runtime.log import AssignmentLog
from services.scheduler.runtime.messages import (
    Outgoing,
    admission_of,
    assignment,
    deadline_of,
    decode_stage,
    queued_request,
    restored_request,
    terminal,
    unreadable,
)
from services.scheduler.runtime.meters import RecentCancels
from services.scheduler.runtime.results import (
    Decision,
    Effect,
    HeldRequeue,
    NoSpans,
    Placed,
    ReplyCheck,
    RuntimeConfig,
    SpanRecorder,
    Ticket,
    TickResult,
    TraceHeaders,
    UnreadableEnding,
    defer_reason,
)

_log = logging.getLogger(__name__)

#: KV of the stand-in worker a restored reservation is booked on (see ``_book``).
_UNBOUNDED: Final = 1 << 62

@dataclass(slots=True)
class _Tracked:
    """A request in the pending queue, as this process holds it."""

    admitted: AdmittedRequest
    queued: QueuedRequest
    #: record: read from a request topic; requeue: after a worker loss; handoff: a decode
    #: stage after its prefill (the last two are the leader's alone).
    origin: Literal["record", "requeue", "handoff"]
    tickets: list[Ticket] = field(default_factory=list)
    #: When it (re-)entered the queue: admission, the requeue, or the hand-off.
    since: float = 0.0
    trace: TraceHeaders = ()
    #: A decode stage's KV-transfer parameters (from its prefill's event.prefilled).
    kv_transfer: Mapping[str, JsonValue] | None = None
    #: A hand-off's prefill stage, whose worker holds the prompt's KV.
    prefill: Assignment | None = None


class SchedulerState:
    """See the module docstring."""

    def __init__(
        self,
        config: RuntimeConfig,
        queue_config: QueueConfig,
        pipeline: Pipeline,
        rng: random.Random,
        spans: SpanRecorder | None = None,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.rng = rng
        self.spans: SpanRecorder = spans or NoSpans()
        #: Terminals the scheduler sent itself since start, by code (for metrics).
        self.ended: dict[ErrorCode, int] = {}
        #: Requests requeued (put back in the queue after their worker was lost), in all.
        self.requeued = 0
        #: Requeues and hand-offs withdrawn from the queue because the log showed them
        #: decided meanwhile: the lost attempt's terminal event came after all, or the
        #: previous leader placed them (:meth:`_withdraw_decided`).
        self.requeues_withdrawn = 0
        # Trace context of each active assignment (what its assignment record carried),
        # for the records of a requeue or a worker_lost ending.
        self._active_trace: dict[str, TraceHeaders] = {}
        self.pending = PendingQueue(queue_config)
        self.ledger = Ledger(kv_safety_margin=config.kv_safety_margin)
        #: (replicas, this one's index) of the placement turns (``set_turns``), and since
        #: when (this process's clock; 0: from the start).
        self.turns = (1, 0)
        self._turns_at = 0.0
        self._warned_replicas = False
        self.fleet = FleetView(config.heartbeat_staleness)
        self.log = AssignmentLog(config.finished_memory_s)
        self.drain = DrainMeter(config.drain_window_s)
        self.cancels = RecentCancels(config.cancel_memory_s)
        #: True once the ledger was rebuilt from the log (:meth:`restore`).
        self.restored = False
        #: Whether the last cycle acted on lost workers (this replica led): requeues are
        #: the leader's alone (:meth:`_give_up_requeues`).
        self.leading = False
        self._tracked: dict[str, _Tracked] = {}
        # Workers whose heartbeat showed a new process since the last loss check: work
        # stamped for an earlier process (Assignment.worker_started_at) is lost (tick).
        self._restarted: set[str] = set()
        # Records of new requests reusing the id of one the log shows not ended yet, by id:
        # held unacked until it does, then refused as any reuse is (on_request, tick).
        self._reuses: dict[str, list[tuple[AdmittedRequest, Ticket, TraceHeaders]]] = {}
        # Placements taken back at a revoke (withdraw): request id -> (attempt, deadline).
        # A redelivered record of one is placed at the next attempt (the one taken back
        # may still land: two runs under one attempt number would interleave for clients).
        self._taken_back: dict[str, tuple[int, float]] = {}
        # worker_lost endings decided and held for their reply-topic check, by (request,
        # attempt): the lost attempt's record, the core's fate and the trace headers of its
        # placement (kept here: prune() drops those of requests not active meanwhile).
        self._held_endings: dict[tuple[str, int],
                                 tuple[Assignment, Reject, TraceHeaders]] = {}
        # Lease renewals asked since the last cycle (heartbeats with ``renew``), by worker,
        # and the incarnations (``started_at``) whose work was declared lost — by this
        # replica for a stale heartbeat, or by any, as a requeue read from the log shows:
        # those may not be renewed (:meth:`_answer_renewals`).
        self._renewals: dict[str, WorkerHeartbeat] = {}
        self._lost_incarnations: dict[str, set[float]] = {}
        self._pending_models: dict[str, list[int]] = {}  # model -> [requests, tokens]
        self._leading_since = 0.0  # when this replica last began to lead
        self._continued = False  # leadership_continued(): the next lapse keeps the above
        # Tickets of queued records withdrawn on an event (placed or ended elsewhere): done,
        # acked with the next cycle's effects (observe_event returns none).
        self._settled: list[Ticket] = []

    # -- fleet ------------------------------------------------------------------------

    def observe_heartbeat(self, hb: WorkerHeartbeat, read_at: float | None = None,
                          source: int | None = None) -> bool:
        """A heartbeat, read at ``read_at`` on this scheduler's clock (None: its ``ts``)
        from partition ``source`` of the heartbeats topic."""
        old = self.fleet.get(hb.worker_id)
        changed = self.fleet.observe(hb, read_at, source)
        if changed and (old is None or old.started_at != hb.started_at):
            self._restarted.add(hb.worker_id)  # work placed on its earlier process is lost
        if hb.renew:
            self._renewals[hb.worker_id] = hb  # answered by the next cycle
        return changed

    def forget_worker(self, worker_id: str) -> bool:
        return self.fleet.forget(worker_id)

    # -- the log: assignments and lifecycle events --------------------------------------

    def observe_assignment(self, record: Assignment, trace: TraceHeaders = ()) -> list[Effect]:
        """An assignment read from ``llmq.assignments`` (ours, or another replica's), with
        the trace headers it carried."""
        previous = self.log.latest(record.request_id)
        handed_on = previous is not None and previous.phase == "prefill" \
            and record.attempt == previous.attempt + 1 and (
                record.phase == "decode"
                or self.log.prefilled(record.request_id, previous.attempt) is not None)
        if previous is not None and previous.attempt < record.attempt and not handed_on:
            # Requeued (by us, or by the replica that led then): the incarnation that held
            # the earlier attempt may not renew its lease (``_answer_renewals``).
            self._lost_incarnation(previous.worker_id, previous.worker_started_at)
        if self.restored:
            # Earlier attempts are over, whatever this record's own status: a follower
            # may read the new attempt's terminal event before its assignment. All but a
            # decode stage's prefill, whose KV stays on its worker until the decode side
            # pulls it: its booking ends when the decode stage starts (observe_event).
            for older in range(1, record.attempt):
                if record.phase != "decode" or older != record.attempt - 1:
                    self.ledger.release(record.request_id, older)
        if not self.log.observe_assignment(record):
            if self.restored and self.log.status(record.request_id) == "handoff" \
                    and self.log.latest(record.request_id) is record:
                self._book(record)  # read after its event.prefilled: its KV waits there
            # Not active (read after its attempt's ending or event.prefilled): placed all
            # the same, so a copy of it queued here must go too.
            withdrawn = self._withdraw_decided(record.request_id, record.assigned_at)
            return [] if withdrawn is None else [withdrawn]
        hb = self.fleet.get(record.worker_id)
        if hb is not None and record.worker_started_at is not None \
                and record.worker_started_at < hb.started_at:
            self._restarted.add(record.worker_id)  # placed on a process since replaced
        if trace:
            self._active_trace[record.request_id] = trace
        withdrawn = self._withdraw_decided(record.request_id, record.assigned_at)
        if self.restored:
            self._book(record)
            if record.attempt == 1 and record.phase != "decode":
                self._another_replica(record)
        return [] if withdrawn is None else [withdrawn]

    def observe_event(self, event: LifecycleEvent, headers: TraceHeaders = (),
                      read_at: float | None = None) -> bool:
        """A lifecycle event, with the headers its record carried (a scheduler's terminal
        event names the admission it ended: ``messages.admission_of``), read at
        ``read_at`` on this scheduler's clock (None: its ``ts``); True when it freed
        capacity (worth a dispatch cycle).

        A terminal event's time counts no later than it was read: stamped ahead (a worker's
        clock far off), it kept the ledger's credit of its KV for good and, first in the
        drain meter's window, stopped every later sample from leaving it (the drain rate
        then grew without bound)."""
        ended_at = event.ts if read_at is None else min(event.ts, read_at)
        self._note_ending(event)
        ran = self.log.latest(event.request_id)  # before a terminal drops it from the log
        admitted_at, deadline = admission_of(headers) if headers else (None, None)
        news = self.log.observe_event(event, admitted_at, deadline, at=ended_at)
        withdrawn = self._withdraw_decided(event.request_id, event.ts)
        if withdrawn is not None:
            self._settled.extend(withdrawn.tickets)
        if isinstance(event, EventStarted):
            # ``at`` (the worker's clock, like its heartbeats) lets the ledger credit capacity
            # freed after the worker's last heartbeat instead of waiting for the next one.
            self.ledger.mark_started(event.request_id, event.attempt, at=event.ts)
            # A decode stage started: it pulls its prompt's KV, which the prefill worker
            # then frees (no credit to older heartbeats: when is the prefill engine's).
            if event.attempt > 1 and self.log.prefilled(event.request_id, event.attempt - 1):
                return self.ledger.release(event.request_id, event.attempt - 1) > 0
            return False
        if isinstance(event, EventFirstToken):
            # Its prompt is computed: no longer prompt work on that worker (core.ledger).
            self.ledger.mark_first_token(event.request_id, event.attempt)
            return False
        if isinstance(event, EventPrefilled):
            # The prefill stage is over on its worker; the leader places the decode stage
            # (tick). Its booking stays until the decode stage starts (the prompt's KV
            # waits there for it), or the request ends; its prompt is computed. Worth a
            # cycle: there is a hand-off.
            self.ledger.mark_first_token(event.request_id, event.attempt)
            return True
        if not isinstance(event, EventDone | EventFailed | EventAborted):
            return False
        # What it ended with bounds what the last heartbeat can have counted of it.
        held = None if event.usage is None else event.usage.total_tokens
        freed = self.ledger.release(event.request_id, event.attempt, at=ended_at,
                                    held_tokens=held) > 0
        for older in range(1, event.attempt):
            # A later attempt ended, so every earlier one is over too: a follower that read
            # no assignment of it (requeue ended while queued, or the record comes later)
            # would otherwise keep the lost attempt booked on its dead worker.
            freed = self.ledger.release(event.request_id, older) > 0 or freed
        if self.log.status(event.request_id) == "finished":
            self._active_trace.pop(event.request_id, None)
        usage = event.usage
        if news and usage is not None and usage.total_tokens > 0 and ran is not None:
            # In the queue's own unit (prompt + max_tokens, as ingest and the pending
            # figures count a request), not the tokens generated: ingest divides the queued
            # tokens by this rate, and a fleet whose answers stop well short of max_tokens
            # would otherwise look max_tokens ÷ generated times slower than it drains.
            self.drain.add(ran.admitted.request.model, ended_at,
                           ran.admitted.prompt_tokens + ran.admitted.request.max_tokens)
        return freed

    def _note_ending(self, event: LifecycleEvent) -> None:
        """A terminal event for the attempt a worker holds, or for a later one, that this
        worker did not send: a scheduler (this replica, or the one that led then) ended a
        lost worker's work and signed the event with its own id, or cancelled the requeue
        (attempt + 1) of it. The incarnation that held the attempt may not renew its lease
        (:meth:`_answer_renewals`), as if its work had been requeued."""
        if not isinstance(event, EventDone | EventFailed | EventAborted):
            return
        holder = self.log.latest(event.request_id)
        if holder is not None and holder.attempt <= event.attempt \
                and holder.worker_id != event.worker_id \
                and self.log.prefilled(event.request_id, holder.attempt) is None:
            # (A prefill stage that handed its KV on is over; what ends a later attempt,
            # its decode stage or what ended it between the stages, cost it nothing.)
            self._lost_incarnation(holder.worker_id, holder.worker_started_at)

    def _decided(self, request_id: str, attempt: int) -> bool:
        """Whether the log shows ``attempt`` of the request placed or ended already (any
        of its records, read in any order), or the request finished: placing that attempt
        would run it twice, or answer a request that has its terminal."""
        return self.log.reached(request_id, attempt) or self.log.status(request_id) == "finished"

    def _withdraw_decided(self, request_id: str, now: float) -> Effect | None:
        """A queued request whose attempt the log now shows decided (:meth:`_decided`)
        leaves the queue; returns the acks of its records (None: nothing withdrawn).

        - A record (read from its topic) that another replica placed: its assignment, or
          an event of that attempt (events are keyed by request, assignments by worker
          slot: either may be read first). Its records are done here.
        - A requeue or a queued hand-off whose earlier attempt ended after all (the worker
          answered, and its event was read after the loss was decided; a prefill worker
          that, its event.prefilled never acknowledged, gave up with event.failed): the
          request is over, placing it would be a second terminal.
        - A requeue or hand-off that the leader before this one placed (its events read
          before its assignment).

        A cancel of it waiting here for the next cycle is the worker's to answer now
        (workers remember cancels), or moot: answering here too would make two terminals.
        It is remembered while the request runs, in case its worker is lost before the
        worker aborts it (as :meth:`on_cancel` does for a running request)."""
        tracked = self._tracked.get(request_id)
        if tracked is None or not self._decided(request_id, tracked.queued.attempt):
            return None
        self.pending.remove(request_id)
        if self.pending.withdraw_cancelled(request_id) \
                and self.log.status(request_id) != "finished":
            self.cancels.add(request_id, tracked.admitted.request.tenant, now, now)
        self._untrack(request_id)
        if tracked.origin != "record":
            _log.warning("scheduler: the %s of %s at attempt %d is withdrawn: the log shows "
                         "it placed or the request ended meanwhile", tracked.origin,
                         request_id, tracked.queued.attempt)
            self.requeues_withdrawn += 1
        return Effect(tickets=tuple(tracked.tickets))

    def restore(self) -> int:
        """Rebuild the ledger from the log (after both topics were read to their end):
        every active assignment books its reservation again. Returns how many."""
        active = self.log.all_active()
        for record in active:
            self._book(record)
        # The prompt's KV waits on a prefill worker until its decode stage starts.
        for prefill in (*self.log.handoffs(), *self.log.pinned()):
            self._book(prefill)
        self.restored = True
        return len(active)

    # -- requests and control -----------------------------------------------------------

    def on_unreadable(self, raw: object, ticket: Ticket, now: float) -> list[Effect]:
        """A request record the caller dead-lettered: if it does not decode and names who
        waits (:func:`unreadable`), ended ``overloaded`` (acked unanswered, its client and
        its tenant's reservation waited out its timeout), recorded as :meth:`_end` records;
        only acked if the request is known here in any way (pending, placed, ended, held
        as a reuse, taken back: a readable copy of it came too) or past the log's memory."""
        cfg = self.config
        found = unreadable(raw, replies_prefix=cfg.replies_prefix, worker_id=cfg.scheduler_id,
                           events_topic=cfg.events_topic, now=now)
        if found is None:
            return [Effect(tickets=(ticket,))]
        request_id = found.request_id
        if self.log.status(request_id) != "unknown" or self.log.reached(request_id, 1) \
                or request_id in self._tracked or request_id in self._reuses \
                or request_id in self._taken_back \
                or found.deadline + self.log.memory_s < now:
            return [Effect(tickets=(ticket,))]
        self.log.mark_ended(request_id, 1, found.deadline, found.admitted_at)
        self.ended["overloaded"] = self.ended.get("overloaded", 0) + 1
        return [Effect(first=(found.reply,), then=(found.event,), tickets=(ticket,),
                       decision=UnreadableEnding(request_id, found.admitted_at))]

    def on_request(
        self, admitted: AdmittedRequest, ticket: Ticket, now: float, trace: TraceHeaders = ()
    ) -> list[Effect]:
        """An admitted request read from its topic (maybe a redelivery), with the trace
        headers its record carried."""
        request_id = admitted.request_id
        status = self.log.status(request_id)
        if self.log.is_reuse(request_id, admitted.admitted_at):
            # Not a redelivery: a new request reusing the id of one that finished (ingest
            # admits it once the first one's reservation is settled). Acked unanswered, as
            # a redelivery is, its client would wait for ever and its tenant's slot stay
            # taken until the reservation expired. The reply is attempt 0 (a client of the
            # first one keeps that one's answer); events start at attempt 1. The ending
            # records this admission in the log (its event names it too, for a restarted
            # scheduler): a redelivery of the reuse is acked, not answered again.
            return [self._end(admitted, 1, "invalid",
                              f"request_id {request_id!r} was used by a request that already "
                              "finished; request ids must be unique: send it with a new one",
                              now, (ticket,), reply_attempt=0, trace=trace)]
        if self.log.is_new_admission(request_id, admitted.admitted_at):
            # The same, read before the first one's ending (ingest admits the reuse once it
            # read that ending; this log may not have yet): acked now it would be answered
            # never. Held, unacked, until the log shows the first one ended (tick).
            self._reuses.setdefault(request_id, []).append((admitted, ticket, trace))
            return []
        if status != "unknown" or self.log.reached(request_id, 1):
            # Assigned and running (its reservation is booked), finished, or requeued
            # after a worker loss (pending at its next attempt), or placed by another
            # replica whose assignment is not read yet (only its events are): nothing more
            # to do.
            return [Effect(tickets=(ticket,))]
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            tracked.tickets.append(ticket)  # a duplicate record of a pending request
            return []
        if deadline_of(admitted) + self.log.memory_s < now:
            # Unknown to the log, which keeps a finished request until memory_s past its
            # deadline: it may have been answered and forgotten since, and answering it
            # now (queue_timeout) could be its second terminal. Nobody waits for it any
            # more (clients give up at the deadline plus a grace; ingest's reservation of
            # it expired): acked unanswered.
            _log.warning("scheduler: %s is past its deadline by more than %g s and unknown "
                         "to the log: acked unanswered", request_id, self.log.memory_s)
            return [Effect(tickets=(ticket,))]
        taken_back = self._taken_back.pop(request_id, None)
        attempt = 1 if taken_back is None else taken_back[0] + 1
        if self.cancels.matches(request_id, admitted.request.tenant, now,
                                admitted.request.created_at):
            self.cancels.discard(request_id, admitted.request.tenant)
            return [self._end(admitted, attempt, "cancelled", "cancelled before it was queued",
                              now, (ticket,), trace=trace)]
        block = self.fleet.block_size(admitted.request.model, now) \
            or self.config.default_block_size
        queued = queued_request(admitted, block, attempt)
        # Always admitted: the record is in memory already. The pause ladder keeps the
        # queue near its bound by pausing the topics (module docstring of runtime.flow).
        self.pending.push(queued, force=True)
        self._track(_Tracked(admitted, queued, "record", [ticket], admitted.admitted_at, trace))
        return []

    def on_cancel(self, cancel: CancelRequest, now: float) -> bool:
        """A cancel command; True when a pending request was cancelled (the next cycle
        reports it). A running one is the worker's to abort: only remembered here, in case
        its worker is lost before it does."""
        queued = self.pending.get(cancel.request_id)
        if queued is not None:
            if queued.tenant != cancel.tenant:
                return False  # a mismatch is ignored (schemas.control)
            return self.pending.cancel(cancel.request_id)
        if self.log.status(cancel.request_id) != "finished":
            self.cancels.add(cancel.request_id, cancel.tenant, cancel.issued_at, now)
        return False

    def drop_sources(self, revoked: set[Hashable], now: float) -> int:
        """Partitions were revoked: their pending requests go to the new owner (they were
        not acked). Requeues stay while this replica leads: nothing on Kafka would bring
        them back (a replica that stops leading gives them back to the log instead,
        :meth:`_give_up_requeues`). Returns how many requests left the queue.

        A request cancelled here but not yet answered (the next cycle would have) goes too,
        unanswered: its record comes back to the new owner, and one terminal must come from
        one owner. The cancel is remembered here (for when the partition comes back), and
        every worker remembers it too, so whoever places it next gets ``cancelled``."""
        dropped = 0
        self._settled = [t for t in self._settled if t[0] not in revoked]
        for request_id, waiting in list(self._reuses.items()):
            ours = [w for w in waiting if w[1][0] not in revoked]  # the rest: the new owner's
            if ours:
                self._reuses[request_id] = ours
            else:
                del self._reuses[request_id]
        for request_id, tracked in list(self._tracked.items()):
            kept = [t for t in tracked.tickets if t[0] not in revoked]
            if len(kept) == len(tracked.tickets):
                continue
            tracked.tickets = kept
            if tracked.origin == "record" and not kept:
                if self.pending.withdraw_cancelled(request_id):
                    self.cancels.add(request_id, tracked.admitted.request.tenant, now, now)
                self.pending.remove(request_id)
                self._untrack(request_id)
                dropped += 1
        return dropped

    def withdraw(self, effect: Effect, now: float) -> bool:
        """Take back what was recorded when ``effect`` was made (its
        :attr:`~Effect.decision`), its records never produced: the app withdrew them from
        the outbox, their source partition revoked. The log, the ledger and the count of
        terminals read as if it had never been decided, so a redelivered record of the
        request is decided afresh if the partition comes back here; a cancel it answered
        is remembered again, as :meth:`drop_sources` does. The request is not queued again:
        its record goes to the partition's new owner. True if something was taken back.

        Nothing is taken back once something else was recorded for the request since
        (:meth:`AssignmentLog.forget`): a record of it read (another replica placed or ended
        it too), or a later decision here (its worker declared lost). Then the decision
        stands and its books with it (at worst, a reservation on a worker it was never
        sent to, until the attempt's terminal event releases it), rather than forgetting
        what came after. Left as they are: spans written, the cycle's placement and
        rejection figures already reported, the lanes' virtual time and the affinity
        memory (policy hints)."""
        decision = effect.decision
        if decision is None:
            return False
        if isinstance(decision, UnreadableEnding):
            if not self.log.forget(decision.request_id, 1, decision.admitted_at):
                return False
            self.ended[decision.code] -= 1
            return True
        admitted = decision.admitted
        request_id = admitted.request_id
        if not self.log.forget(request_id, decision.attempt, admitted.admitted_at):
            _log.warning("scheduler: %s#%d was not produced but cannot be taken back: the "
                         "log recorded more of it since", request_id, decision.attempt)
            return False
        if decision.code is None:
            self.ledger.release(request_id, decision.attempt)
            self._active_trace.pop(request_id, None)
            self._taken_back[request_id] = (decision.attempt, deadline_of(admitted))
            return True
        self.ended[decision.code] -= 1  # not sent: not this scheduler's terminal
        if decision.code == "cancelled":
            self.cancels.add(request_id, admitted.request.tenant, now, now)
        return True

    # -- the dispatch cycle -----------------------------------------------------------

    def tick(self, now: float, *, handle_losses: bool = True,
             log_read_at: float = math.inf,
             heard: Mapping[int, float] | None = None) -> TickResult:
        """Worker loss, then one ``schedule()`` call; everything it decided as effects.

        ``handle_losses``: this replica acts on lost workers. Every replica reads every
        assignment, so every one would requeue or fail the same lost work: only one (the
        app's leader) may. The others learn the outcome from what it produces (the next
        attempt's assignment or the terminal event), which releases their bookings. It
        decides losses and hand-offs once it has led for ``takeover_s``: its log then has
        what the previous leader decided last.

        ``log_read_at``: every assignment written before this wall time has been read
        (:attr:`Snapshot.log_read_at`; one of several replicas places on a worker in its
        turn only once the log is read up to the turn's start; the app's
        ``_log_read_at``).

        ``heard``: per heartbeats partition, every beat written there before that wall time
        has been read; a worker is declared lost only if it was silent by then
        (:meth:`FleetView.may_be_alive`: a stalled reader must not give away work running
        under a valid lease).
        """
        effects: list[Effect] = []
        if self._settled:
            effects.append(Effect(tickets=tuple(self._settled)))
            self._settled = []
        for request_id, waiting in list(self._reuses.items()):
            if self.log.status(request_id) not in ("active", "lost", "handoff"):
                del self._reuses[request_id]  # the first one ended: decided as any record
                for admitted, ticket, trace in waiting:
                    effects.extend(self.on_request(admitted, ticket, now, trace))
        if self.leading and not handle_losses:
            self._give_up_requeues(now)
        if handle_losses and not self.leading and not self._continued:
            self._leading_since = now
        if handle_losses:
            self._continued = False
        self.leading = handle_losses
        taken_over = handle_losses and now - self._leading_since >= self.config.takeover_s
        if taken_over:
            effects.extend(self._adopt_handoffs(now, heard))
        lost = [w for w in self.log.workers()
                if not self.fleet.may_be_alive(w, now, heard)] if taken_over else []
        # A loss given back (leadership lapsed during its reply-topic check) is decided
        # again: it is the same loss, for the log and the metric.
        first_lost = [w for w in lost if not self._lost_before(w)]
        held: list[HeldRequeue] = []
        for worker_id in lost:
            held.extend(self._lose_worker(worker_id, now, effects))
        restarted: list[str] = []
        leases: list[tuple[str, bool]] = []
        if taken_over:
            for worker_id, records in self._replaced_work():
                held.extend(self._lose_worker(worker_id, now, effects, records))
                restarted.append(worker_id)
        if handle_losses:
            leases = self._answer_renewals(now, effects, taken_over)
        else:
            self._renewals.clear()  # the leader answers; a worker asks on every beat
        snapshot = self.fleet.snapshot(now, log_read_at)
        started = time.perf_counter()
        decisions = schedule(
            snapshot, self.pending, self.ledger, self.pipeline, now, self.rng,
            max_placements=self.config.max_placements,
        )
        schedule_s = time.perf_counter() - started
        placements: list[Placed] = []
        rejected: dict[ErrorCode, int] = {}
        deferred: dict[str, int] = {}
        for decision in decisions:
            try:
                if isinstance(decision, Placement):
                    effect, placed = self._placed(decision, now, schedule_s)
                    effects.append(effect)
                    placements.append(placed)
                elif isinstance(decision, Reject):
                    effects.append(self._rejected(decision, now))
                    rejected[decision.code] = rejected.get(decision.code, 0) + 1
                else:
                    label = defer_reason(decision.reason)
                    deferred[label] = deferred.get(label, 0) + 1
            except Exception:
                # A bug translating one decision must not lose the others of the cycle,
                # nor the request itself: a placement that could not be sent goes back to
                # the queue (still tracked, its offset still held) to be tried again.
                _log.exception("scheduler: could not publish %r", decision)
                if isinstance(decision, Placement):
                    self.ledger.release(decision.request.request_id, decision.attempt)
                    tracked = self._tracked.get(decision.request.request_id)
                    if tracked is not None:
                        # What it was queued as, not the stage placed (a prefill stage, or
                        # a decode stage run whole): staged afresh by the next placement.
                        self.pending.push(tracked.queued, force=True)
        placed_n = len(placements)
        self.drain.waiting(now, [m for m, (n, _) in self._pending_models.items() if n > 0])
        more = self.config.max_placements is not None and placed_n >= self.config.max_placements
        return TickResult(effects, placed_n, rejected, len(held), first_lost, schedule_s, more,
                          tuple(placements), deferred, restarted, tuple(held), tuple(leases))

    def leadership_continued(self, continued: bool = True) -> None:
        """Told at every assignment whether this replica led before the rebalance just
        ended and leads after it (it held the leader's partition in both generations:
        nobody else did in between): then its leadership's lapse during the rebalance does
        not start another ``takeover_s``. Otherwise every rebalance, a replica's own
        restart loop or scaling elsewhere in the group, would hold losses, hand-offs and
        renewals for ``takeover_s`` again, and rebalances coming faster than that would
        hold them for good. False at every other assignment: a flag left from an earlier
        one (another rebalance came before a leading tick) skipped the wait of a later,
        genuinely new, leadership (found by an audit)."""
        self._continued = continued

    def leadership_lapsed(self, now: float) -> None:
        """The leader's partition was revoked (a rebalance): this replica leads no more
        until it is assigned again, as a tick that does not lead would say, and gives up
        the requeues it holds. Without it, a replica that no tick saw not leading still
        counted as leading, and leading again later, genuinely anew, it skipped the
        takeover wait (found by an audit)."""
        if self.leading:
            self._give_up_requeues(now)
        self.leading = False

    def _adopt_handoffs(self, now: float,
                        heard: Mapping[int, float] | None = None) -> list[Effect]:
        """Queue the decode stage of every prefill that handed its KV on and is not queued
        here yet (the leader's alone, like requeues: every replica reads the same
        event.prefilled, one places the next attempt). A cancel remembered for it ends it
        instead; a prefill worker no longer alive took the prompt's KV with it, so the
        request starts over, whole. Runs each leading cycle (after ``takeover_s`` of
        leading), so a new leader, or a restarted scheduler, takes over the hand-offs the
        log shows."""
        effects: list[Effect] = []
        for prefill in self.log.handoffs(skip=self._tracked):
            request_id, attempt = prefill.request_id, prefill.attempt + 1
            if self.log.reached(request_id, attempt):
                continue  # the leader before this one placed it: its events came first
            trace = self._active_trace.get(request_id, ())
            tenant = prefill.request.tenant
            if self.cancels.matches(request_id, tenant, now, prefill.request.created_at):
                self.cancels.discard(request_id, tenant)
                effects.append(self._end(prefill.admitted, attempt, "cancelled",
                                         "cancelled after its prefill", now, (),
                                         reply_attempt=attempt, trace=trace))
                continue
            block = self.fleet.block_size(prefill.request.model, now) \
                or self.config.default_block_size
            kv_transfer = self.log.prefilled(request_id, prefill.attempt)
            # The prefill worker's version, while its heartbeat is known (gone, it took the
            # prompt's KV with it, and the request starts over below).
            beat = self.fleet.get(prefill.worker_id)
            queued = decode_stage(prefill, block, kv_transfer,
                                  None if beat is None else beat.model_version)
            self.pending.push(queued, force=True)  # already admitted work
            self._track(_Tracked(prefill.admitted, queued, "handoff", since=now, trace=trace,
                                 kv_transfer=kv_transfer, prefill=prefill))
        for tracked in list(self._tracked.values()):
            if tracked.prefill is None or tracked.queued.phase != "decode" \
                    or tracked.queued.request_id not in self.pending:
                continue  # (not in the queue: cancelled, this cycle reports it)
            if self._prefill_gone(tracked.prefill, now, heard):
                self._start_over(tracked, "whose worker is gone", now)
            elif self._handoff_expired(tracked.prefill, now):
                self._start_over(tracked, "whose KV has waited past handoff_ttl_s "
                                          f"({self.config.handoff_ttl_s:g} s)", now)
        return effects

    def _handoff_expired(self, prefill: Assignment, now: float) -> bool:
        """Whether a hand-off's prompt KV has waited longer than the connector keeps it."""
        ttl = self.config.handoff_ttl_s
        if ttl is None:
            return False
        at = self.log.prefilled_at(prefill.request_id, prefill.attempt)
        return at is not None and now - at > ttl

    def _prefill_gone(self, prefill: Assignment, now: float,
                      heard: Mapping[int, float] | None = None) -> bool:
        """Whether the process that computed a hand-off's prompt is gone (stale as far as
        its heartbeats were read, or replaced by a newer process of the worker): its KV
        went with it."""
        if not self.fleet.may_be_alive(prefill.worker_id, now, heard):
            return True
        hb = self.fleet.get(prefill.worker_id)
        return hb is not None and prefill.worker_started_at is not None \
            and hb.started_at != prefill.worker_started_at

    def _start_over(self, tracked: _Tracked, why: str, now: float) -> None:
        """A queued hand-off whose prompt KV is gone (its prefill worker is gone, or it
        waited too long): the whole request instead, at the same attempt (the prompt is
        computed again)."""
        prefill = tracked.prefill
        assert prefill is not None
        _log.warning("scheduler: %s#%d handed off from %s, %s; placed whole as attempt %d",
                     prefill.request_id, prefill.attempt, prefill.worker_id, why,
                     tracked.queued.attempt)
        block = self.fleet.block_size(prefill.request.model, now) \
            or self.config.default_block_size
        whole = queued_request(prefill.admitted, block, tracked.queued.attempt)
        self.pending.remove(prefill.request_id)
        self.pending.push(whole, force=True)
        tracked.queued, tracked.kv_transfer = whole, None
        self.ledger.release(prefill.request_id, prefill.attempt)  # the KV it held is gone

    def _answer_renewals(self, now: float, effects: list[Effect],
                         taken_over: bool) -> list[tuple[str, bool]]:
        """Answer each worker that asked to renew its lapsed lease (a heartbeat with
        ``renew``; ``services.worker.core.lease``) as the core's :func:`lease_refusal`
        decides. Losses were decided just before, from the same fleet view; "lost" counts
        a stale heartbeat here, or, read from the log (whichever replica led then), a requeue
        or an ending that the attempt's worker did not send (:meth:`_note_ending`). A
        granted worker is alive (its asking heartbeat is fresh), so no later cycle declares
        it lost for the gap. Before ``taken_over`` (``takeover_s`` of leading) the log may
        not show yet that the previous leader declared the incarnation dead: refused (the
        worker carries on as a new incarnation, and what the old one held is decided as a
        restart's loss once taken over)."""
        answered: list[tuple[str, bool]] = []
        for worker_id, hb in self._renewals.items():
            current = self.fleet.get(worker_id)
            reason = lease_refusal(hb.started_at, self._lost_incarnations.get(worker_id, ()),
                                   None if current is None else current.started_at) \
                if taken_over else (
                    f"this scheduler began to lead less than takeover_s "
                    f"({self.config.takeover_s:g} s) ago: the previous leader may have "
                    "declared this incarnation dead")
            answer = LeaseAnswer(worker_id=worker_id, started_at=hb.started_at, seq=hb.seq,
                                 granted=not reason, reason=reason,
                                 issued_by=self.config.scheduler_id, issued_at=now)
            effects.append(Effect(first=(Outgoing.of(self.config.control_topic, answer),)))
            answered.append((worker_id, not reason))
            log = _log.info if not reason else _log.warning
            log("scheduler: lease of worker %s (incarnation %.3f, heartbeat %d) %s", worker_id,
                hb.started_at, hb.seq, "renewed" if not reason else f"not renewed: {reason}")
        self._renewals.clear()
        return answered

    def release(self, held: HeldRequeue, answered: bool, now: float) -> list[Effect]:
        """The reply-topic check of a held requeue is back: requeue it, or, if its attempt
        was answered (or its terminal event was read meanwhile), end it there."""
        record = held.record
        if self.log.status(record.request_id) == "finished":
            return []  # the worker's terminal event came meanwhile: nothing to add
        if not self.leading:
            self._undo_loss(record)  # leadership moved during the check: the leader decides
            return []
        if not answered:
            return self._requeue(record, held.fate, now)
        _log.warning("scheduler: %s#%d was answered before its worker was lost (its terminal "
                     "event is missing): not requeued", record.request_id, record.attempt)
        effect = self._end(record.admitted, record.attempt, "worker_lost",
                           f"{held.fate.reason}; answered before", now, (),
                           trace=self._active_trace.get(record.request_id, ()))
        self.answered_after_all("worker_lost")
        return [Effect(then=effect.then)]  # the event only: the reply is there

    def statuses(self, now: float) -> list[QueueStatus]:
        """``QueueStatus`` per model: queued demand, reserved KV, drain rate, live fleet."""
        running: dict[str, int] = {}
        for worker_id in self.log.workers():
            for reservation in self.ledger.reservations(worker_id):
                if reservation.request.phase == "prefill":
                    continue  # on a prefill worker: not in the live KV ingest counts
                model = reservation.request.model
                running[model] = running.get(model, 0) + reservation.kv_tokens
        live: dict[str, list[int]] = {}  # model -> [workers, largest usable KV]
        for hb in self.fleet.live(now):
            figures = live.setdefault(hb.model, [0, 0])
            if not hb.draining and hb.role != "prefill":  # as ingest counts the fleet
                figures[0] += 1
                figures[1] = max(figures[1], self.ledger.usable_kv(worker_state(hb)))
        models = set(self._pending_models) | set(running) | set(live) | set(self.drain.models())
        out = []
        for model in sorted(models):
            requests, tokens = self._pending_models.get(model, (0, 0))
            workers, usable = live.get(model, (0, 0))
            out.append(
                QueueStatus(
                    model=model,
                    scheduler_id=self.config.scheduler_id,
                    pending_requests=requests,
                    pending_tokens=tokens,
                    running_tokens=running.get(model, 0),
                    drain_tokens_per_s=self.drain.rate(model, now),
                    live_workers=workers,
                    max_usable_kv_tokens=usable,
                    ts=now,
                )
            )
        return out

    def prune(self, now: float) -> list[str]:
        """Forget what has expired; returns the workers forgotten (for their metrics)."""
        self.log.prune(now)
        self.cancels.prune(now)
        held = set(self.log.workers()) | set(self._renewals)
        gone = self.fleet.prune(now, held)
        for worker_id in gone:
            self._restarted.discard(worker_id)  # followers never clear it otherwise
        # Lost incarnations are kept (a float each): a process declared lost may thaw and
        # ask to renew its lease after a newer one came and went and was forgotten (found
        # by a review: pruned once a newer process beat, it was granted).
        # A taken-back placement whose record went to another replica (or a requeue or
        # decode stage, which no record brings back) is not asked for again.
        for request_id in [r for r, (_, deadline) in self._taken_back.items() if deadline < now]:
            del self._taken_back[request_id]
        # Contexts of assignments whose end this replica never saw (replay order, another
        # replica's requests): keep only what is still active.
        for request_id in [r for r in self._active_trace
                           if self.log.status(r) not in ("active", "handoff")]:
            del self._active_trace[request_id]
        return gone

    # -- views --------------------------------------------------------------------------

    def depth(self) -> dict[tuple[Priority, Lane], int]:
        return self.pending.counts()

    def tracked(self) -> int:
        return len(self._tracked)

    def reserved_kv(self, worker_id: str) -> int:
        return self.ledger.reserved_kv(worker_id)

    def reserved_by_worker(self) -> dict[str, int]:
        """KV tokens reserved per worker, for every worker known (heartbeat or bookings)."""
        workers = set(self.fleet.workers()) | set(self.log.workers())
        return {w: self.ledger.reserved_kv(w) for w in sorted(workers)}

    # -- internals --------------------------------------------------------------------

    def _placed(self, placement: Placement, now: float, schedule_s: float) -> tuple[Effect, Placed]:
        request = placement.request
        hb = self.fleet.get(placement.worker_id)
        tracked = self._tracked[request.request_id]
        record = assignment(tracked.admitted, placement, now,
                            engine_priority=self.pending.engine_priority(request, now),
                            worker_started_at=None if hb is None else hb.started_at,
                            kv_transfer=tracked.kv_transfer
                            if placement.phase == "decode" else None)
        trace = tracked.trace
        if self.spans.active:
            attributes = _attributes(tracked, placement.attempt)
            queue = self.spans.span("llmq.queue", trace, tracked.since, now,
                                    {**attributes, "llmq.outcome": "placed"})
            # The decision is one schedule() call for the whole cycle: that call's duration.
            trace = self.spans.span(
                "llmq.placement", queue, now, now + schedule_s,
                {**attributes, "llmq.worker": placement.worker_id,
                 "llmq.kv_tokens": placement.kv_tokens},
            )
        out = Outgoing.of(self.config.assignments_topic, record, partition=placement.partition,
                          headers=trace)
        # Only once the record could be built: until here a failure leaves the request
        # queued and tracked (tick pushes it back), and the log without its placement.
        self._untrack(request.request_id)
        self.log.observe_assignment(record, own=True)
        if trace:
            self._active_trace[request.request_id] = trace
        placed = Placed(placement.worker_id, request.priority, request.lane,
                        max(0.0, now - tracked.since), placement.phase)
        decision = Decision(tracked.admitted, placement.attempt) if tracked.tickets else None
        return Effect(first=(out,), tickets=tuple(tracked.tickets), decision=decision), placed

    def _rejected(self, reject: Reject, now: float) -> Effect:
        tracked = self._untrack(reject.request_id)
        trace = tracked.trace
        if self.spans.active:
            trace = self.spans.span(
                "llmq.queue", trace, tracked.since, now,
                {**_attributes(tracked, tracked.queued.attempt), "llmq.outcome": reject.code},
            )
        return self._end(
            tracked.admitted, tracked.queued.attempt, reject.code, reject.reason,
            now, tuple(tracked.tickets), reject.retry_after_s,
            trace=trace,
        )

    def _replaced_work(self) -> list[tuple[str, list[Assignment]]]:
        """Per restarted worker, its active assignments stamped for an earlier process."""
        found = []
        for worker_id in self._restarted:
            hb = self.fleet.get(worker_id)
            records = [] if hb is None else [
                a for a in self.log.active_on(worker_id)
                if a.worker_started_at is not None and a.worker_started_at < hb.started_at
            ]
            if records:
                found.append((worker_id, records))
        self._restarted.clear()
        return found

    def _lose_worker(
        self, worker_id: str, now: float, effects: list[Effect],
        records: list[Assignment] | None = None,
    ) -> list[HeldRequeue]:
        """The core decides each held request's fate; this records it, adds the endings to
        ``effects`` and returns the requeues, held for the reply-topic check.
        ``records``: the worker restarted, and only these (its earlier process's) are lost."""
        held = {a.request_id: a for a in
                (self.log.active_on(worker_id) if records is None else records)}
        if records is None:  # stale: the incarnations that held this work may not renew
            hb = self.fleet.get(worker_id)
            for started_at in {a.worker_started_at for a in held.values()} | {
                    None if hb is None else hb.started_at}:
                self._lost_incarnation(worker_id, started_at)
        for record in held.values():
            if self.ledger.worker_of(record.request_id, record.attempt) is None:
                self._book(record)  # keeps "every active assignment is booked" true
        streamed = {rid for rid, a in held.items() if self.log.streamed(rid, a.attempt)}
        only = None if records is None else [(a.request_id, a.attempt) for a in records]
        requeues: list[HeldRequeue] = []
        for fate in requeue_lost(self.ledger, worker_id, streamed, only):
            rid = fate.request.request_id if isinstance(fate, Requeue) else fate.request_id
            if rid not in held:
                # Booked with no active assignment here (already ended or requeued as the
                # log shows): dropping the booking is all there is to do.
                _log.warning("scheduler: %s was booked on lost worker %s without an active "
                             "assignment; booking dropped", rid, worker_id)
                continue
            if isinstance(fate, Requeue):
                record = held[fate.request.request_id]
                self.log.mark_lost(record.request_id, record.attempt)
                requeues.append(HeldRequeue(record, fate, _reply_check(record)))
            else:
                # Held, as a requeue is, until the reply-topic check is back: marked lost
                # (its booking went with the worker's; no later cycle decides it again),
                # recorded ended only when its ending goes (settle_endings).
                record = held[fate.request_id]
                self.log.mark_lost(record.request_id, record.attempt)
                self._held_endings[(record.request_id, record.attempt)] = (
                    record, fate, self._active_trace.get(record.request_id, ()))
                effects.append(Effect(unless_answered=_reply_check(record)))
        return requeues

    def _give_up_requeues(self, now: float) -> None:
        """This replica stopped leading: requeues it decided but did not place are the new
        leader's to decide, or two replicas would place the same attempt. Each goes back to
        what the log showed before (its lost attempt active on the dead worker, booked),
        so whoever leads requeues it once; its record on Kafka never left the log."""
        for request_id, tracked in list(self._tracked.items()):
            if tracked.origin == "handoff":
                # Its prefill's event.prefilled is in the log: the next leader places it.
                if self.pending.withdraw_cancelled(request_id):
                    self.cancels.add(request_id, tracked.admitted.request.tenant, now, now)
                self.pending.remove(request_id)
                self._untrack(request_id)
                continue
            if tracked.origin != "requeue":
                continue
            record = self.log.latest(request_id)
            if self.pending.withdraw_cancelled(request_id):
                # A cancel read here (each replica reads each command once): remembered, so
                # the next leader's requeue of it ends cancelled, as drop_sources does.
                self.cancels.add(request_id, tracked.admitted.request.tenant, now, now)
            self.pending.remove(request_id)
            self._untrack(request_id)
            self.requeued -= 1  # not done: whoever leads next requeues it (and counts it)
            if record is not None and record.attempt == tracked.queued.attempt - 1:
                self._undo_loss(record)
            _log.info("scheduler: no longer leading; requeue of %s#%d left to the leader",
                      request_id, tracked.queued.attempt)

    def _undo_loss(self, record: Assignment) -> None:
        if self.log.reached(record.request_id, record.attempt + 1):
            return  # the leader requeued it meanwhile (a record of the next attempt is read)
        self.log.unmark_lost(record.request_id, record.attempt)
        if self.ledger.worker_of(record.request_id, record.attempt) is None:
            self._book(record)  # every active assignment is booked
        hb = self.fleet.get(record.worker_id)
        if hb is not None and record.worker_started_at is not None \
                and record.worker_started_at < hb.started_at:
            # Lost to a restart, which no later heartbeat shows again (a stale worker is
            # found stale again): whoever leads next must see it (_replaced_work).
            self._restarted.add(record.worker_id)

    def _lost_before(self, worker_id: str) -> bool:
        """Whether the worker's current process was declared lost already."""
        hb = self.fleet.get(worker_id)
        return hb is not None and hb.started_at in self._lost_incarnations.get(worker_id, ())

    def _lost_incarnation(self, worker_id: str, started_at: float | None) -> None:
        if started_at is not None:
            self._lost_incarnations.setdefault(worker_id, set()).add(started_at)

    def _requeue(self, record: Assignment, fate: Requeue, now: float) -> list[Effect]:
        request = fate.request
        if self.log.reached(request.request_id, request.attempt):
            _log.warning("scheduler: %s#%d was placed again meanwhile (attempt %d is in the "
                         "log); no requeue", request.request_id, record.attempt,
                         request.attempt)
            return []
        # The lost attempt's placement is the parent of what happens to the request next.
        trace = self._active_trace.pop(request.request_id, ())
        if self.cancels.matches(request.request_id, request.tenant, now,
                                record.admitted.request.created_at):
            self.cancels.discard(request.request_id, request.tenant)
            return [self._end(record.admitted, request.attempt, "cancelled",
                              "cancelled while its worker was lost", now, (),
                              reply_attempt=request.attempt, trace=trace)]
        for older in range(1, request.attempt):  # from the start: whatever an earlier
            self.ledger.release(request.request_id, older)  # stage held is over
        self.pending.push(request, force=True)  # already admitted work: past the bound
        self._track(_Tracked(record.admitted, request, "requeue", since=now, trace=trace))
        self.requeued += 1
        return []

    def settle_endings(self, effects: list[Effect], answered: Collection[tuple[str, int]],
                       now: float) -> list[Effect]:
        """The reply-topic check of ``worker_lost`` endings (:attr:`Effect.unless_answered`)
        is back, ``answered`` holding the attempts found answered: what to send of them.
        Until now each was held, its attempt marked lost in the log (:meth:`_lose_worker`).

        - Ended meanwhile (its worker's terminal event was read after all, or another
          leader's ending or requeue): nothing.
        - This replica no longer leads (leadership moved during the check): nothing, and
          the loss is given back, as a held requeue's is (:meth:`_undo_loss`): active on
          its worker again and booked, so whoever leads decides it, this replica included
          once it leads again. (Before, the log kept it ended here: with one replica, whose
          leadership lapses at a rebalance, or when leadership came back before another
          replica's ending was read, nobody ever answered it.)
        - An answered attempt (its worker answered and died before its event): its event
          only, no second reply.
        - Otherwise the ending, recorded in the log now. Effects without a check pass
          through."""
        out: list[Effect] = []
        for effect in effects:
            check = effect.unless_answered
            if check is None:
                out.append(effect)
                continue
            held = self._held_endings.pop((check[0], check[1]), None)
            if held is None:
                continue  # settled already
            record, fate, trace = held
            request_id, attempt = record.request_id, record.attempt
            if self.log.status(request_id) == "finished" \
                    or self.log.reached(request_id, attempt + 1):
                continue
            if not self.leading:
                _log.info("scheduler: no longer leading; the worker_lost ending of %s#%d is "
                          "left to the leader", request_id, attempt)
                self._undo_loss(record)
                continue
            ending = self._end(record.admitted, attempt, fate.code, fate.reason, now, (),
                               trace=trace)
            if (request_id, attempt) in answered:
                _log.warning("scheduler: %s#%d was answered before its worker was lost (its "
                             "terminal event is missing): no worker_lost reply", request_id,
                             attempt)
                ending = Effect(then=ending.then)  # the event only
                self.answered_after_all("worker_lost")
            out.append(ending)
        return out

    def answered_after_all(self, code: ErrorCode) -> None:
        """An ending of ``code`` decided here whose reply was then found on its reply topic
        (the worker had answered): only its event goes, so it is not this scheduler's
        terminal and leaves the count (``llmq_requests_total`` counts a request once; the
        exporter adds only increases, so later endings make up for it)."""
        if self.ended.get(code, 0) > 0:
            self.ended[code] -= 1

    def _end(
        self,
        admitted: AdmittedRequest,
        attempt: int,
        code: ErrorCode,
        reason: str,
        now: float,
        tickets: tuple[Ticket, ...],
        retry_after_s: float | None = None,
        reply_attempt: int | None = None,
        trace: TraceHeaders = (),
    ) -> Effect:
        """One scheduler-side terminal: recorded first, then the reply, then the event, which
        carries this scheduler's id as its ``worker_id`` (:meth:`_note_ending` tells such an
        ending of a worker's attempt from the worker's own)."""
        request_id = admitted.request_id
        if reply_attempt is None:
            # Attempt 1 still pending never reached a worker: Error's attempt is 0 then.
            reply_attempt = 0 if attempt == 1 and self.log.latest(request_id) is None else attempt
        self.log.mark_ended(request_id, attempt, deadline_of(admitted), admitted.admitted_at)
        self._active_trace.pop(request_id, None)
        self.ended[code] = self.ended.get(code, 0) + 1
        reply, event = terminal(
            admitted, code=code, message=reason, attempt=attempt, reply_attempt=reply_attempt,
            worker_id=self.config.scheduler_id, events_topic=self.config.events_topic, now=now,
            retry_after_s=retry_after_s, headers=trace,
        )
        decision = Decision(admitted, attempt, code) if tickets else None
        return Effect(first=(reply,), then=(event,), tickets=tickets, decision=decision)

    def set_turns(self, turns: tuple[int, int], pipeline: Pipeline, now: float) -> None:
        """Place in turns among ``turns`` = (replicas, this one's index) from now on, with
        ``pipeline`` (its ``replica-turn`` filter says so; none for one replica)."""
        self.turns, self.pipeline, self._turns_at = turns, pipeline, now

    def _another_replica(self, record: Assignment) -> None:
        """A first placement read back that this replica did not make. Said once when it
        cannot be a replica taking its turn: this one thinks itself alone (for 5 s already:
        not a replica that has just joined), or it placed in this one's turn."""
        cfg = self.config
        if self._warned_replicas or record.assigned_at < self._turns_at + 5.0:
            return
        replicas, index = self.turns
        if replicas == 1:
            self._warned_replicas = True
            _log.warning("scheduler: another scheduler placed %s on %s while this one places "
                         "alone: schedulers of other consumer groups (another "
                         "LLMQ_SCHEDULER_APP_NAME), or replicas told LLMQ_SCHEDULER_REPLICAS=1, "
                         "overcommit the workers they share", record.request_id,
                         record.worker_id)
        elif turn_of(record.worker_id, record.assigned_at, replicas, cfg.turn_slot_s,
                     cfg.turn_guard_s) == index:
            self._warned_replicas = True
            _log.warning("scheduler: another scheduler replica placed %s on %s in this "
                         "replica's turn (%d of %d): each replica needs its own "
                         "LLMQ_SCHEDULER_SCHEDULER_ID (or LLMQ_SCHEDULER_REPLICA_INDEX), the "
                         "same TURN settings, and clocks in step", record.request_id,
                         record.worker_id, index, replicas)

    def _book(self, record: Assignment) -> None:
        """Book an existing assignment's reservation in the ledger.

        It is a fact, not a request: it is booked on a stand-in of the worker with
        unbounded KV so the ledger cannot refuse it. If the worker since reports less KV,
        its books exceed its usable KV and the ledger's free KV is 0: fail closed, no new
        work there until releases bring it back under.
        """
        known = self.fleet.state(record.worker_id)
        stand_in = (
            replace(known, kv_total_tokens=_UNBOUNDED, kv_free_tokens=_UNBOUNDED)
            if known is not None
            else WorkerState(
                worker_id=record.worker_id, model=record.request.model, model_version=None,
                pool="any", partition=record.partition, kv_total_tokens=_UNBOUNDED,
                kv_free_tokens=_UNBOUNDED, block_size=1, running=0, waiting=0,
                max_num_seqs=1, draining=True, heartbeat_ts=0.0, tokens_per_s=0.0,
            )
        )
        block = self.fleet.block_size(record.request.model) or self.config.default_block_size
        self.ledger.reserve(stand_in, restored_request(record, block))
        if self.log.started(record.request_id, record.attempt):
            # Its started event may have been read before the booking (replay order).
            self.ledger.mark_started(record.request_id, record.attempt)
        if self.log.streamed(record.request_id, record.attempt) \
                or self.log.prefilled(record.request_id, record.attempt) is not None:
            self.ledger.mark_first_token(record.request_id, record.attempt)

    def _track(self, tracked: _Tracked) -> None:
        self._tracked[tracked.queued.request_id] = tracked
        figures = self._pending_models.setdefault(tracked.queued.model, [0, 0])
        figures[0] += 1
        figures[1] += tracked.queued.prompt_tokens + tracked.queued.max_tokens

    def _untrack(self, request_id: str) -> _Tracked:
        tracked = self._tracked.pop(request_id)
        model = tracked.queued.model
        figures = self._pending_models[model]
        figures[0] -= 1
        figures[1] -= tracked.queued.prompt_tokens + tracked.queued.max_tokens
        if figures[0] == 0:
            del self._pending_models[model]
        return tracked


def _reply_check(record: Assignment) -> ReplyCheck:
    """Where an attempt's terminal reply would be."""
    reply_topic = record.admitted.reply_topic
    return (record.request_id, record.attempt, reply_topic,
            record.request_id.encode(), record.assigned_at)  # replies' key: request_id


def _attributes(tracked: _Tracked, attempt: int) -> dict[str, str | int | float]:
    request = tracked.admitted.request
    return {
        "llmq.request_id": request.request_id, "llmq.tenant": request.tenant,
        "llmq.priority": tracked.queued.priority, "llmq.lane": tracked.queued.lane,
        "llmq.attempt": attempt, "gen_ai.request.model": request.model,
    }
