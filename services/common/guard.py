"""The dead-letter guard: one bad record never stops a consumer, and is never lost silently.

Every consumer loop (Faust agents, plain aiokafka readers, workers) handles each record
through :meth:`Guard.run`. When the handler raises ``SchemaError`` (the record does not
decode) or any other ``Exception`` (it decoded but poisoned the handler), the original
record goes to ``llmq.deadletter`` unchanged, with ``schemas.codec.deadletter_headers``
(reason, failing field, ``topic/partition/offset``) in front of its own headers, and the
loop goes on with the next record (docs/live-system.md, "Guards"). A value over
``DEADLETTER_MAX_VALUE_BYTES`` (1 MiB) goes cut to that size, with its original length and
sha256 in two more headers: whole, it could be over what the producer or the topic takes
(a record that came in compressed, or just under the 8 MiB bound, plus the headers), and
the dead letter was refused: the record was then in its source topic only.

The guard knows nothing about Kafka clients: it is given an async ``DeadLetterSend``
(``aiokafka_dead_letter`` builds one from an aiokafka producer; a Faust app passes its own
producer). If even the dead letter cannot be produced, the guard logs the record's
coordinates and the reason at ERROR level, so an operator can find it in the source topic.

``asyncio.CancelledError`` is not an ``Exception`` and passes through: shutdown is not a
poison record.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from schemas.codec import SchemaError, deadletter_headers
from schemas.topics import (
    DEADLETTER_MAX_VALUE_BYTES,
    DEADLETTER_REASON_HEADER,
    DEADLETTER_SHA256_HEADER,
    DEADLETTER_TRUNCATED_HEADER,
)
from services.common.metrics import DEAD_LETTERS

T = TypeVar("T")

Headers = list[tuple[str, bytes]]
#: Produces one record to the dead-letter topic: ``(key, value, headers)``; raises on failure.
DeadLetterSend = Callable[[bytes | None, bytes | None, Headers], Awaitable[object]]

_log = logging.getLogger(__name__)
#: Every dead-letter header shares this prefix ("llmq-dlq-reason", ...).
_DLQ_HEADER_PREFIX = DEADLETTER_REASON_HEADER.rsplit("-", 1)[0] + "-"


class SourceRecord(Protocol):
    """What the guard reads of a consumed record (aiokafka ``ConsumerRecord`` and Faust's
    ``Message`` both have these attributes)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> Any: ...
    @property
    def value(self) -> Any: ...
    @property
    def headers(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class DeadLettered:
    """One record the guard sent (or tried to send) to the dead letter."""

    source: str
    reason: str
    field: str
    delivered: bool


class Guard:
    """Runs handlers record by record; failures become dead letters, never crashes.

    ``name`` goes into log lines (``"ingest.intake"``) and is the ``source`` label of
    ``llmq_dead_letters_total`` (keep it bounded: a service or slot, never a request).
    ``dead_lettered`` counts records handed to the dead letter since start (for tests).
    """

    def __init__(
        self, send: DeadLetterSend, *, name: str, logger: logging.Logger | None = None
    ) -> None:
        self._send = send
        self._name = name
        self._log = logger or _log
        self.dead_lettered = 0
        self._counter = DEAD_LETTERS.labels(source=name)

    async def run(
        self, record: SourceRecord, handler: Callable[[], Awaitable[T]]
    ) -> T | None:
        """``await handler()``; on an exception, dead-letter ``record`` and return None."""
        try:
            return await handler()
        except SchemaError as exc:
            self._log.warning("%s: invalid record %s: %s", self._name, _where(record), exc)
            await self.dead_letter(record, exc)
        except Exception as exc:
            # The handler's own bug or a poison value: keep the traceback for the operator.
            self._log.exception("%s: record %s failed", self._name, _where(record))
            await self.dead_letter(record, f"{type(exc).__name__}: {_text_of(exc)}")
        return None

    async def dead_letter(self, record: SourceRecord, reason: SchemaError | str) -> DeadLettered:
        """Send ``record`` to the dead letter with ``reason``; never raises."""
        self.dead_lettered += 1
        # Counted when handed over, delivered or not: an undelivered one is logged at
        # ERROR and stays in its source topic, and is just as much a poisoned record.
        self._counter.inc()
        headers = deadletter_headers(reason, record.topic, record.partition, record.offset)
        value = _as_bytes(record.value)
        if value is not None and len(value) > DEADLETTER_MAX_VALUE_BYTES:
            headers += [(DEADLETTER_TRUNCATED_HEADER, str(len(value)).encode()),
                        (DEADLETTER_SHA256_HEADER, hashlib.sha256(value).hexdigest().encode())]
            value = value[:DEADLETTER_MAX_VALUE_BYTES]
        headers += _own_headers(record.headers)
        field = reason.field if isinstance(reason, SchemaError) else ""
        try:
            await self._send(_as_bytes(record.key), value, headers)
        except Exception:
            self._log.error(
                "%s: could not dead-letter record %s (reason: %s); it stays in its source "
                "topic only", self._name, _where(record), reason, exc_info=True,
            )
            return DeadLettered(_where(record), str(reason), field, delivered=False)
        return DeadLettered(_where(record), str(reason), field, delivered=True)


def aiokafka_dead_letter(producer: Any, topic: str) -> DeadLetterSend:
    """A ``DeadLetterSend`` over a started aiokafka producer, waiting for the broker's ack."""

    async def send(key: bytes | None, value: bytes | None, headers: Headers) -> object:
        return await producer.send_and_wait(topic, value, key=key, headers=headers)

    return send


def _text_of(exc: BaseException) -> str:
    """``str(exc)``, or what can be said when even that fails (an exception's own
    ``__str__`` may raise: the guard must not)."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__} whose text cannot be shown>"


def _where(record: SourceRecord) -> str:
    return f"{record.topic}/{record.partition}/{record.offset}"


def _as_bytes(data: Any) -> bytes | None:
    if data is None or isinstance(data, bytes):
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    # Faust may hand over an already-deserialized key; keep something readable.
    return str(data).encode()


def _own_headers(headers: Any) -> Headers:
    """The record's headers as a list, minus dead-letter headers of an earlier trip."""
    if not headers:
        return []
    pairs: Iterable[Sequence[Any]] = (
        headers.items() if isinstance(headers, Mapping) else headers
    )
    kept: Headers = []
    for key, value in pairs:
        if str(key).startswith(_DLQ_HEADER_PREFIX):
            continue
        kept.append((str(key), _as_bytes(value) or b""))
    return kept
