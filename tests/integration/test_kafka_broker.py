"""The embedded broker's lifecycle, on a second broker with its own ports and data folder."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from services.common.kafka import TopicRequest, ensure_topics, make_consumer, make_producer
from services.common.settings import Settings
from services.dev.kafka_broker import BrokerConfig, KafkaBroker, server_properties

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def broker(tmp_path: Path, settings: Settings) -> KafkaBroker:
    cfg = BrokerConfig(
        host="127.0.0.1",
        port=_free_port(),
        controller_port=_free_port(),
        data_dir=tmp_path / "kafka",
        cache_dir=settings.cache_dir,  # share the jar cache: no second download
        heap_mb=256,
    )
    b = KafkaBroker(cfg)
    yield b
    b.down()


def _listening_addresses(pid: int) -> set[str]:
    """Local addresses of the LISTEN sockets owned by ``pid`` (from /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                found.add(cols[1].split(":")[0])
    return found


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
    addrs = _listening_addresses(first.pid)
    assert addrs, "the broker listens on nothing?"
    assert all(a.endswith("0100007F") for a in addrs), addrs

    sent = asyncio.run(_roundtrip_topic(broker.cfg.bootstrap, "keep.me", produce=True))
    assert sent == [f"m{i}".encode() for i in range(5)]

    assert broker.down() is True
    assert not Path(f"/proc/{first.pid}").exists() or not KafkaBroker._alive(first.pid)
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
