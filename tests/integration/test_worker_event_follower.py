"""The worker's ``llmq.events`` follower on the real broker: where ``start(since_s)``
puts each partition (a draining prefill worker reads from its oldest hand-off on,
``services.worker.app``; the control reader from the end)."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.codec import encode
from schemas.workers import EventFirstToken, LifecycleEvent
from services.common.kafka import TopicRequest, ensure_topics, make_producer
from services.worker.kafka_io import EventFollower

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]


def _event(rid: str, ts: float) -> bytes:
    return encode(EventFirstToken(request_id=rid, tenant="t", attempt=2, worker_id="w1",
                                  ts=ts, ttft_s=0.1))


async def test_a_follower_reads_from_a_time_on_and_from_the_end_where_nothing_is_newer(
        bootstrap: str, topic_prefix: str) -> None:
    topic = f"{topic_prefix}.events"
    await ensure_topics(bootstrap, [TopicRequest(topic, 2)])
    now = time.time()
    old_ms, new_ms = int((now - 100) * 1000), int((now - 5) * 1000)
    producer = make_producer(bootstrap)
    await producer.start()
    seen: list[str] = []

    async def handle(event: LifecycleEvent) -> None:
        seen.append(event.request_id)

    follower = EventFollower(bootstrap, topic, handle)
    try:
        # Partition 0 has a record before the point and one after; partition 1 only one
        # before it (offsets_for_times finds nothing there: it starts at its end).
        for partition, rid, ts_ms in ((0, "old-0", old_ms), (0, "new-0", new_ms),
                                      (1, "old-1", old_ms)):
            await producer.send_and_wait(topic, _event(rid, ts_ms / 1000), key=rid.encode(),
                                         partition=partition, timestamp_ms=ts_ms)
        await follower.start(since_s=now - 10)
        reading = asyncio.create_task(follower.run())
        # Sent after the start, to the partition that started at its end: it is read.
        await producer.send_and_wait(topic, _event("later-1", time.time()), key=b"later-1",
                                     partition=1)
        for _ in range(200):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # anything else would have come by now
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        assert sorted(seen) == ["later-1", "new-0"]
    finally:
        await follower.stop()
        await producer.stop()
