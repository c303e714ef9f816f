"""The registry of wire messages: every model by kind, one union and TypeAdapter per topic.

Models live in requests.py, workers.py, replies.py and control.py; this module is the one
place that lists them, so the codec, the topic catalog, the exporter and the tests agree on
what exists. Adding a message means adding it here and a frozen sample in tests/data/samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Final

from pydantic import Field, TypeAdapter

from schemas.base import WireMessage
from schemas.control import CancelRequest, ControlMessage, DrainWorker, LeaseAnswer
from schemas.replies import Done, Error, ReplyMessage, TokenChunk
from schemas.requests import AdmittedRequest, Assignment, InferenceRequest
from schemas.status import QueueStatus
from schemas.workers import (
    EventAborted,
    EventDone,
    EventFailed,
    EventFirstToken,
    EventMessage,
    EventPrefilled,
    EventStarted,
    WorkerHeartbeat,
)

#: Every top-level message model, in the order of a request's path.
MESSAGE_MODELS: Final[tuple[type[WireMessage], ...]] = (
    InferenceRequest,
    AdmittedRequest,
    Assignment,
    WorkerHeartbeat,
    EventStarted,
    EventFirstToken,
    EventPrefilled,
    EventDone,
    EventFailed,
    EventAborted,
    TokenChunk,
    Done,
    Error,
    DrainWorker,
    CancelRequest,
    LeaseAnswer,
    QueueStatus,
)


def kind_of(model: type[WireMessage]) -> str:
    """The ``kind`` value of a message model (the default of its ``Literal`` field)."""
    default = model.model_fields["kind"].default
    if not isinstance(default, str):
        raise TypeError(f"{model.__name__} does not fix its kind")
    return default


MODEL_BY_KIND: Final[Mapping[str, type[WireMessage]]] = MappingProxyType(
    {kind_of(m): m for m in MESSAGE_MODELS}
)

#: Any message of any topic, for tools that inspect a record without knowing its topic.
AnyMessage = Annotated[
    InferenceRequest
    | AdmittedRequest
    | Assignment
    | WorkerHeartbeat
    | EventStarted
    | EventFirstToken
    | EventPrefilled
    | EventDone
    | EventFailed
    | EventAborted
    | TokenChunk
    | Done
    | Error
    | DrainWorker
    | CancelRequest
    | LeaseAnswer
    | QueueStatus,
    Field(discriminator="kind"),
]

# One adapter per topic family. Single-model topics get an adapter too, so that every topic
# is decoded the same way.
INTAKE_ADAPTER: Final = TypeAdapter(InferenceRequest)
REQUEST_ADAPTER: Final = TypeAdapter(AdmittedRequest)
ASSIGNMENT_ADAPTER: Final = TypeAdapter(Assignment)
HEARTBEAT_ADAPTER: Final = TypeAdapter(WorkerHeartbeat)
STATUS_ADAPTER: Final = TypeAdapter(QueueStatus)
EVENT_ADAPTER: Final[TypeAdapter[EventMessage]] = TypeAdapter(EventMessage)
REPLY_ADAPTER: Final[TypeAdapter[ReplyMessage]] = TypeAdapter(ReplyMessage)
CONTROL_ADAPTER: Final[TypeAdapter[ControlMessage]] = TypeAdapter(ControlMessage)
ANY_ADAPTER: Final[TypeAdapter[AnyMessage]] = TypeAdapter(AnyMessage)
