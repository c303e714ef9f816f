"""What :class:`~services.scheduler.runtime.state.SchedulerState` is given and gives back.

Its config (:class:`RuntimeConfig`), the :class:`Effect` values the Faust app performs
(records to produce, then source records to acknowledge), the figures of one cycle for
metrics (:class:`TickResult`, :class:`Placed`, :func:`defer_reason`), the lost work that
waits for a reply-topic check (:class:`HeldRequeue`), and the span recorder it writes
traces through (:class:`SpanRecorder`; :class:`NoSpans` records nothing). Plain values,
no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

from schemas.common import ErrorCode, Lane, Phase, Priority
from schemas.requests import AdmittedRequest, Assignment
from services.scheduler import Requeue
from services.scheduler.runtime.messages import Outgoing

#: A source record to acknowledge: (topic-partition, offset).
Ticket = tuple[Hashable, int]

#: Kafka headers carrying a request's trace context (W3C traceparent), opaque here.
TraceHeaders = tuple[tuple[str, bytes], ...]


class SpanRecorder(Protocol):
    """Writes a finished span under the context ``parent`` carries; returns headers that
    carry the new span (or ``parent`` itself when nothing is recorded). ``active`` is False
    when nothing would be recorded, so callers skip building attributes."""

    @property
    def active(self) -> bool: ...

    def span(
        self, name: str, parent: TraceHeaders, start: float, end: float,
        attributes: Mapping[str, str | int | float],
    ) -> TraceHeaders: ...


class NoSpans:
    """Records nothing; the parent's context passes through unchanged."""

    active = False

    def span(
        self, name: str, parent: TraceHeaders, start: float, end: float,
        attributes: Mapping[str, str | int | float],
    ) -> TraceHeaders:
        return parent


#: Bounded labels of ``llmq_placement_failures_total``, by the prefix of the core's
#: ``Defer.reason`` (services/scheduler/core/cycle.py words them; a test pins the mapping).
_DEFER_REASONS: Final = (
    ("no fresh worker", "saturated"),
    ("only draining", "draining"),
    ("no room", "no_room"),
    ("refused by hold", "held"),
    ("refused by", "filtered"),
    ("ledger refused", "ledger"),
    ("waits for a worker heard from lately", "returning"),
)


def defer_reason(reason: str) -> str:
    """The bounded label for a ``Defer.reason`` ("other" for wording not known here)."""
    for prefix, label in _DEFER_REASONS:
        if reason.startswith(prefix):
            return label
    return "other"

#: Where a lost attempt's terminal reply would be, for ``services.common.answered``:
#: (request_id, attempt, reply topic, reply key, assigned_at).
ReplyCheck = tuple[str, int, str, bytes, float]


@dataclass(frozen=True, slots=True)
class Effect:
    """Records to produce, then source records to acknowledge.

    ``first`` goes out first; ``then`` once ``first`` is acknowledged (a terminal event
    only after its reply is durable); ``tickets`` are acked once both are.
    """

    first: tuple[Outgoing, ...] = ()
    then: tuple[Outgoing, ...] = ()
    tickets: tuple[Ticket, ...] = ()
    #: A worker_lost ending: its reply is dropped if the attempt's terminal is on the reply
    #: topic already (``services.common.answered``).
    unless_answered: ReplyCheck | None = None
    #: Set on every effect that acks request records (``tickets``): a placement or an
    #: ending of a request read from a request topic. What the state recorded when it made
    #: it, for :meth:`SchedulerState.withdraw` to take back should these records never be
    #: produced.
    decision: Decision | UnreadableEnding | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """A placement or scheduler-side ending of a request read from its topic (attempt 1).

    Only those: requeues and hand-offs ack no record, so no revoked partition takes them
    elsewhere, and taking one back would need the lost or prefilled attempt it replaced
    in the log (gone from the log's entry once the new attempt was recorded).
    """

    admitted: AdmittedRequest
    attempt: int
    #: The ending's code; None: a placement.
    code: ErrorCode | None = None


