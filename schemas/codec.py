"""Bytes on the wire <-> wire models, with one error type for everything that can go wrong.

``encode(msg)`` gives compact UTF-8 JSON with fields in declaration order (the canonical form
the frozen samples in tests/data/samples pin down). ``decode(data, target)`` validates bytes
against a model class, a TypeAdapter or a TopicSpec, and raises only ``SchemaError``:
malformed JSON, unknown kind, wrong type, NaN/inf, oversized strings, out-of-range numbers and
unknown fields alike. ``SchemaError.field`` is the dotted path of the first failing field
(``"max_tokens"``, ``"messages.0.role"``; ``""`` for the record as a whole), which consumers
put in the dead-letter header and ingest turns into a 400/413.

Trace-context headers are not handled here (services/common owns them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, TypeVar, overload

from pydantic import TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from schemas.base import WireMessage
from schemas.common import ErrorCode
from schemas.messages import MODEL_BY_KIND
from schemas.topics import (
    DEADLETTER_FIELD_HEADER,
    DEADLETTER_REASON_HEADER,
    DEADLETTER_SOURCE_HEADER,
    TopicSpec,
)

M = TypeVar("M", bound=WireMessage)
T = TypeVar("T")

#: Records above this are refused before parsing: no valid message comes close (prompts are
#: bounded at 1 MiB characters), and parsing a huge record is the costly part.
MAX_RECORD_BYTES: Final = 8 << 20
#: Error messages are cut here: pydantic quotes the offending discriminator, which the
#: sender controls.
_MAX_PART_CHARS: Final = 64
_MAX_ERROR_CHARS: Final = 300
#: pydantic error types that mean "too big" rather than "malformed" (413 rather than 400).
_TOO_LARGE_TYPES: Final = frozenset({"string_too_long", "too_long", "record_too_large"})


@dataclass(frozen=True, slots=True)
class FieldError:
    """One validation failure: where, what kind (pydantic's error type), and why."""

    field: str
    type: str
    message: str


class SchemaError(ValueError):
    """A record that is not a valid message of the expected kind.

    ``field`` is the dotted path of the first failure (``""``: the record as a whole),
    ``type`` its pydantic error type (``"json_invalid"``, ``"string_too_long"``, ...),
    ``errors`` every failure found.
    """

    def __init__(self, errors: tuple[FieldError, ...]) -> None:
        if not errors:
            raise ValueError("SchemaError needs at least one FieldError")
        self.errors = errors
        first = errors[0]
        self.field = first.field
        self.type = first.type
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"{first.field or '<record>'}: {first.message}{more}")

    @property
    def error_code(self) -> ErrorCode:
        """The terminal error code a rejection for this error carries: ``too_large`` for a
        record over the size bound or an input (the prompt, the messages or one's content)
        over llmq's bound, ``invalid`` for the rest — an over-long short field (a
        300-character ``stop`` or ``model``, too many stop strings) is a malformed request,
        as the HTTP API answers it (found by an audit: Kafka clients got too_large)."""
        if self.type == "record_too_large":
            return "too_large"
        if self.type in _TOO_LARGE_TYPES and is_input_field(self.field):
            return "too_large"
        return "invalid"


def encode(msg: WireMessage) -> bytes:
    """Compact JSON of a message, every field included, in declaration order."""
    return msg.model_dump_json().encode()


@overload
def decode(data: bytes | bytearray | memoryview | None, target: type[M]) -> M: ...
@overload
def decode(data: bytes | bytearray | memoryview | None, target: TypeAdapter[T]) -> T: ...
@overload
def decode(data: bytes | bytearray | memoryview | None, target: TopicSpec) -> WireMessage: ...
def decode(
    data: bytes | bytearray | memoryview | None,
    target: type[WireMessage] | TypeAdapter[Any] | TopicSpec,
) -> Any:
    """Validate a record value against ``target``; raise ``SchemaError`` if it is not valid.

    ``None`` (a tombstone) and empty values are errors too: no llmq message is empty.
    """
    adapter = _adapter(target)
    if data is None or len(data) == 0:
        raise SchemaError((FieldError("", "record_empty", "empty record value"),))
    if len(data) > MAX_RECORD_BYTES:
        raise SchemaError(
            (
                FieldError(
                    "",
                    "record_too_large",
                    f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}",
                ),
            )
        )
    raw = bytes(data) if isinstance(data, memoryview) else data
    try:
        if isinstance(adapter, TypeAdapter):
            return adapter.validate_json(raw)
        return adapter.model_validate_json(raw)
    except ValidationError as exc:
        tagged = _is_tagged_union(adapter)
        raise SchemaError(tuple(_field_error(e, tagged) for e in exc.errors())) from None
    except (ValueError, TypeError, RecursionError) as exc:
        # pydantic reports bad JSON as ValidationError; this is the backstop that keeps the
        # promise of a single error type if the parser itself gives up some other way.
        raise SchemaError((FieldError("", "json_invalid", _cut(str(exc))),)) from None


