"""Admission as a service: tenants and keys, rate limits, settlement, dead letters, restarts.

Real ingest process and broker; the worker is the test-only FAKE of
``tests.fakes.ingest_stack`` (it answers admitted requests and emits ``event.done``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from schemas.codec import encode
from schemas.replies import Done, Error
from schemas.topics import DEADLETTER_REASON_HEADER, DEADLETTER_SOURCE_HEADER, reply_spec
from services.common.kafka import TopicRequest, ensure_topics, make_consumer, make_producer
from services.common.replies import ReplyRouter
from services.ingest.tenants import hash_api_key
from tests.builders_schemas import make_prompt_request
from tests.fakes.ingest_stack import MODEL, FakeWorker, IngestProcess

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(90)]

TENANTS = f"""
[tenants.acme]
api_key_sha256 = "{hash_api_key("acme-key")}"
rpm = 1
request_burst = 2
tpm = 100000
max_concurrency = 8

[tenants.solo]
api_key_sha256 = ["{hash_api_key("solo-key")}"]
rpm = 600
tpm = 100000
max_concurrency = 1
"""


@pytest.fixture
async def worker(bootstrap: str, topic_prefix: str) -> AsyncIterator[FakeWorker]:
    fake = FakeWorker(bootstrap, topic_prefix)
    yield fake
    await fake.stop()


async def _start(proc: IngestProcess, worker: FakeWorker, first: bool = True) -> None:
    proc.start()
    if first:
        await proc.wait_ready(heartbeat=False)
        await worker.start()
    await proc.wait_ready()


@pytest.fixture
async def keyed(tmp_path: Path, topic_prefix: str, worker: FakeWorker) -> AsyncIterator[
    IngestProcess
]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    proc = IngestProcess(topic_prefix, tmp_path / "ingest.log",
                         env={"LLMQ_TENANTS_FILE": str(tenants)})
    try:
        await _start(proc, worker)
        yield proc
    finally:
        proc.stop()


async def _post(client: httpx.AsyncClient, key: str | None, request_id: str) -> httpx.Response:
    headers = {"x-request-id": request_id}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    return await client.post("/v1/completions", json=body, headers=headers)


async def test_a_worker_of_no_partition_of_the_topic_is_no_capacity(
        tmp_path: Path, topic_prefix: str, bootstrap: str) -> None:
    # The scheduler refuses a worker whose heartbeat names a partition the assignments
    # topic does not have (it could never be sent work). Ingest counted it as capacity:
    # a model served only by such workers was admitted, then rejected by the scheduler.
    stray = FakeWorker(bootstrap, topic_prefix, worker_id="stray", partition=10_000)
    real = FakeWorker(bootstrap, topic_prefix, worker_id="real", partition=0)
    proc = IngestProcess(topic_prefix, tmp_path / "ingest.log")
    try:
        proc.start()
        await proc.wait_ready(heartbeat=False)
        await stray.start()
        await asyncio.sleep(3.0)  # six of its beats; ingest reads every 0.2 s
        async with httpx.AsyncClient(base_url=proc.base_url, timeout=20) as client:
            ready = (await client.get("/readyz")).json()
            assert dict(ready["checks"])["worker_heartbeat"] is False, ready
            resp = await _post(client, None, "to-a-stray")
            assert resp.status_code == 503, resp.text
            assert "no live worker" in resp.text
            await real.start()  # the same beats on a partition the topic has: capacity
            await proc.wait_ready()
            assert (await _post(client, None, "to-a-real-one")).status_code == 200
        assert not stray.seen("to-a-stray")
    finally:
        proc.stop()
        await stray.stop()
        await real.stop()


async def test_api_keys_map_to_tenants(keyed: IngestProcess, worker: FakeWorker) -> None:
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=20) as client:
        for key in (None, "wrong-key"):
            resp = await _post(client, key, "req-key-1")
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/models")).status_code == 401
        ok = await _post(client, "acme-key", "req-key-2")
        assert ok.status_code == 200, ok.text
    # A client-chosen id is scoped to its tenant downstream (replies are routed by id).
    assert next(a for a in worker.admitted
                if a.request_id == "acme:req-key-2").request.tenant == "acme"


async def _exhaust(base_url: str, tag: str) -> httpx.Response:
    """Two requests pass (burst 2), the third is refused; returns the refusal."""
    async with httpx.AsyncClient(base_url=base_url, timeout=20) as client:
        for i in range(2):
            resp = await _post(client, "acme-key", f"{tag}-{i}")
            assert resp.status_code == 200, resp.text
        return await _post(client, "acme-key", f"{tag}-2")


async def test_burst_over_limit_is_429_and_not_queued(
    keyed: IngestProcess, worker: FakeWorker
) -> None:
    refused = await _exhaust(keyed.base_url, "req-burst")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limited"
    retry_after = int(refused.headers["retry-after"])
    assert 1 <= retry_after <= 60  # one request per minute refills
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=20) as client:
        streamed = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "stream": True},
            headers={"authorization": "Bearer acme-key", "x-request-id": "req-burst-3"},
        )
    # A refusal of a streaming call is a plain HTTP error too, not an SSE stream.
    assert streamed.status_code == 429 and "retry-after" in streamed.headers
    assert streamed.headers["content-type"] == "application/json"
    await asyncio.sleep(1.0)  # anything queued would have reached the fake worker by now
    assert worker.seen("acme:req-burst-0") and worker.seen("acme:req-burst-1")
    assert not worker.seen("acme:req-burst-2") and not worker.seen("acme:req-burst-3")


async def test_limits_survive_a_restart(
    tmp_path: Path, keyed: IngestProcess, worker: FakeWorker
) -> None:
    assert (await _exhaust(keyed.base_url, "req-restart")).status_code == 429
    assert keyed.stop() == 0  # graceful: SIGTERM
    again = IngestProcess(keyed.prefix, tmp_path / "ingest2.log", port=keyed.port,
                          env=keyed.env)
    try:
        await _start(again, worker, first=False)
        async with httpx.AsyncClient(base_url=again.base_url, timeout=20) as client:
            resp = await _post(client, "acme-key", "req-restart-3")
        assert resp.status_code == 429, resp.text  # the bucket came back from its changelog
    finally:
        again.stop()


async def test_terminal_events_release_concurrency(keyed: IngestProcess) -> None:
    # solo may have one request in flight: each must be settled by its event.done before
    # the next is admitted.
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=20) as client:
        for i in range(4):
            for attempt in range(50):
                resp = await _post(client, "solo-key", f"req-solo-{i}-{attempt}")
                if resp.status_code != 429:
                    break
                await asyncio.sleep(0.1)  # the settle record is on its way
            assert resp.status_code == 200, resp.text


async def test_a_reservation_no_event_settles_expires(
    tmp_path: Path, topic_prefix: str, worker: FakeWorker,
) -> None:
    """Expiry as the running app does it: its timer settles only the partitions it holds
    (read from Faust's assignor), and this instance holds the tenant's."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    worker.send_events = False  # answered, never settled by an event
    proc = IngestProcess(topic_prefix, tmp_path / "ingest.log", env={
        "LLMQ_TENANTS_FILE": str(tenants), "LLMQ_INGEST_RESERVATION_GRACE_S": "0",
        "LLMQ_INGEST_EXPIRY_SCAN_S": "0.5"})
    try:
        await _start(proc, worker)
        async with httpx.AsyncClient(base_url=proc.base_url, timeout=20) as client:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "timeout": 2}
            headers = {"authorization": "Bearer solo-key"}
            first = await client.post("/v1/completions", json=body, headers=headers)
            assert first.status_code == 200, first.text
            held = await client.post("/v1/completions", json=body, headers=headers)
            assert held.status_code == 429  # solo's one slot is still reserved
            started = time.monotonic()
            while time.monotonic() - started < 20:
                resp = await client.post("/v1/completions", json=body, headers=headers)
                if resp.status_code == 200:
                    break
                await asyncio.sleep(0.25)
            assert resp.status_code == 200, f"never expired: {proc.tail()}"
    finally:
        proc.stop()


