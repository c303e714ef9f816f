"""llmq's wire contract: every Kafka message, the topic catalog, the codec and the exporter.

Owns what goes on the wire and nothing else: no Kafka client, no I/O besides ``export``. Any
service, the pure core (for the plain vocabularies in ``schemas.common``), the CLI and the
tests may import it; it imports no service code.

- ``schemas.common``: Priority, Lane, Pool, ErrorCode, HTTP_STATUS, SCHEMA_VERSION.
- ``schemas.requests`` / ``workers`` / ``replies`` / ``control``: the pydantic models.
- ``schemas.messages``: the registry of kinds, per-topic unions and TypeAdapters.
- ``schemas.topics``: topic names, keys, partitions (``catalog()``, ``request_topic()``,
  ``reply_topic()``, ``message_key()``).
- ``schemas.codec``: ``encode()`` / ``decode()`` and ``SchemaError``.
- ``schemas.export``: JSON Schema and AsyncAPI 3.0 export (not re-exported: it needs yaml).
- ``schemas.examples``: one valid instance of every message.

The re-exports below resolve lazily (PEP 562), so ``import schemas.common`` from the pure
core stays a plain-Python import that builds no pydantic model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Redundant aliases mark these as re-exports for mypy and ruff.
    from schemas.base import WireMessage as WireMessage
    from schemas.codec import FieldError as FieldError
    from schemas.codec import SchemaError as SchemaError
    from schemas.codec import decode as decode
    from schemas.codec import encode as encode
    from schemas.common import HTTP_STATUS as HTTP_STATUS
    from schemas.common import LANES as LANES
    from schemas.common import POOLS as POOLS
    from schemas.common import PRIORITIES as PRIORITIES
    from schemas.common import SCHEMA_VERSION as SCHEMA_VERSION
    from schemas.common import ErrorCode as ErrorCode
    from schemas.common import Lane as Lane
    from schemas.common import Pool as Pool
    from schemas.common import Priority as Priority
    from schemas.control import CancelRequest as CancelRequest
    from schemas.control import ControlMessage as ControlMessage
    from schemas.control import DrainWorker as DrainWorker
    from schemas.messages import ANY_ADAPTER as ANY_ADAPTER
    from schemas.messages import ASSIGNMENT_ADAPTER as ASSIGNMENT_ADAPTER
    from schemas.messages import CONTROL_ADAPTER as CONTROL_ADAPTER
    from schemas.messages import EVENT_ADAPTER as EVENT_ADAPTER
    from schemas.messages import HEARTBEAT_ADAPTER as HEARTBEAT_ADAPTER
    from schemas.messages import INTAKE_ADAPTER as INTAKE_ADAPTER
    from schemas.messages import MESSAGE_MODELS as MESSAGE_MODELS
    from schemas.messages import MODEL_BY_KIND as MODEL_BY_KIND
    from schemas.messages import REPLY_ADAPTER as REPLY_ADAPTER
    from schemas.messages import REQUEST_ADAPTER as REQUEST_ADAPTER
    from schemas.messages import STATUS_ADAPTER as STATUS_ADAPTER
    from schemas.messages import AnyMessage as AnyMessage
    from schemas.messages import kind_of as kind_of
    from schemas.replies import Done as Done
    from schemas.replies import Error as Error
    from schemas.replies import FinishReason as FinishReason
    from schemas.replies import ReplyMessage as ReplyMessage
    from schemas.replies import Timings as Timings
    from schemas.replies import TokenChunk as TokenChunk
    from schemas.replies import Usage as Usage
    from schemas.requests import AdmittedRequest as AdmittedRequest
    from schemas.requests import Assignment as Assignment
    from schemas.requests import ChatMessage as ChatMessage
    from schemas.requests import InferenceRequest as InferenceRequest
    from schemas.requests import SamplingParams as SamplingParams
    from schemas.topics import TopicSpec as TopicSpec
    from schemas.topics import catalog as catalog
    from schemas.topics import find_topic as find_topic
    from schemas.topics import message_key as message_key
    from schemas.topics import reply_topic as reply_topic
    from schemas.topics import request_topic as request_topic
    from schemas.topics import request_topics as request_topics
    from schemas.workers import TERMINAL_EVENTS as TERMINAL_EVENTS
    from schemas.workers import EventAborted as EventAborted
    from schemas.workers import EventDone as EventDone
    from schemas.workers import EventFailed as EventFailed
    from schemas.workers import EventFirstToken as EventFirstToken
    from schemas.workers import EventMessage as EventMessage
    from schemas.workers import EventPrefilled as EventPrefilled
    from schemas.workers import EventStarted as EventStarted
    from schemas.workers import LifecycleEvent as LifecycleEvent
    from schemas.workers import WorkerHeartbeat as WorkerHeartbeat

#: Public name -> module that defines it.
_EXPORTS: dict[str, str] = {
    "ANY_ADAPTER": "schemas.messages",
    "ASSIGNMENT_ADAPTER": "schemas.messages",
    "AdmittedRequest": "schemas.requests",
    "AnyMessage": "schemas.messages",
    "Assignment": "schemas.requests",
    "CONTROL_ADAPTER": "schemas.messages",
    "CancelRequest": "schemas.control",
    "ChatMessage": "schemas.requests",
    "ControlMessage": "schemas.control",
    "Done": "schemas.replies",
    "DrainWorker": "schemas.control",
    "EVENT_ADAPTER": "schemas.messages",
    "Error": "schemas.replies",
    "ErrorCode": "schemas.common",
    "EventAborted": "schemas.workers",
    "EventDone": "schemas.workers",
    "EventFailed": "schemas.workers",
    "EventFirstToken": "schemas.workers",
    "EventPrefilled": "schemas.workers",
    "EventMessage": "schemas.workers",
    "EventStarted": "schemas.workers",
    "FieldError": "schemas.codec",
    "FinishReason": "schemas.replies",
    "HEARTBEAT_ADAPTER": "schemas.messages",
    "HTTP_STATUS": "schemas.common",
    "INTAKE_ADAPTER": "schemas.messages",
    "InferenceRequest": "schemas.requests",
    "LANES": "schemas.common",
    "Lane": "schemas.common",
    "LifecycleEvent": "schemas.workers",
    "MESSAGE_MODELS": "schemas.messages",
    "MODEL_BY_KIND": "schemas.messages",
    "POOLS": "schemas.common",
    "PRIORITIES": "schemas.common",
    "Pool": "schemas.common",
    "Priority": "schemas.common",
    "REPLY_ADAPTER": "schemas.messages",
    "REQUEST_ADAPTER": "schemas.messages",
    "ReplyMessage": "schemas.replies",
    "QueueStatus": "schemas.status",
    "SCHEMA_VERSION": "schemas.common",
    "STATUS_ADAPTER": "schemas.messages",
    "SamplingParams": "schemas.requests",
    "SchemaError": "schemas.codec",
    "TERMINAL_EVENTS": "schemas.workers",
    "Timings": "schemas.replies",
    "TokenChunk": "schemas.replies",
    "TopicSpec": "schemas.topics",
    "Usage": "schemas.replies",
    "WireMessage": "schemas.base",
    "WorkerHeartbeat": "schemas.workers",
    "catalog": "schemas.topics",
    "decode": "schemas.codec",
    "encode": "schemas.codec",
    "find_topic": "schemas.topics",
    "kind_of": "schemas.messages",
    "message_key": "schemas.topics",
    "reply_topic": "schemas.topics",
    "request_topic": "schemas.topics",
    "request_topics": "schemas.topics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'schemas' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
