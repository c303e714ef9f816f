"""Between wire messages and the core's values: one function per translation, no decisions.

- :func:`queued_request`: an ``AdmittedRequest`` as the core's ``QueuedRequest`` (its KV
  reservation rounded up to whole blocks, its queue deadline, its place in line);
- :func:`assignment`: a ``Placement`` as the ``Assignment`` for the chosen worker;
- :func:`decode_stage`: the decode stage of a prefill stage that reported
  ``event.prefilled``;
- :func:`terminal`: a scheduler-side ending (``Reject`` code) as the terminal ``Error`` for
  the client and the matching terminal event for ingest (docs/live-system.md, "Who sends
  the terminal reply");
- :func:`admission_of`: the admission a scheduler's terminal event ended, from the headers
  :func:`terminal` gives it (:data:`ADMITTED_AT_HEADER`, :data:`DEADLINE_HEADER`);
- :class:`Outgoing`: an encoded record to produce (topic, partition, key, value, headers:
  the request's trace context).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from pydantic import JsonValue

from schemas.base import WireMessage
from schemas.codec import SALVAGE_ERRORS, encode, undecodable_json
from schemas.common import ErrorCode
from schemas.messages import REQUEST_ADAPTER
from schemas.replies import Error, Usage
from schemas.requests import AdmittedRequest, Assignment
from schemas.topics import message_key
from schemas.workers import EventAborted, EventFailed
from services.scheduler import Placement, QueuedRequest

_log = logging.getLogger(__name__)

#: Headers of the scheduler's own terminal events: the ``admitted_at`` and the deadline of
#: the admission they end (``repr`` of the float, exact). Lifecycle events carry neither
#: (schema 5), and a request the scheduler ended without placing it has no assignment in
#: the log, so without them a replica that reads only the event (a follower, a restarted
#: scheduler) could not tell a redelivery of it from a new request reusing its id, nor
#: keep its entry until its deadline. Other readers ignore them.
ADMITTED_AT_HEADER: Final = "llmq-admitted-at"
DEADLINE_HEADER: Final = "llmq-deadline"


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One record to produce; ``partition`` None lets the producer's partitioner choose;
    ``headers`` carry the request's W3C trace context."""

    topic: str
    key: bytes
    value: bytes
    partition: int | None = None
    headers: tuple[tuple[str, bytes], ...] = ()

    @classmethod
    def of(
        cls, topic: str, msg: WireMessage, partition: int | None = None,
        headers: tuple[tuple[str, bytes], ...] = (),
    ) -> Outgoing:
        return cls(topic, message_key(msg), encode(msg), partition, headers)


