"""``fetch_forever``: the fetch loop every plain-aiokafka reader runs (reply router, control
reader, log reader). A failed fetch is logged and retried, never fatal. The consumer here
is a stand-in whose ``getmany`` fails on cue: a real broker cannot be made to fail one
fetch on demand (the readers' behaviour against a real broker is covered by the
integration tests)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from services.common.kafka import fetch_forever


class FlakyConsumer:
    """Stand-in: ``getmany`` answers from a script; an exception in it is raised."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.calls: list[int] = []

    async def getmany(self, timeout_ms: int) -> Any:
        self.calls.append(timeout_ms)
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step


async def _first(consumer: FlakyConsumer, n: int) -> list[Any]:
    got: list[Any] = []
    async for batches in fetch_forever(consumer, 50, "test reader"):  # type: ignore[arg-type]
        got.append(batches)
        if len(got) == n:
            break
    return got


def test_a_failed_fetch_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    consumer = FlakyConsumer([{"a": [1]}, KafkaConnectionError(), {}, {"b": [2, 3]}])
    with caplog.at_level(logging.WARNING):
        got = asyncio.run(_first(consumer, 3))
    assert got == [{"a": [1]}, {}, {"b": [2, 3]}]  # the failure yields nothing
    assert consumer.calls == [50, 50, 50, 50]
    assert [r.getMessage() for r in caplog.records] == ["test reader: fetch failed"]


def test_other_errors_are_not_swallowed() -> None:
    consumer = FlakyConsumer([ValueError("a bug")])
    with pytest.raises(ValueError, match="a bug"):
        asyncio.run(_first(consumer, 1))
