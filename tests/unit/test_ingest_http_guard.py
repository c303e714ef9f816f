"""The dead-letter guard (services/common/guard.py): bad records go to the dead letter with a
reason, the loop goes on, and a failing dead letter is logged instead of raised."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from schemas.codec import decode
from schemas.requests import InferenceRequest
from schemas.topics import (
    DEADLETTER_FIELD_HEADER,
    DEADLETTER_REASON_HEADER,
    DEADLETTER_SOURCE_HEADER,
)
from services.common.guard import Guard, Headers


@dataclass
class Record:
    value: Any
    key: Any = b"k"
    topic: str = "llmq.intake"
    partition: int = 2
    offset: int = 41
    headers: Any = field(default_factory=lambda: [("traceparent", b"00-abc")])


@dataclass
class Sink:
    sent: list[tuple[bytes | None, bytes | None, Headers]] = field(default_factory=list)
    fail: bool = False

    async def __call__(self, key: bytes | None, value: bytes | None, headers: Headers) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.sent.append((key, value, headers))


async def test_handler_result_passes_through() -> None:
    sink = Sink()

    async def ok() -> int:
        return 7

    assert await Guard(sink, name="t").run(Record(b"{}"), ok) == 7
    assert sink.sent == []


async def test_undecodable_record_is_dead_lettered_with_field_and_source() -> None:
    sink = Sink()
    guard = Guard(sink, name="t")
    record = Record(b'{"kind": "request", "max_tokens": "many"}')

    async def handle() -> None:
        decode(record.value, InferenceRequest)

    assert await guard.run(record, handle) is None
    [(key, value, headers)] = sink.sent
    assert (key, value) == (b"k", record.value)
    named = dict(headers)
    assert named[DEADLETTER_SOURCE_HEADER] == b"llmq.intake/2/41"
    assert named[DEADLETTER_FIELD_HEADER]  # the first failing field
    assert named[DEADLETTER_REASON_HEADER]
    assert ("traceparent", b"00-abc") in headers  # original headers kept
    assert guard.dead_lettered == 1


async def test_poison_record_reason_names_the_exception() -> None:
    sink = Sink()

    async def boom() -> None:
        raise KeyError("tenant")

    await Guard(sink, name="t").run(Record(b"x", headers={"llmq-dlq-reason": b"old"}), boom)
    headers = dict(sink.sent[0][2])
    assert headers[DEADLETTER_REASON_HEADER] == b"KeyError: 'tenant'"
    assert headers[DEADLETTER_FIELD_HEADER] == b""


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise ZeroDivisionError("its own __str__ fails")


@pytest.mark.parametrize(("error", "reason"), [
    (ValueError("bad \udcff key"), b"ValueError: bad \\udcff key"),
    (_Unprintable(), b"_Unprintable: <_Unprintable whose text cannot be shown>"),
], ids=["lone surrogate", "str raises"])
async def test_a_poison_records_odd_exception_text_is_dead_lettered_not_raised(
    error: Exception, reason: bytes,
) -> None:
    """Found by an audit: building the reason header raised (UnicodeEncodeError, or the
    exception's own __str__), out of Guard.run, and would end the consumer loop."""
    sink = Sink()

    async def boom() -> None:
        raise error

    assert await Guard(sink, name="t").run(Record(b"x"), boom) is None
    assert dict(sink.sent[0][2])[DEADLETTER_REASON_HEADER] == reason


async def test_a_value_over_the_dead_letters_bound_goes_cut_with_its_length_and_digest(
) -> None:
    """Found by an audit: a record just under the 8 MiB bound, or one that came in
    compressed, was over what the dead-letter producer takes once headers were added: the
    send failed and the record stayed in its source topic only."""
    import hashlib

    from schemas.topics import (
        DEADLETTER_MAX_VALUE_BYTES,
        DEADLETTER_SHA256_HEADER,
        DEADLETTER_TRUNCATED_HEADER,
    )

    sink = Sink()
    value = b"x" * (8 << 20)

    async def undecodable() -> None:
        decode(value, InferenceRequest)

    await Guard(sink, name="t").run(Record(value), undecodable)
    [(_, sent, headers)] = sink.sent
    named = dict(headers)
    assert sent == value[:DEADLETTER_MAX_VALUE_BYTES]
    assert named[DEADLETTER_TRUNCATED_HEADER] == str(len(value)).encode()
    assert named[DEADLETTER_SHA256_HEADER] == hashlib.sha256(value).hexdigest().encode()
    assert named[DEADLETTER_REASON_HEADER]  # the reason still says why
    small = Sink()
    await Guard(small, name="t").run(Record(b"{}"), undecodable)
    assert DEADLETTER_TRUNCATED_HEADER not in dict(small.sent[0][2])


async def test_failed_dead_letter_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def boom() -> None:
        raise ValueError("bad")

    with caplog.at_level(logging.ERROR):
        assert await Guard(Sink(fail=True), name="t").run(Record(b"x"), boom) is None
    assert "llmq.intake/2/41" in caplog.text and "could not dead-letter" in caplog.text


async def test_cancellation_is_not_a_poison_record() -> None:
    sink = Sink()

    async def cancelled() -> None:
        raise asyncio.CancelledError()

    with pytest.raises(asyncio.CancelledError):
        await Guard(sink, name="t").run(Record(b"x"), cancelled)
    assert sink.sent == []
