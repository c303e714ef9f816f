"""Every wire message survives a round trip through the real broker, on its catalog topic."""

from __future__ import annotations

from collections import defaultdict

import pytest
from aiokafka.client import AIOKafkaClient

from schemas.base import WireMessage
from schemas.codec import decode, encode
from schemas.topics import TopicSpec, catalog, find_topic, message_key, reply_spec
from services.common.kafka import TopicRequest, ensure_topics, make_consumer, make_producer
from tests.builders_schemas import make_prompt_request, sample_messages

pytestmark = pytest.mark.kafka


def _topic_for(msg: WireMessage, specs: list[TopicSpec]) -> TopicSpec:
    for spec in specs:
        if type(msg) in spec.models:
            return spec
    raise AssertionError(f"no topic carries {type(msg).__name__}")


async def test_every_message_roundtrips_through_the_broker(
    bootstrap: str, topic_prefix: str
) -> None:
    specs = [*catalog(topic_prefix, assignment_partitions=4), reply_spec(topic_prefix, "acme")]
    created = await ensure_topics(
        bootstrap, [TopicRequest(s.name, s.partitions, s.config) for s in specs]
    )
    assert len(created) == len(specs)
    assert await ensure_topics(
        bootstrap, [TopicRequest(s.name, s.partitions, s.config) for s in specs]
    ) == []  # idempotent

    # Returned only once every partition of every topic has a leader: a fresh consumer
    # sees all partitions at once (Faust's PartitionsMismatch otherwise, see ensure_topics).
    probe = AIOKafkaClient(bootstrap_servers=bootstrap)
    await probe.bootstrap()
    try:
        cluster = await probe.fetch_all_metadata()
        for spec in specs:
            assert len(cluster.partitions_for_topic(spec.name) or ()) == spec.partitions
    finally:
        await probe.close()

    # A 1 MiB-character prompt must fit too (the catalog raises max.message.bytes).
    messages = [*sample_messages(), make_prompt_request("x" * (1 << 20))]
    sent: dict[str, list[WireMessage]] = defaultdict(list)
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        for msg in messages:
            spec = _topic_for(msg, specs)
            key = message_key(msg)
            await producer.send_and_wait(
                spec.name, encode(msg), key=key
            )
            sent[spec.name].append(msg)
    finally:
        await producer.stop()

    consumer = make_consumer(bootstrap, *sent)
    await consumer.start()
    received: dict[str, list[WireMessage]] = defaultdict(list)
    try:
        want = sum(len(v) for v in sent.values())
        for _ in range(50):
            batches = await consumer.getmany(timeout_ms=500)
            for tp, records in batches.items():
                target = find_topic(tp.topic, prefix=topic_prefix, assignment_partitions=4)
                received[tp.topic].extend(decode(r.value, target) for r in records)
            if sum(len(v) for v in received.values()) >= want:
                break
    finally:
        await consumer.stop()

    for topic, msgs in sent.items():
        # Order is per partition; compare as multisets of their canonical encodings.
        assert sorted(encode(m) for m in received[topic]) == sorted(encode(m) for m in msgs)
        assert received[topic] and all(m in msgs for m in received[topic])