def _adapter(target: type[WireMessage] | TypeAdapter[Any] | TopicSpec) -> Any:
    if isinstance(target, TopicSpec):
        if target.adapter is None:
            raise TypeError(f"{target.name} carries raw bytes, not llmq messages")
        return target.adapter
    return target


def _is_tagged_union(adapter: Any) -> bool:
    if not isinstance(adapter, TypeAdapter):
        return False
    schema = adapter.core_schema
    if schema["type"] == "definitions":  # a recursive member (a JSON value) wraps the union
        schema = schema["schema"]
    return bool(schema["type"] == "tagged-union")


def is_input_field(field: str) -> bool:
    """The request's input: the record as a whole (``""``), the prompt, the messages or
    one's content (``messages.3.content``): what may be too large rather than malformed."""
    if field in ("", "prompt", "messages"):
        return True
    parts = field.split(".")
    return len(parts) == 3 and parts[0] == "messages" and parts[1].isdigit() \
        and parts[2] == "content"


def _field_error(err: ErrorDetails, tagged: bool) -> FieldError:
    loc = list(err["loc"])
    # A discriminated union puts the tag first ("chunk", "seq"); the tag is not a field. Only
    # strip it for unions: "admitted" is both a kind and a field of Assignment.
    if tagged and loc and isinstance(loc[0], str) and loc[0] in MODEL_BY_KIND:
        loc = loc[1:]
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        loc = ["kind"]
    return FieldError(".".join(_part(p) for p in loc), err["type"], _printable(err["msg"]))


def _part(part: object) -> str:
    """One step of a field path, printable and short: an unknown key is the sender's
    choice (a 5 MiB key would make a 10 MiB dead letter; a newline, a forged log line)."""
    text = str(part)
    if not text:
        return '""'  # an empty key: the path must still name it, not read as the record
    short = text[:_MAX_PART_CHARS]
    if not short.isprintable():
        short = ascii(short)[1:-1]
    return short + ("..." if len(text) > _MAX_PART_CHARS else "")


def _printable(text: str) -> str:
    """An error message, cut and printable: pydantic quotes the sender's discriminator in
    it (a newline there forged a log line and a dead letter's reason)."""
    text = _cut(text)
    return text if text.isprintable() else ascii(text)[1:-1]


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def deadletter_headers(
    error: SchemaError | str, topic: str, partition: int, offset: int
) -> list[tuple[str, bytes]]:
    """Headers for a record forwarded to ``llmq.deadletter`` unchanged.

    ``error`` is the SchemaError that made the record undecodable, or a reason for a poison
    record that decoded but could not be processed.
    """
    reason = str(error) if isinstance(error, SchemaError) else error
    field = error.field if isinstance(error, SchemaError) else ""
    return [
        # backslashreplace: a reason quoting an exception's text may hold a lone surrogate,
        # which would raise here and take the consumer loop down with it (found by an audit).
        (DEADLETTER_REASON_HEADER, _cut(reason).encode(errors="backslashreplace")),
        (DEADLETTER_FIELD_HEADER, field.encode(errors="backslashreplace")),
        (DEADLETTER_SOURCE_HEADER, f"{topic}/{partition}/{offset}".encode()),
    ]


#: What reading the fields of an undecodable record's JSON may raise (a list where an
#: object was, a number past a float, nesting too deep); ValidationError is a ValueError.
SALVAGE_ERRORS: Final = (ValueError, TypeError, KeyError, ArithmeticError, RecursionError)


def undecodable_json(data: object, target: TypeAdapter[Any]) -> dict[str, Any] | None:
    """The parsed JSON object of a record value that does *not* decode as ``target``, to
    salvage who waits for it; None when it decodes (a record whose handling failed
    otherwise) or is no JSON object at all (nothing in it could name a request)."""
    if not isinstance(data, bytes | bytearray | str):
        return None
    raw = data.encode() if isinstance(data, str) else bytes(data)
    try:
        decode(raw, target)
        return None
    except SchemaError:
        pass
    try:
        data = json.loads(raw)
    except SALVAGE_ERRORS:
        return None
    return data if isinstance(data, dict) else None
