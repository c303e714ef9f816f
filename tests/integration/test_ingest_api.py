"""The OpenAI-compatible API end to end: real ingest process, real broker, FAKE worker.

The worker is ``tests.fakes.ingest_stack.FakeWorker`` (a test-only fake: no scheduler or
worker exists in these tests); every request still goes HTTP → llmq.intake → admission
agent → llmq.requests.* → fake worker → reply topic → HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, NotFoundError

from schemas.codec import decode
from schemas.control import CancelRequest
from schemas.messages import CONTROL_ADAPTER
from services.common.kafka import make_consumer
from tests.fakes import sender_fault
from tests.fakes.ingest_stack import MODEL, FakeWorker, IngestProcess

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(60)]


@pytest.fixture
async def worker(bootstrap: str, topic_prefix: str) -> AsyncIterator[FakeWorker]:
    fake = FakeWorker(bootstrap, topic_prefix, duplicate_chunks=True)
    yield fake
    await fake.stop()


@pytest.fixture
async def ingest(
    bootstrap: str, topic_prefix: str, tmp_path: Path, worker: FakeWorker
) -> AsyncIterator[IngestProcess]:
    proc = IngestProcess(topic_prefix, tmp_path / "ingest.log")
    proc.start()
    try:
        # Topics exist once ingest answers; the fake worker needs them to subscribe.
        await proc.wait_ready(heartbeat=False)
        await worker.start()
        await proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def client(ingest: IngestProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=ingest.base_url, timeout=20.0) as http:
        yield http


def _sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n"), text
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


async def test_completion_non_streaming(client: httpx.AsyncClient, worker: FakeWorker) -> None:
    resp = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Say hello", "max_tokens": 8, "priority": "high"},
        headers={"x-request-id": "req-nonstream-1"},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"] == "req-nonstream-1"
    assert body["object"] == "text_completion"
    # Every chunk was delivered twice; the answer has each once.
    assert body["choices"] == [
        {"index": 0, "logprobs": None, "finish_reason": "stop", "text": "Hello, world"}
    ]
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3
    # The caller's id is scoped to its tenant downstream; responses show the caller's own.
    admitted = next(a for a in worker.admitted if a.request_id == "default:req-nonstream-1")
    assert admitted.priority == "high" and admitted.lane == "short"
    assert admitted.reply_topic.startswith(f"{worker.prefix}.replies.ingest-")


async def test_chat_streaming_sse(client: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = (await resp.aread()).decode()
    events = _sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hello"}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == "Hello, world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert len({c["id"] for c in chunks}) == 1


async def test_openai_sdk(ingest: IngestProcess) -> None:
    sdk = AsyncOpenAI(base_url=f"{ingest.base_url}/v1", api_key="x", max_retries=0)
    try:
        done = await sdk.completions.create(model=MODEL, prompt="Say hello", max_tokens=5)
        assert done.choices[0].text == "Hello, world" and done.usage is not None
        chat = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}]
        )
        assert chat.choices[0].message.content == "Hello, world"
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
            extra_body={"timeout": 30, "lane": "short"},
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(parts) == "Hello, world"
        models = await sdk.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(NotFoundError) as err:
            await sdk.completions.create(model="no-such-model", prompt="x")
        assert err.value.body is not None
    finally:
        await sdk.close()


async def test_refusals_in_openai_error_shape(client: httpx.AsyncClient) -> None:
    unknown = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "unknown_model"
    for body, param in [
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"prompt": "x"}, "model"),
    ]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        resp = await client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
    bad_json = await client.post("/v1/completions", content=b"{nope")
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]


async def test_disconnect_mid_stream_cancels(
    bootstrap: str, topic_prefix: str, client: httpx.AsyncClient, worker: FakeWorker
) -> None:
    worker.chunks = tuple(f"t{i} " for i in range(40))
    worker.chunk_delay_s = 0.1
    body = {"model": MODEL, "prompt": "long", "stream": True}
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"x-request-id": "req-gone-1"}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break  # first chunk seen: hang up
    # A non-streaming caller that gives up is noticed while it waits (polled each second).
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                          headers={"x-request-id": "req-gone-2"}, timeout=0.5)
    cancels = await _cancels(bootstrap, f"{topic_prefix}.control", want=2, timeout_s=10.0)
    assert sorted(c.request_id for c in cancels) == ["default:req-gone-1", "default:req-gone-2"]
    assert all(c.tenant == "default" and c.issued_by == "ingest" for c in cancels)


async def _cancels(
    bootstrap: str, topic: str, want: int, timeout_s: float
) -> list[CancelRequest]:
    consumer = make_consumer(bootstrap, topic)
    await consumer.start()
    found: list[CancelRequest] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(found) < want and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                found += [m for r in records
                          if isinstance(m := decode(r.value, CONTROL_ADAPTER), CancelRequest)]
    finally:
        await consumer.stop()
    assert len(found) == want, found
    return found


async def test_an_ingest_whose_producer_can_no_longer_send_exits_1(
    topic_prefix: str, tmp_path: Path
) -> None:
    """The broker answers OUT_OF_ORDER_SEQUENCE_NUMBER (FAULT INJECTION on the answer:
    tests/fakes/sender_fault), after which aiokafka fails every later batch to the
    partition. Before, the instance stayed ready and answered 503 for ever. Now the process
    exits 1 at once (without committing what it had handled), so a supervisor restarts it;
    the call in flight gets a 503 or a dropped connection."""
    trigger = tmp_path / "sender-fault"
    proc = IngestProcess(topic_prefix, tmp_path / "ingest.log", env=sender_fault.env(trigger))
    proc.start()
    try:
        await proc.wait_ready(heartbeat=False)
        trigger.touch()
        async with httpx.AsyncClient(base_url=proc.base_url, timeout=30.0) as http:
            try:
                answer = (await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": "Hi", "max_tokens": 4})).status_code
            except httpx.TransportError:  # the process went first
                answer = None
        assert answer in (503, None), answer
        assert proc.proc is not None
        assert await asyncio.to_thread(proc.proc.wait, 40) == 1, proc.tail()
        assert "can no longer send" in proc.tail(400)
    finally:
        proc.stop()


async def test_an_ingest_whose_admission_cannot_be_written_exits_without_committing_it(
    topic_prefix: str, tmp_path: Path, worker: FakeWorker
) -> None:
    """The broker refuses the admitted request for good (FAULT INJECTION on the answer:
    TOPIC_AUTHORIZATION_FAILED for the request topics; tests/fakes/sender_fault). Faust's
    flush returns on a failed delivery as on a delivered one, so the intake record was
    committed and the request lost: no admission, no answer, ingest ready all along. Now
    ingest exits 1 at once, before a commit, and a restart reads the record again."""
    trigger = tmp_path / "sender-fault"
    proc = IngestProcess(topic_prefix, tmp_path / "ingest.log",
                         env=sender_fault.env(trigger, code=29, topic_part=".requests."))
    proc.start()
    try:
        await proc.wait_ready(heartbeat=False)
        await worker.start()  # a live fleet: the request is admitted, not refused
        await proc.wait_ready()
        trigger.touch()
        async with httpx.AsyncClient(base_url=proc.base_url, timeout=30.0) as http:
            with contextlib.suppress(httpx.TransportError):  # the process goes meanwhile
                await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": "Hi", "max_tokens": 4})
        assert proc.proc is not None
        assert await asyncio.to_thread(proc.proc.wait, 40) == 1, proc.tail()
        assert "which must get through" in proc.tail(400)
    finally:
        proc.stop()
