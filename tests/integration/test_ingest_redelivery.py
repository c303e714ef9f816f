"""Intake records read again after a restart: one answered the first time is not decided
again (services.ingest.redelivery). Real ingest processes and broker; the worker is the
test-only FAKE of ``tests.fakes.ingest_stack``.

The crash itself (ingest refuses a request, its reply is acknowledged, and it dies before
faust commits the record's offset) is built from its aftermath, which is all the next
process sees: the intake record past the committed offset, and its refusal on the reply
topic, naming the record (header ``llmq-intake-record``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from schemas.codec import decode, encode
from schemas.messages import REPLY_ADAPTER
from schemas.replies import Done, Error
from schemas.topics import INTAKE_RECORD_HEADER, reply_spec
from services.common.kafka import TopicRequest, ensure_topics, make_consumer, make_producer
from tests.builders_schemas import make_error, make_prompt_request
from tests.fakes.ingest_stack import MODEL, FakeWorker, IngestProcess

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
async def worker(bootstrap: str, topic_prefix: str) -> AsyncIterator[FakeWorker]:
    fake = FakeWorker(bootstrap, topic_prefix)
    yield fake
    await fake.stop()


async def _terminals(bootstrap: str, topic: str, partitions: int) -> dict[str, list[object]]:
    """Every terminal reply on ``topic``, by request id (read from its start to its end)."""
    consumer = make_consumer(bootstrap)
    await consumer.start()
    found: dict[str, list[object]] = {}
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            while await consumer.position(tp) < ends[tp]:
                for record in (await consumer.getmany(tp, timeout_ms=1000)).get(tp, []):
                    reply = decode(record.value, REPLY_ADAPTER)
                    if isinstance(reply, Done | Error):
                        found.setdefault(reply.request_id, []).append(reply)
    finally:
        await consumer.stop()
    return found


async def test_a_refused_request_read_again_after_a_restart_is_not_admitted(
    bootstrap: str, topic_prefix: str, tmp_path: Path, worker: FakeWorker
) -> None:
    first = IngestProcess(topic_prefix, tmp_path / "ingest.log")
    first.start()
    try:
        await first.wait_ready(heartbeat=False)
        await worker.start()
        await first.wait_ready()
    finally:
        assert first.stop() == 0  # graceful: everything read so far is committed
    replies = reply_spec(topic_prefix, "default")
    await ensure_topics(bootstrap, [TopicRequest(replies.name, replies.partitions)])
    now = time.time()

    def request(rid: str) -> bytes:
        return encode(make_prompt_request(request_id=rid, tenant="default", model=MODEL,
                                          priority="normal", created_at=now))

    producer = make_producer(bootstrap)
    await producer.start()
    try:
        intake = f"{topic_prefix}.intake"
        sent = {rid: await producer.send_and_wait(intake, request(rid), key=b"default")
                for rid in ("refused", "retry", "fresh", "retry")}
        # What the crashed ingest wrote: the refusal of "refused" and of the first "retry",
        # each naming its record; the client then sent "retry" again (the same id), and
        # that record (the last) was never read.
        first_retry = sent["retry"].offset - 2
        for rid, offset in (("refused", sent["refused"].offset), ("retry", first_retry)):
            mark = f"{sent[rid].partition}/{offset}".encode()
            await producer.send_and_wait(replies.name, encode(make_error(
                request_id=rid, attempt=0, code="rate_limited", ts=now)), key=rid.encode(),
                headers=[(INTAKE_RECORD_HEADER, mark)])
    finally:
        await producer.stop()

    again = IngestProcess(topic_prefix, tmp_path / "ingest2.log", port=first.port)
    again.start()
    try:
        await again.wait_ready()
        deadline = time.monotonic() + 30
        while not (worker.seen("retry") and worker.seen("fresh")) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert worker.seen("retry") and worker.seen("fresh"), again.tail()
        await asyncio.sleep(1.0)  # an admission of "refused" would have reached the worker
        assert not worker.seen("refused"), again.tail()
        assert "answered when its record was read before" in again.tail(200)
    finally:
        again.stop()
    ended = await _terminals(bootstrap, replies.name, replies.partitions)
    assert [type(r) for r in ended["refused"]] == [Error]  # its one terminal
    assert [type(r) for r in ended["fresh"]] == [Done]
    assert [type(r) for r in ended["retry"]] == [Error, Done]  # the refused one's, its own
