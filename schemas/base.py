"""Base classes, size limits and constrained field types shared by every wire model.

Owns the rules of STYLE.md §7 in one place: every model is frozen, forbids unknown fields and
rejects NaN/inf; every top-level message carries ``kind`` and ``schema_version``. Scalars are
strict (``"12"`` is not an integer, ``1`` is not a boolean, ``{}`` is not a model instance
when constructing in Python) so that a producer bug shows up as a decode error instead of a
silent coercion. Strings and lists are bounded so that one bad
record cannot make a consumer allocate without limit.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, Strict
from pydantic_core import PydanticCustomError

from schemas.common import MAX_ATTEMPT, MAX_TOKENS, SCHEMA_VERSION

# --- limits ----------------------------------------------------------------------------------

#: Characters of prompt text per request (prompt, or all chat message contents together).
MAX_PROMPT_CHARS: Final = 1 << 20
#: Chat messages per request.
MAX_MESSAGES: Final = 256
#: Stop sequences per request, and characters per stop sequence.
MAX_STOP: Final = 8
MAX_STOP_CHARS: Final = 256
#: Characters of generated text in one token chunk.
MAX_CHUNK_CHARS: Final = 1 << 16
#: Characters of a human-readable message or reason.
MAX_TEXT_CHARS: Final = 4096
#: Longest timeout or deadline budget a request may ask for (one day).
MAX_TIMEOUT_S: Final = 86_400.0
#: Kafka's own limit on topic names.
MAX_TOPIC_CHARS: Final = 249

#: Ids (request, worker): start alphanumeric, then a conservative set that is safe in logs,
#: Kafka keys, metric labels and URLs. The quantifier bounds the length, max_length repeats it
#: for readers of the JSON Schema.
ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
#: Tenants become part of reply topic names (``llmq.replies.{tenant}``), so no dots: a dot
#: would make ``a.b`` ambiguous with the topic hierarchy.
TENANT_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
#: Model names as served (Hugging Face style ``org/name``, optional ``:tag``).
MODEL_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,255}$"
#: Kafka topic names.
TOPIC_PATTERN: Final = r"^[A-Za-z0-9._-]{1,249}$"
#: Short names: engines, model versions, chat participant names.
NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
PREFIX_HASH_PATTERN: Final = r"^[0-9a-f]{8,128}$"

# --- field types -----------------------------------------------------------------------------

#: Tuple fields carry ``LAX``: strict mode would refuse a Python list for a tuple, and callers
#: build messages from lists. JSON arrays are accepted either way, and the items stay strict.
LAX: Final = Strict(False)

RequestId = Annotated[str, Field(max_length=128, pattern=ID_PATTERN)]
WorkerId = Annotated[str, Field(max_length=128, pattern=ID_PATTERN)]
Tenant = Annotated[str, Field(max_length=64, pattern=TENANT_PATTERN)]
ModelName = Annotated[str, Field(max_length=256, pattern=MODEL_PATTERN)]
def _kafka_topic(name: str) -> str:
    """Kafka refuses the names ``.`` and ``..`` that the pattern lets through."""
    if name in (".", ".."):
        raise PydanticCustomError("topic_name", "'.' and '..' are not Kafka topic names")
    return name


TopicName = Annotated[str, Field(max_length=MAX_TOPIC_CHARS, pattern=TOPIC_PATTERN),
                      AfterValidator(_kafka_topic)]
ShortName = Annotated[str, Field(max_length=64, pattern=NAME_PATTERN)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]

#: Unix time in seconds (float, UTC). Plain floats because the pure core does arithmetic on
#: them (deadlines, aging) with ``now`` passed in.
Timestamp = Annotated[float, Field(ge=0.0)]
#: A duration that must be positive (timeouts).
PositiveSeconds = Annotated[float, Field(gt=0.0, le=MAX_TIMEOUT_S)]
#: A measured duration (may be zero).
Seconds = Annotated[float, Field(ge=0.0)]
TokenCount = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
#: Counters and sizes that may exceed 2**32 (bytes of VRAM, KV tokens of a big node).
Count = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
#: Attempt numbers start at 1 and grow by one on every requeue.
Attempt = Annotated[int, Field(ge=1, le=MAX_ATTEMPT)]
#: An engine's KV-transfer parameters, passed through as they are (vLLM's
#: ``kv_transfer_params``: the prefill instance's engine id, host, port and block ids).
def _finite_json(value: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """No NaN or infinity anywhere inside: JSON parsing lets ``1e999`` into a ``JsonValue``
    (the models' ``allow_inf_nan=False`` does not reach it), encoding then writes null, and
    a scheduler rebuilding the assignment from it failed every cycle."""
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise PydanticCustomError("finite_number", "Input should be a finite number")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


KvTransfer = Annotated[dict[str, JsonValue], Field(max_length=64), AfterValidator(_finite_json)]
#: Kafka partition numbers.
Partition = Annotated[int, Field(ge=0, le=100_000)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
SchemaVersion = Annotated[
    int,
    Field(
        ge=1,
        le=SCHEMA_VERSION,
        description=(
            "Wire schema version of the producer. A reader accepts any version up to its own "
            "and rejects newer ones."
        ),
    ),
]


class FrozenModel(BaseModel):
    """Immutable, closed model: the common config of every wire model and its parts."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
        strict=True,
        # Validation errors must not echo prompt text into logs and dead-letter headers.
        hide_input_in_errors=True,
    )

    def evolve(self, **changes: Any) -> Self:
        """A validated copy with some fields replaced.

        Use this rather than ``model_copy(update=...)``, which skips validation and so could
        put a message on the wire that no reader accepts.
        """
        data = {name: getattr(self, name) for name in type(self).model_fields}
        data.update(changes)
        return type(self)(**data)


class WireMessage(FrozenModel):
    """A top-level message on a topic. Subclasses narrow ``kind`` to one ``Literal``."""

    kind: str = Field(description="Message discriminator.")
    schema_version: SchemaVersion = SCHEMA_VERSION
