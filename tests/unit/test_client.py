"""The client SDK's handle without a broker: its producer is a stand-in that records what
is sent, and its reply router is the real one, never started (``route`` feeds it). The
SDK against a real broker: tests/integration/test_e2e_stack.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmq.client import LlmqClient
from schemas.codec import decode
from schemas.control import CancelRequest
from schemas.replies import Done, Timings, TokenChunk, Usage


class _Producer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def send_and_wait(self, topic: str, value: bytes, key: Any = None,
                            headers: Any = None) -> None:
        self.sent.append((topic, value))

    async def stop(self) -> None: ...


def _client() -> tuple[LlmqClient, _Producer]:
    client = LlmqClient("127.0.0.1:9", tenant="default")
    producer = client._producer = _Producer()
    return client, producer


def _chunk(request_id: str, seq: int) -> TokenChunk:
    return TokenChunk(request_id=request_id, attempt=1, seq=seq, text=f"t{seq}", tokens=1,
                      ts=1.0)


async def test_a_timed_out_request_is_cancelled_and_forgotten() -> None:
    client, producer = _client()
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=0.1, request_id="r1")
    with pytest.raises(TimeoutError, match="no terminal reply for r1"):
        async for _ in handle:
            pass
    [cancel] = [decode(v, CancelRequest) for t, v in producer.sent if t.endswith("control")]
    assert (cancel.request_id, cancel.reason) == ("r1", "client timeout")
    assert client._router.open_requests == 0
    assert not client._router.route(_chunk("r1", 0))  # a late reply goes nowhere
    again = await client.submit(prompt="hi", max_tokens=4, request_id="r1")  # id reusable
    assert again.request_id == "r1"


async def test_leaving_the_loop_early_keeps_the_stream_for_later() -> None:
    client, _ = _client()
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=30, request_id="r2")
    router = client._router
    for seq in range(2):
        router.route(_chunk("r2", seq))
    async for chunk in handle:
        assert chunk.seq == 0
        break
    assert router.open_requests == 1
    router.route(Done(request_id="r2", attempt=1, model="m", finish_reason="stop",
                      usage=Usage(prompt_tokens=1, completion_tokens=2),
                      timings=Timings(queued_s=0.0, e2e_s=0.1), ts=1.0))
    text, end = await asyncio.wait_for(handle.wait(), 5)
    assert text == "t1" and isinstance(end, Done)
    assert router.open_requests == 0
