"""``services.common.kafka`` against the real broker: a topic created after the producer
started must not strand what is waiting for the others (aiokafka 0.14 narrows its metadata
to the new topic; see the class), and batches compressed with any codec Kafka offers are
read (the aiokafka extras in pyproject.toml); a producer whose sender task died raises and
says so instead of taking sends it will never send."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import OutOfOrderSequenceNumber, TopicAuthorizationFailedError
from aiokafka.producer.sender import SendProduceReqHandler

from services.common.kafka import (
    ProducerFailed,
    TopicRequest,
    ensure_topics,
    fetch_forever,
    make_consumer,
    make_producer,
)
from tests.fakes.sender_fault.sitecustomize import out_of_order

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


@pytest.mark.parametrize("codec", ["lz4", "snappy", "zstd", "gzip"])
async def test_a_batch_compressed_by_another_producer_is_read(
    bootstrap: str, topic_prefix: str, codec: str
) -> None:
    # Java and librdkafka clients often compress (compression.type). Without the codec
    # aiokafka raises UnsupportedCodecError at that offset on every fetch, and the loops
    # that read llmq's topics (fetch_forever, the health feed) retried it forever.
    topic = f"{topic_prefix}.{codec}"
    await ensure_topics(bootstrap, [TopicRequest(topic, 1)])
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=codec)
    await producer.start()
    try:
        for i in range(3):
            await producer.send(topic, f"record {i}".encode())
        await producer.flush()
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    seen: list[bytes] = []

    async def read() -> None:
        async for batches in fetch_forever(consumer, 200, f"test {codec}"):
            seen.extend(r.value for records in batches.values() for r in records)
            if len(seen) >= 3:
                return

    try:
        await asyncio.wait_for(read(), 15)
    finally:
        await consumer.stop()
    assert seen == [b"record 0", b"record 1", b"record 2"]


async def test_topics_get_the_replication_factor_asked_for(
    bootstrap: str, topic_prefix: str
) -> None:
    # LLMQ_REPLICATION_FACTOR reaches the broker: 1 works on the one-node dev broker, and
    # 2 is refused there with the broker's own reason (a production cluster takes it).
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import InvalidReplicationFactorError

    await ensure_topics(bootstrap, [TopicRequest(f"{topic_prefix}.one", 1)],
                        replication_factor=1)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([f"{topic_prefix}.one"])
        assert [len(p["replicas"]) for p in described["partitions"]] == [1]
    finally:
        await admin.close()
    with pytest.raises(InvalidReplicationFactorError):
        await ensure_topics(bootstrap, [TopicRequest(f"{topic_prefix}.two", 1)],
                            replication_factor=2)


async def test_topics_just_made_are_served_before_ensure_topics_returns(
    bootstrap: str, topic_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Their leaders were named before they served them: every service `make up` started
    # logged aiokafka's "Failed fetch offsets ... NotLeaderForPartitionError" errors for
    # its first offset lookups.
    names = [f"{topic_prefix}.fresh-{i}" for i in range(12)]
    await ensure_topics(bootstrap, [TopicRequest(name, 4) for name in names])
    caplog.set_level(logging.ERROR, logger="aiokafka")
    consumer = make_consumer(bootstrap, *names, group_id=f"{topic_prefix}.fresh")
    await consumer.start()
    try:
        async with asyncio.timeout(30):
            while len(consumer.assignment()) < 4 * len(names):
                await consumer.getmany(timeout_ms=100)
            for tp in consumer.assignment():
                await consumer.position(tp)  # its offset looked up, as a service's first
    finally:
        await consumer.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_topic_with_fewer_replicas_than_asked_for_is_warned_of(
    bootstrap: str, topic_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # LLMQ_REPLICATION_FACTOR raised after the topics were made: Kafka keeps their one
    # replica, and nothing said so (acks=all then means one broker's disk).
    one, other = f"{topic_prefix}.made-with-one", f"{topic_prefix}.also-one"
    await ensure_topics(bootstrap, [TopicRequest(one, 2), TopicRequest(other, 1)])
    caplog.set_level(logging.WARNING, logger="services.common.kafka")
    await ensure_topics(bootstrap, [TopicRequest(one, 2)], replication_factor=1)
    assert not [r for r in caplog.records if "replicas" in r.getMessage()]
    created = await ensure_topics(bootstrap, [TopicRequest(one, 2), TopicRequest(other, 1)],
                                  replication_factor=3)
    assert created == []  # the existing topics are used as they are, not refused
    (warning,) = [r for r in caplog.records if "replicas" in r.getMessage()]
    text = warning.getMessage()
    assert warning.levelno == logging.WARNING
    assert f"{other} (1), {one} (1)" in text and "LLMQ_REPLICATION_FACTOR=3" in text
    assert "kafka-reassign-partitions" in text


async def test_a_producer_answered_out_of_order_fails_once_and_says_so(
    bootstrap: str, topic_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker answers OUT_OF_ORDER_SEQUENCE_NUMBER (an idempotent producer after the
    # broker lost records it had acknowledged): aiokafka fails that batch and every later
    # one to the partition, for ever, and carries on. Before, nothing told the service.
    topic = f"{topic_prefix}.out-of-order"
    await ensure_topics(bootstrap, [TopicRequest(topic, 1)])
    failures: list[ProducerFailed] = []
    producer = make_producer(bootstrap, on_failure=failures.append)
    await producer.start()
    try:
        await asyncio.wait_for(producer.send_and_wait(topic, b"sent while it works"), 10)
        assert producer.failure is None and failures == []
        real = SendProduceReqHandler.handle_response  # FAULT INJECTION: the broker's answer
        monkeypatch.setattr(SendProduceReqHandler, "handle_response",
                            lambda self, response: real(self, out_of_order(response)))
        with pytest.raises(OutOfOrderSequenceNumber):
            await asyncio.wait_for(producer.send_and_wait(topic, b"answered out of order"), 10)
        await asyncio.wait_for(_until(lambda: bool(failures)), 5)
        assert len(failures) == 1 and failures[0] is producer.failure
        assert isinstance(failures[0].__cause__, OutOfOrderSequenceNumber)
        assert "can no longer send" in str(failures[0])
        with pytest.raises(ProducerFailed):
            await asyncio.wait_for(producer.send(topic, b"after it"), 5)
    finally:
        await asyncio.wait_for(producer.stop(), 10)
    assert len(failures) == 1  # stop() is not a second failure


async def test_a_record_that_must_get_through_and_fails_is_the_producers_failure(
    bootstrap: str, topic_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Faust commits once its flush returns, and the flush returns on a failed delivery
    # too: a record of llmq's own topics refused for good (an ACL) was committed as handled.
    ours, theirs = f"{topic_prefix}.ours", f"{topic_prefix}.theirs"
    await ensure_topics(bootstrap, [TopicRequest(ours, 1), TopicRequest(theirs, 1)])
    failures: list[ProducerFailed] = []
    producer = make_producer(bootstrap, on_failure=failures.append,
                             must_deliver=lambda topic: topic == ours)
    await producer.start()
    try:
        real = SendProduceReqHandler.handle_response  # FAULT INJECTION: the broker's answer
        monkeypatch.setattr(SendProduceReqHandler, "handle_response",
                            lambda self, response: real(self, out_of_order(response, 29)))
        with pytest.raises(TopicAuthorizationFailedError):
            await asyncio.wait_for(producer.send_and_wait(theirs, b"a reply refused"), 10)
        await asyncio.sleep(0.1)
        assert failures == []  # not one that must get through: the caller was told
        with pytest.raises(TopicAuthorizationFailedError):
            await asyncio.wait_for(producer.send_and_wait(ours, b"an admission refused"), 10)
        await asyncio.wait_for(_until(lambda: bool(failures)), 5)
        assert len(failures) == 1 and f"a record to {ours}, which must get through" in str(
            failures[0])
    finally:
        await asyncio.wait_for(producer.stop(), 10)


async def test_a_producer_whose_sender_task_died_fails_once(
    bootstrap: str, topic_prefix: str
) -> None:
    # aiokafka's sender task ends on an error it did not expect (its "Unexpected error
    # during batch delivery"): every later send fails. The service must hear of it.
    topic = f"{topic_prefix}.dead-sender"
    await ensure_topics(bootstrap, [TopicRequest(topic, 1)])
    failures: list[ProducerFailed] = []
    producer = make_producer(bootstrap, on_failure=failures.append)
    await producer.start()
    try:
        async def broken(*_: object) -> None:  # FAULT INJECTION: a bug in the sender
            raise RuntimeError("a bug in the sender")

        producer._sender._send_produce_req = broken
        lost = await producer.send(topic, b"the one the sender dies on")
        await asyncio.wait_for(_until(lambda: bool(failures)), 10)
        assert failures[0] is producer.failure
        assert not lost.done() or lost.exception() is not None  # never reported as sent
        with pytest.raises(ProducerFailed):
            await asyncio.wait_for(producer.send(topic, b"after it died"), 5)
    finally:
        await asyncio.wait_for(producer.stop(), 10)
    assert len(failures) == 1


async def test_stopping_a_producer_is_not_a_failure(bootstrap: str, topic_prefix: str) -> None:
    # stop() cancels the sender task, and aiokafka's routine then returns normally: a
    # first version of the check above took that for a dead sender, and every service
    # crashed (exit 1) at its graceful stop.
    topic = f"{topic_prefix}.stopped"
    await ensure_topics(bootstrap, [TopicRequest(topic, 1)])
    failures: list[ProducerFailed] = []
    producer = make_producer(bootstrap, on_failure=failures.append)
    await producer.start()
    await asyncio.wait_for(producer.send_and_wait(topic, b"one"), 10)
    await asyncio.wait_for(producer.stop(), 10)
    await asyncio.sleep(0.1)  # a done callback would have run
    assert failures == [] and producer.failure is None


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.05)