@dataclass(frozen=True, slots=True)
class UnreadableEnding:
    """The ``overloaded`` ending of a request record that did not decode
    (:meth:`SchedulerState.on_unreadable`): what :meth:`SchedulerState.withdraw` needs to
    take it back."""

    request_id: str
    admitted_at: float
    code: ErrorCode = "overloaded"


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """What the state needs to know besides the core's config."""

    scheduler_id: str
    assignments_topic: str
    events_topic: str
    status_topic: str
    control_topic: str = "llmq.control"
    #: Where reply topics are (``<prefix>.replies.``): an unreadable request's is checked.
    replies_prefix: str = "llmq.replies."
    default_block_size: int = 16
    max_placements: int | None = 512
    kv_safety_margin: float = 0.05
    heartbeat_staleness: float = 3.0
    drain_window_s: float = 30.0
    cancel_memory_s: float = 86_400.0
    finished_memory_s: float = 3600.0
    #: The replicas' turns on each worker (``policies.filters.replica_turn``): to tell
    #: another replica's placement in this one's turn when it is read back.
    turn_slot_s: float = 0.5
    turn_guard_s: float = 0.05
    #: A replica that begins to lead waits this long before it decides worker losses and
    #: places hand-offs, so that it reads first the requeues, endings and decode stages
    #: the previous leader sent: past the previous leader's send timeout (10 s), which may
    #: still deliver a decision it made.
    takeover_s: float = 15.0
    #: How long a prefill worker's KV connector keeps an unread prompt's KV (None: as long
    #: as the worker lives). A decode stage still queued this long after its hand-off would
    #: find the KV gone, so the request starts over whole instead.
    handoff_ttl_s: float | None = None


@dataclass(frozen=True, slots=True)
class Placed:
    """One placement of a cycle, as metrics see it."""

    worker_id: str
    priority: Priority
    lane: Lane
    #: From admission (or the requeue, or the hand-off) to this placement, in seconds.
    waited_s: float
    #: The stage placed (a decode stage is the second placement of its request).
    phase: Phase = "whole"


@dataclass(frozen=True, slots=True)
class TickResult:
    """What one dispatch cycle produced, with figures for metrics."""

    effects: list[Effect]
    placed: int
    rejected: dict[ErrorCode, int]
    #: Lost work held this cycle for its reply-topic check (``held``): requeued, or
    #: ended, once that is back (``SchedulerState.requeued`` counts the requeues done).
    requeued: int
    #: Workers declared lost this cycle; not again when a loss given back (leadership
    #: lapsed during its check) is decided again.
    lost_workers: list[str]
    schedule_s: float
    #: True when the cycle stopped at ``max_placements``: run another one soon.
    more: bool
    placements: tuple[Placed, ...] = ()
    #: Class heads deferred this cycle, by :func:`defer_reason` label.
    deferred: Mapping[str, int] = field(default_factory=dict)
    #: Live workers seen restarted, whose earlier process's work was requeued or ended.
    restarted_workers: list[str] = field(default_factory=list)
    #: Lost work to requeue once its reply topic shows no terminal for it
    #: (:meth:`SchedulerState.release`).
    held: tuple[HeldRequeue, ...] = ()
    #: Lease renewals answered this cycle: (worker_id, granted).
    leases: tuple[tuple[str, bool], ...] = ()


@dataclass(frozen=True, slots=True)
class HeldRequeue:
    """A lost attempt that streamed nothing, to requeue unless it was answered after all.

    Its worker may have sent a terminal reply without a token before it (a cancel or a
    timeout during prefill, an empty completion) and died before the terminal event:
    requeueing it would be a second terminal. So the requeue waits for the caller's read
    of the reply partition (``services.common.answered``); meanwhile the log holds the attempt as
    lost, so a redelivered intake record is skipped and a restarted scheduler decides it
    again.
    """

    record: Assignment
    fate: Requeue
    check: ReplyCheck
