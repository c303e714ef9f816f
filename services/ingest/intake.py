"""What the admission agents do with one record: build the core's inputs, call it, publish.

No Faust here, so tests drive it with dicts for tables and a list for the producer:

- :meth:`IntakeHandler.on_request` (``llmq.intake``, key tenant): decode, move a record
  that is not keyed by its tenant or not on that key's partition, call
  :func:`~services.ingest.core.admit`, store the new bucket state and a reservation,
  publish an ``AdmittedRequest`` or one terminal ``Error``.
- :meth:`IntakeHandler.on_settle` (the settle topic, key tenant): pop the request's
  reservation and :func:`~services.ingest.core.settle` the tenant's bucket. The pop is the
  dedupe: a duplicate event, or one after the reservation expired, finds nothing; so does
  one naming another tenant than the reservation's.
- :meth:`IntakeHandler.on_event` (``llmq.events``, key request_id): forward terminal
  events as settle records keyed by tenant — the re-key that puts settlement on the
  partition owning the tenant's state.
- :meth:`IntakeHandler.expired`: settle records for reservations past their request's
  deadline plus a grace, for requests whose terminal event never comes (every ending
  sends one — the scheduler's queue timeouts and cancels included — but one can be lost
  with a process that crashed before sending it).

State, all keyed so it lives on the tenant's partition: ``buckets[tenant]`` =
``TenantState.to_dict()``; ``reservations[request_id]`` = ``{"tenant", "reply_topic",
"reserved", "deadline"}`` and the admission as sent (``digest``, ``admitted_at``,
``priority``, ``lane``, ``prompt_tokens``). Both are written only while handling a record
of that tenant's partition, so a Faust changelog puts them where the tenant's records are.

Observability: each intake record is handled inside an ``llmq.admission`` span, the child
of the trace context its headers carry (the HTTP span for ingest.http's requests); what is
published for it carries that span's context on, and a record moved to its tenant's
partition keeps the headers it came with. Refusals count in ``llmq_rejections_total`` and
``llmq_requests_total`` (a refusal is the request's terminal), admissions add their
reservation (prompt + max_tokens) to ``llmq_admitted_tokens_total`` of the tenant.

Failure rules (docs/live-system.md, "Guards"): an undecodable intake record naming a
tenant with a policy is first moved to that tenant's partition, as a valid one is (only
there do the reservations tell a broken copy of a request in flight from a new one); there
it raises ``SchemaError`` to the guard (dead letter) after an ``invalid`` Error is sent if
the raw JSON names a request_id and a tenant with a policy: on that tenant's own reply topic, never
on an ingest instance's (``_salvage_target``). A request of a tenant with no
policy (keyed mode: not in the tenants file) is dead-lettered the same way, with no reply:
its reply topic would be created for it, and the tenant name is the sender's choice, so
any client could make ingest create topics without bound. A request id with a ``:`` is
scoped to the tenant before it (ingest.http's ids for a caller's ``x-request-id`` are
``<tenant>:<id>``): one scoped to another tenant is refused ``invalid`` on the sender's own
topic before anything else is looked at, so no tenant can take, or probe for, another's
ids. A request whose id is in flight
for the same caller (tenant and reply topic) is a redelivery, and its held admission is
sent again, only if its body's digest is the reservation's; with another body it is
dead-lettered on field ``request_id`` with no reply (one under that id would reach the
first request's listeners). An exception while deciding or
while writing the decision to the tables (before anything was published for the request)
sends an ``overloaded`` Error to the request's reply topic and re-raises (dead letter), so
the client is never left waiting; so does a send of the admitted request that the producer
refuses (nothing was written), after undoing the reservation and the bucket's charge.

A record read again after a restart or a rebalance (faust commits every 0.5 s) whose
request holds no reservation here is first looked up on its reply topic
(:mod:`services.ingest.redelivery`): one answered the first time (refused) is acked with
nothing sent, rather than decided again and perhaps admitted after its client was told no.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Container, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any, Final, Literal, Protocol, TypeVar

from aiokafka.errors import KafkaError, KafkaTimeoutError
from opentelemetry.trace import Span, SpanKind
from pydantic import Field

from schemas.base import (
    ID_PATTERN,
    TENANT_PATTERN,
    Count,
    RequestId,
    Tenant,
    Timestamp,
    WireMessage,
)
from schemas.codec import MAX_RECORD_BYTES, FieldError, SchemaError, decode, encode
from schemas.common import ErrorCode
from schemas.messages import EVENT_ADAPTER
from schemas.replies import Error
from schemas.requests import AdmittedRequest, InferenceRequest
from schemas.topics import (
    INSTANCE_REPLIES,
    INTAKE_RECORD_HEADER,
    reply_topic,
    request_topic,
    request_topics,
)
from schemas.workers import EventAborted, EventDone, EventFailed
from services.common import tracing
from services.common.metrics import ADMITTED_TOKENS, REJECTIONS, REQUESTS
from services.ingest.cluster import ClusterTracker
from services.ingest.core import (
    ESTIMATE,
    AdmissionRequest,
    Admit,
    Reject,
    TenantPolicy,
    TenantState,
    TokenCounter,
    admit,
    counter_for,
    request_prompt_tokens,
    settle,
)
from services.ingest.tenants import Tenancy
from services.ingest.topics import IngestTopics

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
#: Waits between tries of a transient failure (``IntakeHandler._until_done``).
_RETRY_FIRST_S: Final = 0.1
_RETRY_MAX_S: Final = 5.0
_RETRY_FOR_S: Final = 60.0
#: An ingest instance's reply topic found missing is not asked about again this long, and
#: at most this many such answers are kept (``IntakeHandler._instance_topic_ok``).
_MISSING_FOR_S: Final = 10.0
_MISSING_MAX: Final = 10_000
#: How far a client's ``created_at`` may be ahead of ingest's clock (clock skew).
MAX_CLOCK_AHEAD_S: Final = 300.0
#: How long past its deadline (``created_at + timeout_s``) a request may be read and still
#: be admitted: the scheduler's default memory of finished requests
#: (``LLMQ_SCHEDULER_FINISHED_MEMORY_S``). An older one the scheduler acks with no answer
#: (it may have been answered and forgotten), so a client whose clock runs hours behind (a
#: local time sent as UTC) got no reply at all; refused here, it is told why.
MAX_PAST_DEADLINE_S: Final = 3600.0
_ID_RE = re.compile(ID_PATTERN)
_TENANT_RE = re.compile(TENANT_PATTERN)

#: ``recount``: not a request's end; its tenant's ``in_flight`` is set to the number of its
#: reservations (:meth:`IntakeHandler.miscounted`), ``request_id`` is :data:`RECOUNT_ID`.
SettleReason = Literal["done", "failed", "aborted", "expired", "recount"]
RECOUNT_ID: Final = "recount"


class SettleRecord(WireMessage):
    """Internal (settle topic, key tenant): end a request's reservation."""

    kind: Literal["ingest.settle"] = Field(default="ingest.settle")
    tenant: Tenant
    request_id: RequestId
    used_tokens: Count | None = Field(
        default=None, description="Actual prompt + completion tokens; null: charge the "
        "whole reservation (no usage reported)."
    )
    reason: SettleReason
    ts: Timestamp


