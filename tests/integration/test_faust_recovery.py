"""Faust's end-of-recovery race (faust-streaming#596) loses no record of an agent's stream.

At the end of a table recovery faust resumes the stream partitions, seeks them to their
committed offsets and then clears the agents' queues. Records fetched while the seek waits
on the broker were cleared unprocessed, and faust never read them again: an ingest kill -9
and restart left a run of intake records unanswered. ``make_app``'s table manager
(``services.common.faust_recovery``) stops the flow until the queues are cleared.

An in-process app built by ``make_app``, on the real broker: a table with a changelog
record (so the fetcher runs during recovery), a source with a committed offset and a
backlog behind it, a broker round trip of the seek made slow (3 s) so that the window is
wide, and an agent that, like ingest's admission agent waiting for the fleet view, takes
its first record only once recovery is over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import faust
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from services.common.faust_app import make_app
from services.common.faust_recovery import TableManager
from services.common.kafka import TopicRequest, ensure_topics, make_producer
from services.common.settings import Settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(90)]

BACKLOG, COMMITTED, LATE = 50, 10, 10
SEEK_DELAY_S = 3.0
_RAW: dict[str, Any] = {
    "key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw",
}
_JSON: faust.Schema[str, int] = faust.Schema(key_serializer="json", value_serializer="json")


async def _commit(bootstrap: str, group: str, tp: TopicPartition, offset: int) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: offset})
    finally:
        await consumer.stop()


def _slow_seek(monkeypatch: pytest.MonkeyPatch, app: faust.App) -> None:
    """The seek to committed offsets answers SEEK_DELAY_S later (a slow broker)."""
    consumer: Any = app.consumer  # faust's ConsumerT does not declare seek_to_committed
    seek: Callable[[], Awaitable[Mapping[Any, int]]] = consumer.seek_to_committed

    async def slow() -> Mapping[Any, int]:
        offsets = await seek()
        await asyncio.sleep(SEEK_DELAY_S)
        return offsets

    monkeypatch.setattr(consumer, "seek_to_committed", slow)


async def _until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_records_fetched_while_recovery_seeks_are_processed(
    bootstrap: str, topic_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app("recovery", Settings(topic_prefix=topic_prefix), datadir=str(tmp_path))
    source = f"{topic_prefix}.source"
    changelog = f"{app.conf.id}-counts-changelog"
    await ensure_topics(bootstrap, [TopicRequest(source, 1), TopicRequest(changelog, 1)])
    counts = app.Table("counts", partitions=1, default=int, schema=_JSON)
    seen: list[int] = []
    recovered = asyncio.Event()

    @app.agent(app.topic(source, **_RAW), name="recovery-agent")
    async def agent(stream: Any) -> None:
        async for event in stream.events():
            await recovered.wait()
            seen.append(event.message.offset)
            counts["records"] += 1

    producer = make_producer(bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(changelog, b"1", key=b'"records"')
        for i in range(BACKLOG):
            await producer.send_and_wait(source, b"%d" % i, key=b"k")
        await _commit(bootstrap, app.conf.id, TopicPartition(source, 0), COMMITTED)
        _slow_seek(monkeypatch, app)
        await app.start()
        try:
            tables = app.tables
            assert isinstance(tables, TableManager)
            await _until(tables.recovery.completed.is_set)
            await asyncio.sleep(0.2)  # past faust's clearing of the queues
            recovered.set()
            for i in range(BACKLOG, BACKLOG + LATE):
                await producer.send_and_wait(source, b"%d" % i, key=b"k")
            await _until(lambda: bool(seen) and max(seen) == BACKLOG + LATE - 1)
        finally:
            await app.stop()
    finally:
        await producer.stop()
    missing = sorted(set(range(COMMITTED, BACKLOG + LATE)) - set(seen))
    assert not missing, f"never processed: {missing}"
