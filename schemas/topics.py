"""The topic catalog: the single source of topic names, keys, partitions and payloads.

Services, infra (topic creation) and the AsyncAPI export all read topics from here; no other
module spells a topic name. Names take a prefix (default ``llmq``) so tests and parallel
deployments can share a broker.

Call ``catalog()`` for the fixed topics, ``request_topic()`` / ``reply_topic()`` for the
parameterised ones, ``find_topic()`` to map a name back to its spec, and ``message_key()``
for the record key of a message.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal

from pydantic import TypeAdapter

from schemas.base import TENANT_PATTERN, WireMessage
from schemas.common import (
    LANES,
    PRIORITIES,
    TOPIC_PREFIX_MAX,
    TOPIC_PREFIX_PATTERN,
    Lane,
    Priority,
)
from schemas.control import CancelRequest, DrainWorker, LeaseAnswer
from schemas.messages import (
    ASSIGNMENT_ADAPTER,
    CONTROL_ADAPTER,
    EVENT_ADAPTER,
    HEARTBEAT_ADAPTER,
    INTAKE_ADAPTER,
    REPLY_ADAPTER,
    REQUEST_ADAPTER,
    STATUS_ADAPTER,
)
from schemas.replies import Done, Error, TokenChunk
from schemas.requests import AdmittedRequest, Assignment, InferenceRequest
from schemas.status import QueueStatus
from schemas.workers import (
    EventAborted,
    EventDone,
    EventFailed,
    EventFirstToken,
    EventPrefilled,
    EventStarted,
    WorkerHeartbeat,
)

CleanupPolicy = Literal["delete", "compact"]

#: Services as named in DESIGN.md, plus outside clients, for producers/consumers.
Service = Literal["client", "ingest", "scheduler", "worker", "health", "cli"]

#: Requests can hold a 1 MiB-character prompt (up to 4 MiB of UTF-8, more once JSON escapes
#: it), above Kafka's 1 MB default record limit.
LARGE_RECORD_BYTES: Final = 8 << 20
_DAY_MS: Final = 86_400_000

#: On ingest's refusals: the intake record answered, ``<partition>/<offset>`` (a record read
#: again after a crash is not decided again when its answer is found: services.ingest.redelivery).
INTAKE_RECORD_HEADER: Final = "llmq-intake-record"

#: Headers on ``llmq.deadletter`` records; the value is the original record, unchanged.
DEADLETTER_REASON_HEADER: Final = "llmq-dlq-reason"
DEADLETTER_FIELD_HEADER: Final = "llmq-dlq-field"
DEADLETTER_SOURCE_HEADER: Final = "llmq-dlq-source"  # "topic/partition/offset"
#: On a dead letter whose value was cut to ``DEADLETTER_MAX_VALUE_BYTES``: the original
#: length, and the original's sha256 (hex).
DEADLETTER_TRUNCATED_HEADER: Final = "llmq-dlq-truncated"
DEADLETTER_SHA256_HEADER: Final = "llmq-dlq-sha256"
DEADLETTER_MAX_VALUE_BYTES: Final = 1 << 20

_PREFIX_RE: Final = re.compile(TOPIC_PREFIX_PATTERN)
_TENANT_RE: Final = re.compile(TENANT_PATTERN)


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """One topic: its name, how its records are keyed and stored, and what they contain."""

    name: str
    #: What the record key is: a field name, or a description where it depends on the
    #: message (``message_key()`` is exact); None: records have no key.
    key: str | None
    partitions: int
    cleanup_policy: CleanupPolicy
    #: Models a record value may hold, and the adapter that decodes them. Empty / None for the
    #: dead-letter topic, whose values are raw bytes that failed to decode.
    models: tuple[type[WireMessage], ...]
    adapter: TypeAdapter[Any] | None
    description: str
    producers: tuple[Service, ...]
    consumers: tuple[Service, ...]
    #: Topic configs beyond cleanup.policy, as Kafka expects them (all integral here).
    configs: tuple[tuple[str, int], ...] = ()

    @property
    def config(self) -> dict[str, str]:
        """Topic configuration for an admin client's create_topics."""
        return {"cleanup.policy": self.cleanup_policy} | {k: str(v) for k, v in self.configs}


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.fullmatch(prefix) or len(prefix) > TOPIC_PREFIX_MAX:
        raise ValueError(f"invalid topic prefix {prefix!r}")


