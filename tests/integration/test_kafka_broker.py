"""The embedded broker's lifecycle, on a second broker with its own ports and data folder."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.kafka import TopicRequest, ensure_topics, make_consumer, make_producer
from services.common.settings import Settings
from services.dev import process
from services.dev.kafka_broker import BrokerConfig, KafkaBroker, server_properties
from tests.fakes.ports import free_port, listening_sockets

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def broker(tmp_path: Path, settings: Settings) -> Iterator[KafkaBroker]:
    cfg = BrokerConfig(
        host="127.0.0.1",
        port=free_port(),
        controller_port=free_port(),
        data_dir=tmp_path / "kafka",
        cache_dir=settings.cache_dir,  # share the jar cache: no second download
        heap_mb=256,
    )
    b = KafkaBroker(cfg)
    yield b
    b.down()


async def _roundtrip_topic(bootstrap: str, topic: str, produce: bool) -> list[bytes]:
    if produce:
        await ensure_topics(bootstrap, [TopicRequest(topic, 2)])
        producer = make_producer(bootstrap)
        await producer.start()
        try:
            for i in range(5):
                await producer.send_and_wait(topic, f"m{i}".encode(), key=b"k")
        finally:
            await producer.stop()
    consumer = make_consumer(bootstrap, topic)
    await consumer.start()
    try:
        batches = await consumer.getmany(timeout_ms=5_000, max_records=100)
        return sorted(m.value for msgs in batches.values() for m in msgs)
    finally:
        await consumer.stop()


def test_up_twice_down_and_restart_keeps_data(broker: KafkaBroker) -> None:
    first = broker.up()
    assert first.answering and first.pid is not None
    second = broker.up()  # idempotent: same process, still answering
    assert second.pid == first.pid and second.answering

    # Loopback only: every listening socket of the broker is on 127.0.0.1 (7F000001 in
    # /proc's little-endian hex, or its IPv4-mapped IPv6 form).
    addrs = {addr for addr, _ in listening_sockets(first.pid)}
    assert addrs, "the broker listens on nothing?"
    assert all(a.endswith("0100007F") for a in addrs), addrs

    sent = asyncio.run(_roundtrip_topic(broker.cfg.bootstrap, "keep.me", produce=True))
    assert sent == [f"m{i}".encode() for i in range(5)]

    assert broker.down() is True
    assert not Path(f"/proc/{first.pid}").exists() or not process.alive(first.pid)
    assert broker.status().running is False
    assert broker.down() is False  # harmless when nothing runs

    restarted = broker.up()
    assert restarted.pid != first.pid
    kept = asyncio.run(_roundtrip_topic(broker.cfg.bootstrap, "keep.me", produce=False))
    assert kept == sent


def test_server_properties_bind_loopback_and_single_node(tmp_path: Path) -> None:
    cfg = BrokerConfig("127.0.0.1", 1234, 1235, tmp_path, tmp_path, 256)
    props = dict(
        line.split("=", 1) for line in server_properties(cfg).splitlines() if "=" in line
    )
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:1234,CONTROLLER://127.0.0.1:1235"
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    # small heaps: the log cleaner's start-up allocation must not take half of it
    assert int(props["log.cleaner.dedupe.buffer.size"]) <= 32 << 20