async def test_garbage_is_dead_lettered_and_kafka_clients_are_served(
    bootstrap: str, topic_prefix: str, tmp_path: Path, worker: FakeWorker
) -> None:
    proc = IngestProcess(topic_prefix, tmp_path / "ingest.log")
    try:
        await _start(proc, worker)
        tenant_replies = reply_spec(topic_prefix, "default")
        await ensure_topics(bootstrap, [TopicRequest(tenant_replies.name,
                                                     tenant_replies.partitions)])
        async with ReplyRouter(bootstrap, tenant_replies.name) as router:
            invalid = router.open("req-kafka-bad")
            served = router.open("req-kafka-ok")
            bad = encode(make_prompt_request(request_id="req-kafka-bad", tenant="default"))
            bad = bad.replace(b'"max_tokens":64', b'"max_tokens":0')
            good = make_prompt_request(request_id="req-kafka-ok", tenant="default",
                                       model=MODEL, priority="normal", created_at=time.time())
            producer = make_producer(bootstrap)
            await producer.start()
            try:
                intake = f"{topic_prefix}.intake"
                await producer.send_and_wait(intake, b"\x00not json", key=b"default")
                await producer.send_and_wait(intake, bad, key=b"default")
                await producer.send_and_wait(intake, encode(good), key=b"default")
            finally:
                await producer.stop()
            refusal = await invalid.get(timeout=15)
            assert isinstance(refusal, Error) and refusal.code == "invalid"
            assert "max_tokens" in refusal.message and refusal.attempt == 0
            replies = [msg async for msg in served]
            assert isinstance(replies[-1], Done) and len(replies) == 4
        dead = await _dead_letters(bootstrap, f"{topic_prefix}.deadletter", want=2)
        assert [d[0] for d in dead] == [b"\x00not json", bad]
        assert all(d[1][DEADLETTER_SOURCE_HEADER].startswith(b"%s.intake/" % topic_prefix.encode())
                   for d in dead)
        assert b"max_tokens" in dead[1][1][DEADLETTER_REASON_HEADER]
        # The agent carried on: HTTP still works after the poison records.
        async with httpx.AsyncClient(base_url=proc.base_url, timeout=20) as client:
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert resp.status_code == 200, resp.text
    finally:
        proc.stop()


async def _dead_letters(
    bootstrap: str, topic: str, want: int
) -> list[tuple[bytes, dict[str, bytes]]]:
    consumer = make_consumer(bootstrap, topic)
    await consumer.start()
    found: list[tuple[bytes, dict[str, bytes]]] = []
    try:
        deadline = time.monotonic() + 15
        while len(found) < want and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                found += [(r.value, dict(r.headers)) for r in records]
    finally:
        await consumer.stop()
    assert len(found) == want, found
    return found