def request_topic(prefix: str, priority: Priority, lane: Lane) -> str:
    """``{prefix}.requests.{priority}.{lane}``: where admitted requests wait."""
    _check_prefix(prefix)
    if priority not in PRIORITIES or lane not in LANES:
        raise ValueError(f"unknown priority/lane {priority!r}/{lane!r}")
    return f"{prefix}.requests.{priority}.{lane}"


def request_topics(prefix: str = "llmq") -> list[str]:
    """All six request topics, highest priority first, short before long within a priority."""
    return [request_topic(prefix, p, lane) for p in PRIORITIES for lane in LANES]


#: An ingest instance's reply topic is ``reply_topic(prefix, INSTANCE_REPLIES + instance_id)``;
#: no tenant may have a name starting with it.
INSTANCE_REPLIES: Final = "ingest-"


def reply_topic(prefix: str, tenant: str) -> str:
    """``{prefix}.replies.{tenant}``: the default reply topic of a tenant."""
    _check_prefix(prefix)
    if not _TENANT_RE.fullmatch(tenant):
        raise ValueError(f"invalid tenant {tenant!r}")
    return f"{prefix}.replies.{tenant}"


def reply_spec(prefix: str, tenant: str) -> TopicSpec:
    """Spec of one tenant's reply topic (created on demand by ingest or infra)."""
    return TopicSpec(
        name=reply_topic(prefix, tenant),
        key="request_id",
        partitions=3,
        cleanup_policy="delete",
        models=(TokenChunk, Done, Error),
        adapter=REPLY_ADAPTER,
        description=(
            "Token chunks of a request, then exactly one terminal message (done or error). "
            "A request may name another authorized topic in reply_to; it carries the same."
        ),
        producers=("worker", "scheduler", "ingest"),
        # The scheduler reads them to tell answered attempts from lost ones.
        consumers=("client", "ingest", "scheduler"),
        # Replies matter only while someone waits for them.
        configs=(("retention.ms", _DAY_MS),),
    )


def _request_spec(prefix: str, priority: Priority, lane: Lane) -> TopicSpec:
    return TopicSpec(
        name=request_topic(prefix, priority, lane),
        key="request_id",
        partitions=6,
        cleanup_policy="delete",
        models=(AdmittedRequest,),
        adapter=REQUEST_ADAPTER,
        description=(
            f"Admitted {priority}-priority {lane}-lane requests. The scheduler arbitrates "
            "across the six request topics and pauses the lowest ones under backpressure."
        ),
        producers=("ingest",),
        consumers=("scheduler",),
        configs=(("max.message.bytes", LARGE_RECORD_BYTES),),
    )


