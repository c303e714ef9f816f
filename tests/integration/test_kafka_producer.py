"""``services.common.kafka.Producer`` against the real broker: a topic created after the
producer started must not strand what is waiting for the others (aiokafka 0.14 narrows
its metadata to the new topic; see the class)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.kafka import TopicRequest, ensure_topics, make_producer

pytestmark = pytest.mark.kafka


async def test_a_topic_created_after_start_does_not_strand_batches_for_others(
    bootstrap: str, topic_prefix: str
) -> None:
    old, new = f"{topic_prefix}.old", f"{topic_prefix}.new"
    await ensure_topics(bootstrap, [TopicRequest(old, 1)])
    producer = make_producer(bootstrap, linger_ms=300)
    await producer.start()
    try:
        # What aiokafka's metadata task does soon after start while it tracks no topic:
        # fetch every topic, `old` among them, without tracking any.
        await producer.client.force_metadata_update()
        await ensure_topics(bootstrap, [TopicRequest(new, 1)])
        waiting = await producer.send(old, b"lingers 300 ms in the accumulator")
        await asyncio.wait_for(producer.send_and_wait(new, b"first record of a new topic"), 10)
        metadata = await asyncio.wait_for(waiting, 10)  # a plain AIOKafkaProducer hangs here
        assert metadata.topic == old
    finally:
        await producer.stop()