def kv_tokens_for(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV token slots a request may hold: prompt + max_tokens rounded up to whole blocks
    (the rule of ``services.ingest.core.tokens.kv_tokens_for``)."""
    blocks = -(-(prompt_tokens + max_tokens) // block_size)
    return max(1, blocks * block_size)


def deadline_of(admitted: AdmittedRequest) -> float:
    """End of the request's end-to-end budget: ``created_at + timeout_s``."""
    return admitted.request.created_at + admitted.request.timeout_s


def queued_request(
    admitted: AdmittedRequest, block_size: int, attempt: int = 1, kv_tokens: int | None = None
) -> QueuedRequest:
    """The core's value for an admitted request.

    ``enqueued_at`` is the admission time, so a request keeps its place in line across a
    scheduler restart and a requeue; attempt 1 is the first placement (Assignment.attempt
    starts at 1). ``kv_tokens`` overrides the estimate (a restored reservation keeps the
    exact amount its assignment carried).
    """
    request = admitted.request
    return QueuedRequest(
        request_id=request.request_id,
        tenant=request.tenant,
        model=request.model,
        model_version=request.model_version,
        priority=admitted.priority,
        lane=admitted.lane,
        prompt_tokens=admitted.prompt_tokens,
        max_tokens=request.max_tokens,
        kv_tokens=(
            kv_tokens
            if kv_tokens is not None
            else kv_tokens_for(admitted.prompt_tokens, request.max_tokens, block_size)
        ),
        enqueued_at=admitted.admitted_at,
        deadline=deadline_of(admitted),
        attempt=attempt,
        prefix_hash=request.prefix_hash,
    )


def restored_request(assignment: Assignment, block_size: int) -> QueuedRequest:
    """The reservation an assignment stands for, exactly as it was placed (a prefill
    stage with the whole request's reservation beside it, at ``block_size``, for when it
    must start over)."""
    queued = queued_request(
        assignment.admitted, 1, attempt=assignment.attempt, kv_tokens=assignment.kv_tokens
    )
    if assignment.phase == "whole":
        return queued
    whole = kv_tokens_for(queued.prompt_tokens, queued.max_tokens, block_size)
    return replace(queued, phase=assignment.phase,
                   decode_kv_tokens=whole if assignment.phase == "prefill" else None)


def decode_stage(
    prefill: Assignment, block_size: int, kv_transfer: Mapping[str, JsonValue] | None,
    kv_version: str | None = None,
) -> QueuedRequest:
    """The decode stage of a prefill stage that reported ``event.prefilled``: the next
    attempt, the whole reservation, in the queue from the request's admission on, for a
    decode worker of the engine that wrote ``kv_transfer`` (its ``engine`` key, which
    every llmq engine's envelope has; without one, any decode worker) and of the prefill
    worker's model version ``kv_version`` (None: unknown, any)."""
    queued = queued_request(prefill.admitted, block_size, attempt=prefill.attempt + 1)
    engine = None if kv_transfer is None else kv_transfer.get("engine")
    return replace(queued, phase="decode", kv_engine=engine if isinstance(engine, str) else None,
                   kv_version=kv_version)


def assignment(
    admitted: AdmittedRequest, placement: Placement, now: float, *, engine_priority: int | None,
    worker_started_at: float | None = None, kv_transfer: Mapping[str, JsonValue] | None = None,
) -> Assignment:
    """The Assignment for ``placement``: the admitted request verbatim, on the worker's
    partition, with the reservation, the end-to-end deadline, the class the request has
    aged into (``PendingQueue.engine_priority``), which the worker gives its engine, the
    worker process it was placed on (its heartbeat's ``started_at``), the stage it runs
    and, for a decode stage, the prefill worker's KV-transfer parameters."""
    return Assignment(
        admitted=admitted,
        worker_id=placement.worker_id,
        partition=placement.partition,
        attempt=placement.attempt,
        kv_tokens=placement.kv_tokens,
        deadline=deadline_of(admitted),
        assigned_at=now,
        engine_priority=engine_priority,
        worker_started_at=worker_started_at,
        phase=placement.phase,
        kv_transfer=None if kv_transfer is None else dict(kv_transfer),
    )


def terminal(
    admitted: AdmittedRequest,
    *,
    code: ErrorCode,
    message: str,
    attempt: int,
    reply_attempt: int,
    worker_id: str,
    events_topic: str,
    now: float,
    retry_after_s: float | None = None,
    headers: tuple[tuple[str, bytes], ...] = (),
) -> tuple[Outgoing, Outgoing]:
    """The terminal reply and the matching terminal event of a scheduler-side ending
    (both carry ``headers``, the request's trace context).

    ``reply_attempt`` is 0 for a request that never reached a worker (Error's rule),
    otherwise the attempt; the event always carries ``attempt`` (events start at 1).
    Cancels end with ``event.aborted``, everything else with ``event.failed``. The event
    of one that never reached a worker says it used no tokens, so ingest's settlement
    gives its tenant the whole reservation back (unknown usage costs all of it: a lost
    worker's attempt may have generated up to max_tokens).
    """
    request = admitted.request
    usage = Usage(prompt_tokens=0, completion_tokens=0) if reply_attempt == 0 else None
    text = message[:4096]
    reply = Error(
        request_id=request.request_id,
        attempt=reply_attempt,
        code=code,
        message=text,
        retry_after_s=retry_after_s,
        ts=now,
    )
    event: EventAborted | EventFailed
    if code == "cancelled":
        event = EventAborted(
            request_id=request.request_id, tenant=request.tenant, attempt=attempt,
            worker_id=worker_id, ts=now, code="cancelled", usage=usage,
        )
    else:
        event = EventFailed(
            request_id=request.request_id, tenant=request.tenant, attempt=attempt,
            worker_id=worker_id, ts=now, code=code, message=text, usage=usage,
        )
    admission = ((ADMITTED_AT_HEADER, repr(admitted.admitted_at).encode()),
                 (DEADLINE_HEADER, repr(deadline_of(admitted)).encode()))
    return (Outgoing.of(admitted.reply_topic, reply, headers=headers),
            Outgoing.of(events_topic, event, headers=(*headers, *admission)))


def admission_of(headers: Iterable[tuple[str, bytes]]) -> tuple[float | None, float | None]:
    """``(admitted_at, deadline)`` named by a terminal event's headers (:func:`terminal`);
    None for what is missing or unreadable (a worker's event, an older scheduler's)."""
    found: dict[str, float] = {}
    for key, value in headers:
        if key in (ADMITTED_AT_HEADER, DEADLINE_HEADER):
            try:
                number = float(value.decode("ascii"))
            except (AttributeError, UnicodeDecodeError, ValueError):  # None: a header with
                continue  # no value (Kafka allows it), or not a number
            if math.isfinite(number):
                found[key] = number
    return found.get(ADMITTED_AT_HEADER), found.get(DEADLINE_HEADER)


@dataclass(frozen=True, slots=True)
class Unreadable:
    """What an admitted-request record that does not decode still says (:func:`unreadable`)
    and its ``overloaded`` ending: the reply and the event (with the admission's headers)."""

    request_id: str
    admitted_at: float
    deadline: float
    reply: Outgoing
    event: Outgoing


def unreadable(
    raw: object, *, replies_prefix: str, worker_id: str, events_topic: str, now: float,
) -> Unreadable | None:
    """The ``overloaded`` ending of an admitted-request record that does not decode
    (dead-lettered: a newer wire schema during a rolling upgrade): its client is answered
    now (retryable, the fleet's fault) and ingest gives its tenant the reservation back,
    instead of both waiting out its timeout. None when the record decodes (its handling
    failed otherwise) or does not name its request id, tenant, times and a reply topic
    under ``replies_prefix`` readably: then there is nobody to answer."""
    data = undecodable_json(raw, REQUEST_ADAPTER)
    if data is None:
        return None
    try:
        request = data["request"]
        request_id, tenant, topic = request["request_id"], request["tenant"], data["reply_topic"]
        admitted_at = float(data["admitted_at"])
        deadline = float(request["created_at"]) + float(request["timeout_s"])
        if not isinstance(topic, str) or not topic.startswith(replies_prefix) \
                or not (math.isfinite(admitted_at) and math.isfinite(deadline)):
            return None
        text = ("the scheduler could not read this admitted request (it was dead-lettered; "
                "a newer wire schema than this scheduler's?); retry")
        reply = Error(request_id=request_id, attempt=0, code="overloaded", message=text,
                      retry_after_s=1.0, ts=now)
        event = EventFailed(request_id=request_id, tenant=tenant, attempt=1,
                            worker_id=worker_id, ts=now, code="overloaded", message=text,
                            usage=Usage(prompt_tokens=0, completion_tokens=0))
    except SALVAGE_ERRORS:  # what odd bytes may hold
        return None
    except Exception:  # a bug here: said, not taken for a record that names nobody
        _log.exception("salvaging an undecodable record failed; it is left unanswered")
        return None
    admission = ((ADMITTED_AT_HEADER, repr(admitted_at).encode()),
                 (DEADLINE_HEADER, repr(deadline).encode()))
    return Unreadable(request_id, admitted_at, deadline, Outgoing.of(topic, reply),
                      Outgoing.of(events_topic, event, headers=admission))
