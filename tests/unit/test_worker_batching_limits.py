"""No chunk passes the wire's limits, whatever one engine delta holds."""

from __future__ import annotations

import asyncio

import pytest

from schemas.base import MAX_CHUNK_CHARS
from schemas.replies import TokenChunk
from services.worker.core.batching import Chunk, ChunkBatcher
from services.worker.engines.base import TokenDelta
from services.worker.engines.openai import _Tally
from services.worker.kafka_io import Publisher
from services.worker.runner import RequestRun
from tests.unit.test_worker_runner import _CFG, _assignment, _Producer
from tests.unit.test_worker_runner_endings import _ScriptedEngine


def _valid(chunk: Chunk) -> TokenChunk:
    return TokenChunk(request_id="r", attempt=1, seq=chunk.seq, text=chunk.text,
                      tokens=chunk.tokens, ts=1.0)


@pytest.mark.parametrize(("text", "tokens"), [
    ("ans", 70_000),                       # reasoning tokens counted on one short delta
    ("x" * (MAX_CHUNK_CHARS + 10), 5),     # one delta longer than a chunk holds
    ("y" * (3 * MAX_CHUNK_CHARS), 200_000),
    ("z" * (MAX_CHUNK_CHARS + 1), 0),      # text past the limit with no tokens at all
])
def test_a_delta_past_the_limits_is_split_into_valid_chunks(text: str, tokens: int) -> None:
    batcher = ChunkBatcher(max_tokens=16, max_delay_s=0.05)
    batcher.add("pending", 3, 0.0)
    chunks = batcher.add_all(text, tokens, 0.0)
    last = batcher.flush(0.0, force=True)
    chunks += [] if last is None else [last]
    for chunk in chunks:
        _valid(chunk)  # raises past the wire's limits
    assert "".join(c.text for c in chunks) == "pending" + text
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert sum(c.tokens for c in chunks) >= 3 + tokens


def test_a_small_delta_goes_through_add_unchanged() -> None:
    batcher = ChunkBatcher(max_tokens=2, max_delay_s=1.0)
    assert batcher.add_all("a", 1, 0.0) == []
    assert batcher.add_all("b", 1, 0.0) == [Chunk(0, "ab", 2)]


async def test_a_finished_generation_of_one_huge_delta_ends_done() -> None:
    producer = _Producer()
    engine = _ScriptedEngine([TokenDelta("ans", 70_000),
                              TokenDelta("", 0, finish_reason="stop", prompt_tokens=3,
                                         completion_tokens=70_000)])
    run = RequestRun(_assignment(), engine, Publisher(producer, 5.0), _CFG)
    outcome = await asyncio.wait_for(run.run(), 10.0)
    assert (outcome.kind, outcome.terminal) == ("done", "done")
    chunks = [r for _, r in producer.records if r["kind"] == "chunk"]
    assert sum(c["tokens"] for c in chunks) == 70_000
    assert "".join(c["text"] for c in chunks) == "ans"


@pytest.mark.parametrize("value", [-1, 1 << 40, True, 1.5, "3"])
def test_the_openai_stream_drops_usage_counts_the_wire_refuses(value: object) -> None:
    tally = _Tally()
    tally.take({"choices": [{"text": "a", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": value, "completion_tokens": value}})
    last = tally.last()
    assert (last.prompt_tokens, last.completion_tokens) == (None, None)
