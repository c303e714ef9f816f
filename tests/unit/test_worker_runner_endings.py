"""A run whose engine ends with output the wire refuses still answers: one terminal reply
and one terminal event (``worker_lost``), and its offset may be committed. Counts the
wire cannot carry are replaced by the run's own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka.errors import TopicAuthorizationFailedError

from services.worker.engines.base import GenerateRequest, TokenDelta
from services.worker.kafka_io import Publisher
from services.worker.runner import RequestRun
from tests.unit.test_worker_runner import _CFG, _assignment, _BrokenEngine, _Producer


class _ScriptedEngine(_BrokenEngine):
    """Yields ``items`` as they are (not necessarily deltas: an engine bug), then ends."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(0)
        self.items = items

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        for item in self.items:
            await asyncio.sleep(0)
            yield item


async def _run(items: list[Any], producer: _Producer | None = None) -> tuple[Any, _Producer]:
    producer = producer or _Producer()
    run = RequestRun(_assignment(), _ScriptedEngine(items), Publisher(producer, 5.0), _CFG)
    return await asyncio.wait_for(run.run(), 10.0), producer


@pytest.mark.parametrize(("items", "message"), [
    ([TokenDelta("a", 1), None], "engine yielded NoneType, not a delta"),
    ([TokenDelta("a", 1, finish_reason="abort")],
     "engine ended with finish reason 'abort', not one of ['length', 'stop']"),
    ([TokenDelta("a", 1, finish_reason="stop", kv_transfer={"x": 1}), "junk"],
     "engine yielded str, not a delta"),
], ids=["yields None", "unknown finish reason", "yields a string"])
async def test_a_final_delta_the_wire_refuses_ends_worker_lost(
        items: list[Any], message: str) -> None:
    outcome, producer = await _run(items)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("failed", "worker_lost", True)
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]
    # Said by the guard that caught it, not by whatever a non-delta broke further on.
    assert [r["message"] for _, r in producer.records
            if r["kind"] in ("error", "event.failed")] == [message, message]


@pytest.mark.parametrize(("prompt", "completion", "usage"), [
    (-1, 1, {"prompt_tokens": 7, "completion_tokens": 1}),
    (5, -3, {"prompt_tokens": 5, "completion_tokens": 1}),
    (1 << 40, 1 << 40, {"prompt_tokens": 7, "completion_tokens": 1}),
])
async def test_engine_counts_off_the_wire_give_way_to_the_runs_own(
        prompt: int, completion: int, usage: dict[str, int]) -> None:
    outcome, producer = await _run([TokenDelta("a", 1, finish_reason="stop",
                                               prompt_tokens=prompt,
                                               completion_tokens=completion)])
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("done", "done", True)
    [done] = [r for _, r in producer.records if r["kind"] == "done"]
    assert done["usage"] == usage


async def test_a_reply_refused_for_good_still_lets_the_offset_be_committed() -> None:
    # The reply (send 3) is refused forever; the event.failed that follows goes out. The
    # offset was held open, and with it the slot's commit point, for the process's life.
    producer = _Producer(nack=frozenset({3}), error=TopicAuthorizationFailedError)
    outcome, _ = await _run([TokenDelta("ab", 2, finish_reason="stop")], producer)
    assert (outcome.terminal, outcome.acked) == (None, True)
    assert producer.terminals() == [("event.failed", "worker_lost")]