def catalog(
    prefix: str = "llmq", assignment_partitions: int = 16, tenants: Iterable[str] = ()
) -> list[TopicSpec]:
    """Every fixed topic, plus the reply topics of ``tenants``.

    ``assignment_partitions`` is the number of worker slots: partition p of the assignments
    topic belongs to the worker holding slot p.
    """
    _check_prefix(prefix)
    if assignment_partitions < 1:
        raise ValueError("assignment_partitions must be at least 1")
    big = (("max.message.bytes", LARGE_RECORD_BYTES),)
    specs = [
        TopicSpec(
            name=f"{prefix}.intake",
            key="tenant",
            partitions=6,
            cleanup_policy="delete",
            models=(InferenceRequest,),
            adapter=INTAKE_ADAPTER,
            description="Raw requests from Kafka clients and from ingest.http.",
            producers=("client", "ingest"),
            consumers=("ingest",),
            configs=big,
        ),
        *(_request_spec(prefix, p, lane) for p in PRIORITIES for lane in LANES),
        TopicSpec(
            name=f"{prefix}.heartbeats",
            key="worker_id",
            partitions=3,
            cleanup_policy="compact",
            models=(WorkerHeartbeat,),
            adapter=HEARTBEAT_ADAPTER,
            description=(
                "Latest state of every worker (compacted; a null value removes a worker). "
                "Source of the scheduler's GlobalTable of workers."
            ),
            producers=("worker",),
            consumers=("scheduler", "ingest", "health"),
            # The active segment is never compacted: roll often so old heartbeats go.
            configs=(("segment.ms", 600_000), ("delete.retention.ms", 3_600_000)),
        ),
        TopicSpec(
            name=f"{prefix}.status",
            key="model",
            partitions=1,
            cleanup_policy="compact",
            models=(QueueStatus,),
            adapter=STATUS_ADAPTER,
            description=(
                "Queued demand and measured drain rate per model, from the scheduler "
                "(compacted). Ingest's cluster view for overload refusals and Retry-After."
            ),
            producers=("scheduler",),
            consumers=("ingest", "health"),
            configs=(("segment.ms", 600_000), ("delete.retention.ms", 3_600_000)),
        ),
        TopicSpec(
            name=f"{prefix}.assignments",
            key="request_id",
            partitions=assignment_partitions,
            cleanup_policy="delete",
            models=(Assignment,),
            adapter=ASSIGNMENT_ADAPTER,
            description="Placements; partition p belongs to the worker holding slot p.",
            producers=("scheduler",),
            consumers=("worker",),
            configs=big,
        ),
        TopicSpec(
            name=f"{prefix}.events",
            key="request_id",
            partitions=6,
            cleanup_policy="delete",
            models=(EventStarted, EventFirstToken, EventPrefilled, EventDone, EventFailed,
                    EventAborted),
            adapter=EVENT_ADAPTER,
            description="Lifecycle of each (request_id, attempt) on its worker.",
            # The scheduler ends what never reached a worker, or a lost worker's work;
            # workers follow it for the decode stages of the prompts they handed on.
            producers=("worker", "scheduler"),
            consumers=("scheduler", "ingest", "worker"),
        ),
        TopicSpec(
            name=f"{prefix}.control",
            key="worker_id or request_id",
            partitions=3,
            cleanup_policy="delete",
            models=(DrainWorker, CancelRequest, LeaseAnswer),
            adapter=CONTROL_ADAPTER,
            description=(
                "Commands: drain (keyed by worker_id), cancel (keyed by request_id), the "
                "scheduler's answer to a lease renewal (keyed by worker_id)."
            ),
            producers=("cli", "client", "ingest", "scheduler"),
            consumers=("scheduler", "worker", "health"),
        ),
        TopicSpec(
            name=f"{prefix}.deadletter",
            key=None,
            partitions=1,
            cleanup_policy="delete",
            models=(),
            adapter=None,
            description=(
                "Records that failed to decode or poisoned a consumer: the original value, "
                f"with headers {DEADLETTER_REASON_HEADER}, {DEADLETTER_FIELD_HEADER} and "
                f"{DEADLETTER_SOURCE_HEADER}; a value over {DEADLETTER_MAX_VALUE_BYTES} bytes "
                f"cut to that size, with {DEADLETTER_TRUNCATED_HEADER} (its length) and "
                f"{DEADLETTER_SHA256_HEADER}."
            ),
            producers=("ingest", "scheduler", "worker"),
            consumers=(),  # an operator's, with any Kafka consumer
            configs=(*big, ("retention.ms", 7 * _DAY_MS)),
        ),
    ]
    specs.extend(reply_spec(prefix, t) for t in tenants)
    return specs


def find_topic(name: str, prefix: str = "llmq", assignment_partitions: int = 16) -> TopicSpec:
    """The spec of a topic by full name, reply topics included; ValueError if unknown."""
    for spec in catalog(prefix, assignment_partitions):
        if spec.name == name:
            return spec
    replies = f"{prefix}.replies."
    if name.startswith(replies):
        return reply_spec(prefix, name.removeprefix(replies))
    raise ValueError(f"{name!r} is not an llmq topic under prefix {prefix!r}")


#: Field (or property) each message's record key comes from, per DESIGN.md's topic table.
KEY_FIELD: Final[Mapping[type[WireMessage], str]] = MappingProxyType(
    {
        InferenceRequest: "tenant",
        AdmittedRequest: "request_id",
        Assignment: "request_id",
        WorkerHeartbeat: "worker_id",
        EventStarted: "request_id",
        EventFirstToken: "request_id",
        EventPrefilled: "request_id",
        EventDone: "request_id",
        EventFailed: "request_id",
        EventAborted: "request_id",
        TokenChunk: "request_id",
        Done: "request_id",
        Error: "request_id",
        DrainWorker: "worker_id",
        CancelRequest: "request_id",
        LeaseAnswer: "worker_id",
        QueueStatus: "model",
    }
)


def message_key(msg: WireMessage) -> bytes:
    """The record key of a message (UTF-8 of its ``KEY_FIELD``)."""
    try:
        field = KEY_FIELD[type(msg)]
    except KeyError:
        raise TypeError(f"no key rule for {type(msg).__name__}") from None
    key: str = getattr(msg, field)
    return key.encode()