class Publish(Protocol):
    """Produce one record (the Faust producer in the service, a list in tests); ``headers``
    carry the trace context; ``timestamp`` (seconds): the record's, None for now (a moved
    record keeps the one it was produced with)."""

    def __call__(
        self, topic: str, key: bytes, value: bytes, headers: tracing.Headers | None = None,
        timestamp: float | None = None,
    ) -> Awaitable[object]: ...


class AnsweredBefore(Protocol):
    """Whether the intake record at (partition, offset), of request_id, was answered when
    it was read before (:class:`services.ingest.redelivery.RedeliveryCheck`)."""

    def __call__(self, partition: int, offset: int, request_id: str) -> Awaitable[bool]: ...


class SourceRecord(Protocol):
    @property
    def key(self) -> Any: ...
    @property
    def value(self) -> Any: ...
    @property
    def partition(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _Decision:
    """What to publish for one request, and the state to store before publishing."""

    topic: str
    message: AdmittedRequest | Error
    state: TenantState | None = None
    reservation: Mapping[str, object] | None = None


class IntakeHandler:
    """Admission and settlement for the tenants of the partitions this process owns."""

    def __init__(
        self,
        *,
        topics: IngestTopics,
        tenancy: Tenancy,
        tracker: ClusterTracker,
        buckets: MutableMapping[str, Any],
        reservations: MutableMapping[str, Any],
        publish: Publish,
        ensure_topic: Callable[[str], Awaitable[None]],
        clock: Callable[[], float],
        counters: Mapping[str, TokenCounter] | None = None,
        reservation_grace_s: float = 30.0,
        owner_partition: Callable[[bytes], int] | None = None,
        topic_exists: Callable[[str], Awaitable[bool]] | None = None,
        answered_before: AnsweredBefore | None = None,
    ) -> None:
        self._topics = topics
        self._tenancy = tenancy
        self._tracker = tracker
        self._buckets = buckets
        self._reservations = reservations
        self._publish = publish
        self._ensure_topic = ensure_topic
        self._topic_exists = topic_exists  # None: instance reply topics are not checked
        self._answered_before = answered_before  # None: redelivered records not checked
        self._missing: dict[str, float] = {}  # instance topic -> taken as missing until
        self._clock = clock
        self._counters = counters or {}
        self._grace = reservation_grace_s
        self._owner_partition = owner_partition
        self._registry = tenancy.config.admission.registry
        self._known_topics: set[str] = {topics.reply, *request_topics(topics.prefix)}

    # -- intake -------------------------------------------------------------------------
    async def on_request(self, record: SourceRecord) -> None:
        """Decide one intake record (see the module docstring)."""
        headers = tracing.headers_of(record)
        with tracing.tracer(__name__).start_as_current_span(
            "llmq.admission", context=tracing.extract(headers), kind=SpanKind.CONSUMER,
        ) as span:
            await self._on_request(record, headers, span)

    async def _on_request(
        self, record: SourceRecord, headers: tracing.Headers, span: Span
    ) -> None:
        try:
            req = decode(record.value, InferenceRequest)
        except SchemaError as exc:
            salvaged = _salvage(record.value)  # parsed once: it may be 8 MiB
            tenant = _salvage_tenant(salvaged, self._has_policy)
            if tenant is not None and not self._owns(record, tenant.encode()):
                # Moved, as a valid record is: only on its tenant's partition do the
                # reservations tell a broken copy of a request in flight (refused there,
                # that one would get a second terminal) from a new one. Dead-lettered there.
                span.set_attribute(tracing.LLMQ_OUTCOME, "moved")
                await self._publish(self._topics.intake, tenant.encode(),
                                    bytes(record.value), headers, _timestamp(record))
                return
            span.set_attribute(tracing.LLMQ_OUTCOME, exc.error_code)
            await self._refuse_undecodable(salvaged, exc)
            raise
        digest = _digest(bytes(record.value))
        span.set_attributes(tracing.request_attributes(**{
            tracing.LLMQ_REQUEST_ID: req.request_id, tracing.LLMQ_TENANT: req.tenant,
            tracing.GEN_AI_MODEL: req.model, tracing.GEN_AI_MAX_TOKENS: req.max_tokens,
        }))
        policy = self._tenancy.policy_for(req.tenant)
        if policy is None:
            span.set_attribute(tracing.LLMQ_OUTCOME, "unknown_tenant")
            raise _unknown_tenant(req.tenant)
        tenant_key = req.tenant.encode()
        if not self._owns(record, tenant_key):
            # Tenant state lives on the tenant's partition: move the record there (with
            # its own trace context: the admission that counts is the one over there).
            span.set_attribute(tracing.LLMQ_OUTCOME, "moved")
            # With the time it was produced: "deadline long past" is judged against it.
            await self._publish(self._topics.intake, tenant_key, bytes(record.value), headers,
                                _timestamp(record))
            return
        if await self._answered_already(record, req):
            span.set_attribute(tracing.LLMQ_OUTCOME, "answered_before")
            _log.info("request %s was answered when its record was read before (read again "
                      "after a restart or a rebalance): not decided again", req.request_id)
            return
        now = self._clock()
        if _scoped_to_another(req):
            # Held by this name, the id would refuse the HTTP call of that tenant's caller
            # that uses it (a squat, for a day with a long timeout), and the in-flight
            # check below would tell whether that caller has one in flight.
            span.set_attribute(tracing.LLMQ_OUTCOME, "invalid")
            _count_refusal("invalid")
            await self._send(reply_topic(self._topics.prefix, req.tenant), answers=record,
                             message=_error(
                req.request_id, "invalid",
                f"request_id {req.request_id!r} is scoped to another tenant: an id with "
                f"':' must begin with '{req.tenant}:'", now,
            ))
            return
        target = authorized_reply_topic(req, self._topics.prefix)
        if target is not None and not await self._instance_topic_ok(target):
            # An ingest instance's topic exists while it runs; one named but missing has
            # nobody reading it, and creating it would let any tenant make topics at will.
            span.set_attribute(tracing.LLMQ_OUTCOME, "invalid")
            _count_refusal("invalid")
            await self._send(reply_topic(self._topics.prefix, req.tenant), answers=record,
                             message=_error(
                req.request_id, "invalid",
                f"reply_to {target!r} names no running ingest instance (the topic does not "
                "exist); leave reply_to empty to get replies on your tenant's topic", now,
            ))
            return
        held = self._reservations.get(req.request_id)
        if held is not None:
            if _same_caller(held, req, self._topics.prefix):
                if held.get("digest", digest) != digest:
                    # Not a redelivery: the same caller reusing an id in flight for another
                    # body. Re-sending the held admission would publish this body on the
                    # first one's reservation (its checks skipped); an Error under this id,
                    # on the topic where the first one's answer goes, would end that one.
                    span.set_attribute(tracing.LLMQ_OUTCOME, "invalid")
                    # Refused, and dead-lettered: no terminal of its own (the id's terminal
                    # is the first body's, counted when it comes).
                    REJECTIONS.labels(code="invalid").inc()
                    raise _reused_id(req.request_id)
                span.set_attribute(tracing.LLMQ_OUTCOME, "duplicate")
                again = _admission_again(req, held, self._topics.prefix)
                if again is None:  # a reservation written before it kept its admission
                    _log.info("request %s is already admitted and in flight; duplicate "
                              "ignored", req.request_id)
                    return
                # Its reservation is in the table, but the admitted request may not have
                # landed (two partitions, no atomic write: ingest stopped in between, or
                # the send failed after the table's changelog was written). Sent again, as
                # it was: the scheduler takes a copy it has for a redelivery.
                _log.info("request %s is already admitted; its admission is sent again",
                          req.request_id)
                await self._send(*again)
                return
            # Another tenant's, or another caller's (another reply topic): everything
            # downstream is keyed by request_id, so this one cannot run. Its one answer:
            # where it asked, unless that is where the holder of the id listens (an ingest
            # instance's topic, keyed by that id, reaches the holder's call there): then
            # on its own tenant's topic.
            span.set_attribute(tracing.LLMQ_OUTCOME, "invalid")
            _count_refusal("invalid")
            target = answer_topic(req, self._topics.prefix)
            if target == held.get("reply_topic") and held.get("tenant") != req.tenant:
                target = reply_topic(self._topics.prefix, req.tenant)
            await self._send(target, answers=record, message=_error(
                req.request_id, "invalid",
                f"request_id {req.request_id!r} is in flight for another request or reply "
                "topic; request ids must be unique: send it with a new one", now,
            ))
            return
        prior = self._buckets.get(req.tenant)  # to undo an admission that never left
        try:
            decision = self._decide(req, policy, now, digest, _produced_at(record, now))
            self._record(req, decision)
        except Exception:
            # Nothing was published for it yet: this Error is its one terminal reply.
            await self._overloaded(req, now, record)
            raise
        _annotate(span, decision)
        try:
            await self._send(decision.topic, decision.message, answers=record)
        except Exception:
            if decision.reservation is None:
                raise  # a refusal's own reply: nothing was reserved
            # The producer refused the admitted request (a send that raises was not
            # taken: a full buffer in a broker stall). Dead-lettered and committed, the
            # record would not come back: its client got no reply and its slot stayed
            # held until expiry (found by an audit). Undone, and answered overloaded.
            with contextlib.suppress(Exception):
                del self._reservations[req.request_id]
                if prior is None:
                    self._buckets.pop(req.tenant, None)
                else:
                    self._buckets[req.tenant] = prior
            await self._overloaded(req, now, record)
            raise
        if not isinstance(decision.message, Error):  # sent: admitted
            ADMITTED_TOKENS.labels(tenant=self._tenancy.metric_label(req.tenant)).inc(
                decision.message.prompt_tokens + req.max_tokens)

    async def _answered_already(self, record: SourceRecord, req: InferenceRequest) -> bool:
        """A record read again whose request was answered the first time, and holds no
        reservation (one that does is a redelivery of an admission: sent again below)."""
        offset = getattr(record, "offset", None)
        if self._answered_before is None or not isinstance(offset, int) \
                or req.request_id in self._reservations:
            return False
        return await self._answered_before(record.partition, offset, req.request_id)

    async def _overloaded(self, req: InferenceRequest, now: float,
                          record: SourceRecord) -> None:
        """The one terminal of a request ingest failed to admit (an internal error)."""
        _count_refusal("overloaded")
        await self._send(answer_topic(req, self._topics.prefix), answers=record, message=_error(
            req.request_id, "overloaded",
            "ingest failed to admit this request (an internal error, logged by ingest); "
            "retry", now, retry_after_s=1.0,
        ))

    def _owns(self, record: SourceRecord, tenant_key: bytes) -> bool:
        """Whether the record sits where its tenant's state is: keyed by the tenant, on the
        partition our producer's partitioner picks for that key (a client library with
        another default partitioner puts it elsewhere)."""
        if record.key != tenant_key:
            return False
        return self._owner_partition is None or (
            record.partition == self._owner_partition(tenant_key)
        )

    def _decide(self, req: InferenceRequest, policy: TenantPolicy, now: float,
                digest: str, produced_at: float | None = None) -> _Decision:
        prefix = self._topics.prefix
        target = authorized_reply_topic(req, prefix)
        if target is None:
            reason = f"reply_to {req.reply_to!r} is not authorized for tenant {req.tenant!r}"
            if req.reply_to is not None and _instance_reply_topic(req.reply_to, prefix):
                reason += (f" with request_id {req.request_id!r}: an ingest instance's topic "
                           f"takes only ids '{req.tenant}:<id>'")
            return _Decision(reply_topic(prefix, req.tenant),
                             _error(req.request_id, "invalid", reason, now))
        ahead = req.created_at - now
        if ahead > MAX_CLOCK_AHEAD_S:
            # Scheduler and worker bound the request by created_at + timeout_s.
            return _Decision(target, _error(
                req.request_id, "invalid",
                f"created_at is {ahead:.0f} s ahead of ingest's clock (at most "
                f"{MAX_CLOCK_AHEAD_S:.0f} s allowed): check the client's clock", now,
            ))
        # Against when the record was produced, not read: a request read late (ingest
        # down an hour, then a redelivery of one answered before) is not the client's
        # fault, and refusing it could be its second terminal (a review).
        sent = now if produced_at is None else produced_at
        late = sent - (req.created_at + req.timeout_s)
        if late > MAX_PAST_DEADLINE_S:
            return _Decision(target, _error(
                req.request_id, "invalid",
                f"created_at is {sent - req.created_at:.0f} s behind the time the record "
                f"was produced, so its timeout_s ({req.timeout_s:g} s) ran out {late:.0f} s "
                "before it was sent: check the client's clock (created_at is Unix seconds, "
                "UTC)", now,
            ))
        state = self._state(req.tenant, policy, now)
        result = admit(
            admission_request(req, self._counter(req.model)), policy, state,
            self._tracker.view(now), now, config=self._tenancy.config.admission,
        )
        if isinstance(result, Reject):
            return _Decision(target, rejection(req.request_id, result, now))
        return self._admitted(req, result, target, now, digest)

    def _admitted(
        self, req: InferenceRequest, result: Admit, target: str, now: float, digest: str
    ) -> _Decision:
        message = AdmittedRequest(
            request=req, priority=result.priority, lane=result.lane,
            prompt_tokens=result.prompt_tokens, reply_topic=target, admitted_at=now,
        )
        # Deadline from our clock, not the client's created_at: a client must not be able
        # to make its reservation expire at once and so escape the concurrency cap. (A
        # created_at ahead of our clock is bounded in _decide; the request's own deadline
        # downstream is created_at + timeout_s, so the reservation outlives it.)
        reservation = {
            "tenant": req.tenant,
            "reply_topic": target,
            "reserved": result.reserved_tokens,
            "deadline": max(now, req.created_at) + req.timeout_s + self._grace,
            # The admission, to send it again for a redelivered record (_admission_again),
            # and the request's digest, to tell a redelivery from a reused id.
            "digest": digest,
            "admitted_at": now,
            "priority": result.priority,
            "lane": result.lane,
            "prompt_tokens": result.prompt_tokens,
        }
        return _Decision(request_topic(self._topics.prefix, result.priority, result.lane),
                         message, result.new_state, reservation)

    def _record(self, req: InferenceRequest, decision: _Decision) -> None:
        """Write the decision's reservation and tenant state (tables), count a refusal
        (admitted tokens are counted once the admission is sent). A write
        that fails leaves neither (the caller answers ``overloaded``): a bucket charged
        with no reservation to settle it held the tenant's slot for good."""
        if decision.reservation is not None:
            self._reservations[req.request_id] = dict(decision.reservation)
        if decision.state is not None:
            try:
                self._buckets[req.tenant] = decision.state.to_dict()
            except BaseException:
                if decision.reservation is not None:
                    with contextlib.suppress(Exception):
                        del self._reservations[req.request_id]
                raise
        if isinstance(decision.message, Error):
            _count_refusal(decision.message.code)

    async def _refuse_undecodable(self, data: dict[str, Any] | None, exc: SchemaError) -> None:
        """Send ``invalid``/``too_large`` if the raw JSON says who is waiting; never raises."""
        target = _salvage_target(data, self._topics.prefix, self._has_policy)
        if target is None:
            return
        request_id, topic = target
        if request_id in self._reservations:
            # A broken copy of a request in flight: that one's terminal is still to come,
            # and a refusal under its id would be a second one.
            _log.warning("undecodable record for in-flight request %s: dead-lettered only",
                         request_id)
            return
        _count_refusal(exc.error_code)
        try:
            await self._send(topic, _error(request_id, exc.error_code, str(exc), self._clock()))
        except Exception:
            _log.warning("could not refuse undecodable request %s", request_id, exc_info=True)

    # -- settlement -----------------------------------------------------------------------
    async def on_settle(self, record: SourceRecord) -> None:
        """Settle one reservation (a no-op when it was settled already)."""
        rec = decode(record.value, SettleRecord)
        if rec.reason == "recount":
            self._recount(rec.tenant)
            return
        reservation = self._reservations.get(rec.request_id)
        if reservation is None:
            return
        if reservation.get("tenant") != rec.tenant:
            # Another tenant's request under the same id (an event read late, after this
            # one was admitted): its ending is not this reservation's.
            _log.warning("settle %s: for tenant %r, but the reservation is %r's; ignored",
                         rec.request_id, rec.tenant, reservation.get("tenant"))
            return
        tenant = str(reservation["tenant"])
        policy = self._tenancy.policy_for(tenant)
        if policy is None:
            _log.warning("settle %s: tenant %r has no policy any more", rec.request_id, tenant)
            self._buckets.pop(tenant, None)  # a tenant added again starts with nothing held
            del self._reservations[rec.request_id]
            return
        now = self._clock()
        reserved = int(reservation["reserved"])
        used = reserved if rec.used_tokens is None else rec.used_tokens
        state = settle(self._state(tenant, policy, now), policy, reserved, used, now)
        # The reservation goes first and comes back if the bucket's write fails, so a
        # failed write leaves both as they were, for expiry to settle once (the guard
        # dead-letters this record: it is not redelivered). Crediting the bucket first, a
        # failure between left the reservation for expiry to credit a second time.
        del self._reservations[rec.request_id]
        try:
            self._buckets[tenant] = state.to_dict()
        except BaseException:
            try:
                self._reservations[rec.request_id] = reservation
            except Exception:
                _log.exception("settle %s: neither its bucket nor its reservation could be "
                               "written back: tenant %r may keep this slot taken",
                               rec.request_id, tenant)
            raise

    async def on_event(self, record: SourceRecord) -> None:
        """Forward a terminal lifecycle event as a settle record keyed by tenant."""
        event = decode(record.value, EVENT_ADAPTER)
        if not isinstance(event, EventDone | EventFailed | EventAborted):
            return  # started / first_token hold nothing to settle
        usage = event.usage
        reason: SettleReason = (
            "done" if isinstance(event, EventDone)
            else "failed" if isinstance(event, EventFailed) else "aborted"
        )
        rec = SettleRecord(
            tenant=event.tenant, request_id=event.request_id, reason=reason, ts=self._clock(),
            used_tokens=None if usage is None else usage.total_tokens,
        )
        # The request's trace context rides along (nothing records a span for it here).
        await self._publish(self._topics.settle, event.tenant.encode(), encode(rec),
                            tracing.headers_of(record) or None)

    def miscounted(self, now: float,
                   owned: Container[int] | None = None) -> Iterator[SettleRecord]:
        """``recount`` settle records for the tenants (of the ``owned`` partitions) whose
        bucket counts a different number of requests in flight than they have reservations
        (read-only scan; the agent recounts, as only it writes the tables).

        The two are written together, but they are two changelog records on two topics:
        a crash between their acknowledgements (two brokers) left one without the other. A
        bucket whose reservation was lost held that concurrency slot for good (nothing
        settles it), and an admission decided again on a bucket kept from the first one
        was counted twice."""
        held: dict[str, int] = {}
        for reservation in list(self._reservations.values()):
            tenant = str(reservation.get("tenant"))
            held[tenant] = held.get(tenant, 0) + 1
        for tenant, stored in list(self._buckets.items()):
            if not self._owned(tenant, owned):
                continue
            try:
                in_flight = TenantState.from_dict(stored).in_flight
            except (TypeError, ValueError):
                continue
            if in_flight != held.get(tenant, 0):
                yield SettleRecord(tenant=tenant, request_id=RECOUNT_ID, reason="recount",
                                   ts=now)

    def _recount(self, tenant: str) -> None:
        stored = self._buckets.get(tenant)
        if stored is None:
            return
        state = TenantState.from_dict(stored)
        held = sum(1 for r in list(self._reservations.values()) if r.get("tenant") == tenant)
        if state.in_flight != held:
            _log.warning("tenant %r: its bucket counted %d requests in flight, it has %d "
                         "reservations (their two table writes did not both land: a crash "
                         "between them); set to %d", tenant, state.in_flight, held, held)
            self._buckets[tenant] = replace(state, in_flight=held).to_dict()

    def _owned(self, tenant: str, owned: Container[int] | None) -> bool:
        return owned is None or self._owner_partition is None \
            or self._owner_partition(tenant.encode()) in owned

    def expired(self, now: float, owned: Container[int] | None = None) -> Iterator[SettleRecord]:
        """Settle records for reservations whose deadline passed (read-only scan).

        ``owned``: the intake partitions this instance holds now (None: all). The table
        keeps rows of a partition a rebalance took away (Faust's memory store forgets only
        rows it loaded from the changelog), and their owner settles them: without it, this
        instance sent their settle records again at every scan, for good."""
        for request_id, reservation in list(self._reservations.items()):
            if float(reservation["deadline"]) >= now:
                continue
            tenant = str(reservation["tenant"])
            if not self._owned(tenant, owned):
                continue
            yield SettleRecord(tenant=tenant, request_id=request_id, reason="expired", ts=now)

    # -- helpers ---------------------------------------------------------------------------
    def _has_policy(self, tenant: str) -> bool:
        return self._tenancy.policy_for(tenant) is not None

    def _state(self, tenant: str, policy: TenantPolicy, now: float) -> TenantState:
        stored = self._buckets.get(tenant)
        return TenantState.full(policy, now) if stored is None else TenantState.from_dict(stored)

    def _counter(self, model: str) -> TokenCounter:
        return counter_for(model, self._registry, self._counters)

    async def _send(self, topic: str, message: AdmittedRequest | Error,
                    answers: SourceRecord | None = None) -> None:
        """Publish ``message``; an Error answering the intake record ``answers`` names it
        in a header (:func:`intake_mark`), for :mod:`services.ingest.redelivery`."""
        if topic not in self._known_topics:
            if _instance_reply_topic(topic, self._topics.prefix):
                # Never created here (only checked): see _on_request.
                if not await self._instance_topic_ok(topic):
                    _log.warning("request %s: its reply topic %s does not exist: no reply",
                                 message.request_id, topic)
                    return
            else:
                # A tenant's default reply topic may not exist yet; requests topics do.
                await self._until_done(lambda: self._ensure_topic(topic), topic)
                self._known_topics.add(topic)
        # The current span (admission) is the parent of whatever handles this record next.
        mark = intake_mark(answers) if answers is not None and isinstance(message, Error) \
            else None
        await self._publish(topic, message.request_id.encode(), encode(message),
                            tracing.inject(None if mark is None else [mark]))


    async def _instance_topic_ok(self, topic: str) -> bool:
        """False for an ingest instance's reply topic that does not exist (others: True).
        A topic found missing is taken as missing for ``_MISSING_FOR_S`` without asking
        the broker again: each check is an admin round trip in this agent, and a tenant
        could name missing topics at will."""
        if topic in self._known_topics or self._topic_exists is None \
                or not _instance_reply_topic(topic, self._topics.prefix):
            return True
        now = self._clock()
        if self._missing.get(topic, 0.0) > now:
            return False
        check = self._topic_exists
        if not await self._until_done(lambda: check(topic), topic):
            if len(self._missing) >= _MISSING_MAX:
                self._missing = {t: u for t, u in self._missing.items() if u > now}
            if len(self._missing) < _MISSING_MAX:
                self._missing[topic] = now + _MISSING_FOR_S
            return False
        self._known_topics.add(topic)
        return True

    async def _until_done(self, action: Callable[[], Awaitable[_T]], topic: str) -> _T:
        """``action()`` on ``topic`` (make sure of it, or check it exists), again after a
        transient failure (the broker or its controller away), with a doubling wait: the
        request's decision may be taken (and recorded) already, so raising would
        dead-letter a valid request with no answer for its client. This agent waits
        meanwhile, as it would for any send: backpressure, up to ``_RETRY_FOR_S``. A
        failure a retry cannot mend (the broker refusing the topic: ACLs, a create policy)
        raises at once, and so does one that lasts longer: the guard dead-letters the
        record, and admission goes on for everyone else."""
        wait = _RETRY_FIRST_S
        give_up_at = self._clock() + _RETRY_FOR_S
        while True:
            try:
                return await action()
            except (KafkaError, TimeoutError, OSError) as exc:
                if isinstance(exc, KafkaError) and not _transient(exc):
                    raise
                if self._clock() >= give_up_at:
                    raise  # not a blip: the guard dead-letters it, admission goes on
                _log.warning("reply topic %s: %r; trying again in %.1f s", topic, exc, wait)
            await asyncio.sleep(wait)
            wait = min(2 * wait, _RETRY_MAX_S)


def intake_mark(record: SourceRecord) -> tuple[str, bytes] | None:
    """The header an answer to the intake ``record`` carries: ``<partition>/<offset>``
    (:data:`INTAKE_RECORD_HEADER`); None for a record with no offset."""
    offset = getattr(record, "offset", None)
    if not isinstance(offset, int):
        return None
    return INTAKE_RECORD_HEADER, f"{record.partition}/{offset}".encode()


def _transient(exc: KafkaError) -> bool:
    """A Kafka error that a later try may not meet (a client-side timeout is one, though
    aiokafka does not mark it ``retriable``)."""
    return exc.retriable or isinstance(exc, KafkaTimeoutError)


def _count_refusal(code: ErrorCode) -> None:
    """A refusal is the request's one terminal: count it as both."""
    REJECTIONS.labels(code=code).inc()
    REQUESTS.labels(outcome=code).inc()


def _annotate(span: Span, decision: _Decision) -> None:
    message = decision.message
    if isinstance(message, Error):
        span.set_attribute(tracing.LLMQ_OUTCOME, message.code)
        return
    span.set_attributes({
        tracing.LLMQ_OUTCOME: "admitted", tracing.LLMQ_PRIORITY: message.priority,
        tracing.LLMQ_LANE: message.lane,
        # Counted (or estimated) before generation: not gen_ai.usage, which the worker sets.
        "llmq.prompt_tokens": message.prompt_tokens,
    })


def admission_request(req: InferenceRequest, counter: TokenCounter = ESTIMATE) -> AdmissionRequest:
    """The core's view of a request, with its prompt tokens counted."""
    return AdmissionRequest(
        request_id=req.request_id, tenant=req.tenant, model=req.model,
        prompt_tokens=request_prompt_tokens(req, counter),
        max_tokens=req.max_tokens, priority=req.priority, lane_hint=req.lane,
        timeout_s=req.timeout_s,
    )


def authorized_reply_topic(req: InferenceRequest, prefix: str) -> str | None:
    """Where replies of ``req`` may go: the tenant's own reply topic, or an ingest
    instance's (``<prefix>.replies.ingest-*``, used by ingest.http) for an id of the
    tenant's own there (:func:`_own_instance_id`); None otherwise."""
    own = reply_topic(prefix, req.tenant)
    if req.reply_to is None or req.reply_to == own:
        return own
    if _instance_reply_topic(req.reply_to, prefix) and _own_instance_id(req):
        return req.reply_to
    return None


def _timestamp(record: SourceRecord) -> float | None:
    """The record's Kafka timestamp in seconds (faust's ``Message.timestamp``), if any."""
    ts = getattr(record, "timestamp", None)
    return float(ts) if isinstance(ts, int | float) and ts > 0 else None


def _produced_at(record: SourceRecord, now: float) -> float | None:
    """:func:`_timestamp`, when plausible (not ahead of ``now``); None otherwise."""
    ts = _timestamp(record)
    return ts if ts is not None and ts <= now + MAX_CLOCK_AHEAD_S else None


def _scoped_to_another(req: InferenceRequest) -> bool:
    """``req``'s id is ``<scope>:...`` with a scope other than its own tenant."""
    return ":" in req.request_id and not req.request_id.startswith(f"{req.tenant}:")


def _own_instance_id(req: InferenceRequest) -> bool:
    """Whether ``req``'s id may be answered on an ingest instance's reply topic, where HTTP
    calls wait by request id alone: an id ingest.http gives (``cmpl-<uuid>``, unguessable)
    or one scoped to the request's own tenant (``<tenant>:<id>``). Another tenant's scoped
    id there would hand that tenant's waiting call this request's answer."""
    return req.request_id.startswith((f"{req.tenant}:", "cmpl-"))


def _instance_reply_topic(name: str, prefix: str) -> bool:
    """``name`` is ``<prefix>.replies.ingest-<id>`` with an id the topic catalog takes (a
    name the scheduler and workers could not create or find would stall their sends)."""
    replies = reply_topic(prefix, INSTANCE_REPLIES)
    if not name.startswith(replies):
        return False
    return _TENANT_RE.fullmatch(name.removeprefix(f"{prefix}.replies.")) is not None


def rejection(request_id: str, reject: Reject, now: float) -> Error:
    """The terminal Error for a core ``Reject`` (attempt 0: no worker ever ran it)."""
    return _error(request_id, reject.code, reject.reason, now, retry_after_s=reject.retry_after_s)


def _error(
    request_id: str, code: ErrorCode, message: str, now: float, *,
    retry_after_s: float | None = None,
) -> Error:
    return Error(request_id=request_id, attempt=0, code=code, message=message[:4096],
                 retry_after_s=retry_after_s, ts=now)


def _unknown_tenant(tenant: str) -> SchemaError:
    """The dead-letter reason for a tenant with no policy. A SchemaError, though the record
    decodes: its ``tenant`` is not valid here, and the guard then names the field in the
    dead letter and logs one line rather than a traceback per forged record."""
    return SchemaError((FieldError(
        "tenant", "unknown_tenant",
        f"unknown tenant {tenant!r}: no policy in the tenants file, so no reply "
        "(its reply topic is not created)",
    ),))


def _reused_id(request_id: str) -> SchemaError:
    """The dead-letter reason for a request whose id is in flight for another body from the
    same caller (field ``request_id``; no reply: one under that id would reach the first
    request's listeners)."""
    return SchemaError((FieldError(
        "request_id", "invalid",
        f"request_id {request_id!r} is in flight for another request from the same caller; "
        "not admitted and not answered (an answer under this id would end the first one): "
        "request ids must be unique",
    ),))


def _digest(raw: bytes) -> str:
    """What tells a redelivery (the same record again) from another request with its id:
    the record's own bytes (re-encoded, a record of an older version read by a newer one
    would not match its own admission)."""
    return hashlib.sha256(raw).hexdigest()


def _same_caller(held: Mapping[str, Any], req: InferenceRequest, prefix: str) -> bool:
    """Whether ``req`` is a redelivery of the in-flight request ``held`` (its reservation):
    same tenant, same reply topic (a reservation written before the reply topic was kept
    matches on the tenant alone)."""
    if held.get("tenant") != req.tenant:
        return False
    topic = held.get("reply_topic")
    return topic is None or topic == answer_topic(req, prefix)


def _admission_again(
    req: InferenceRequest, held: Mapping[str, Any], prefix: str
) -> tuple[str, AdmittedRequest] | None:
    """(topic, message) of the admission ``held`` records for ``req``, as it was first
    sent; None for a reservation that does not keep it (written by an older ingest)."""
    try:
        message = AdmittedRequest(
            request=req, priority=held["priority"], lane=held["lane"],
            prompt_tokens=held["prompt_tokens"], reply_topic=held["reply_topic"],
            admitted_at=held["admitted_at"],
        )
    except (KeyError, ValueError):
        return None
    return request_topic(prefix, message.priority, message.lane), message


def answer_topic(req: InferenceRequest, prefix: str) -> str:
    """Where ingest answers ``req`` (a refusal, or ``overloaded``): its authorized reply
    topic, else its tenant's own."""
    return authorized_reply_topic(req, prefix) or reply_topic(prefix, req.tenant)


def _salvage_tenant(
    data: dict[str, Any] | None, has_policy: Callable[[str], bool]
) -> str | None:
    """The tenant a record that failed validation names (its :func:`_salvage`d JSON), if
    it is one with a policy."""
    tenant = None if data is None else data.get("tenant")
    if isinstance(tenant, str) and _TENANT_RE.fullmatch(tenant) and has_policy(tenant):
        return tenant
    return None


def _salvage(raw: Any) -> dict[str, Any] | None:
    """The JSON object of a record that failed validation, if it is one (and not over the
    record bound)."""
    if not isinstance(raw, bytes | bytearray) or len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _salvage_target(
    data: dict[str, Any] | None, prefix: str, has_policy: Callable[[str], bool]
) -> tuple[str, str] | None:
    """``(request_id, reply topic)`` from a record that failed validation, if it names them:
    the tenant's own reply topic, for a tenant with a policy (module docstring). Never an
    ingest instance's topic, whatever ``reply_to`` says: ingest writes only valid records
    for its HTTP callers, and there the holder of the id listens (a broken record naming a
    caller's id would end that caller's call with its error). ``data``: the record's
    :func:`_salvage`d JSON."""
    if data is None:
        return None
    request_id = data.get("request_id")
    if not isinstance(request_id, str) or not _ID_RE.fullmatch(request_id):
        return None
    tenant = _salvage_tenant(data, has_policy)
    return None if tenant is None else (request_id, reply_topic(prefix, tenant))
