"""``request_drain`` / ``llmq drain`` against the real broker and a FAKE worker.

The worker is tests/fakes/heartbeat_worker.FakeHeartbeatWorker: it heartbeats, and on its
``DrainWorker`` it heartbeats ``draining`` while its in-flight count falls to 0, then stops
(as the real worker exits 0). Each test has its own topic prefix.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiokafka import TopicPartition
from click.testing import CliRunner

from schemas.codec import decode
from schemas.control import DrainWorker
from schemas.messages import CONTROL_ADAPTER
from schemas.topics import catalog
from services.common.kafka import TopicRequest, ensure_topics, make_consumer
from services.common.settings import Settings
from services.ops.cli import drain as drain_command
from services.ops.drain import request_drain
from services.ops.drain_progress import DrainUpdate
from services.ops.errors import UnknownWorker
from tests.fakes.heartbeat_worker import FakeHeartbeatWorker, heartbeat, publish

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]


@pytest.fixture
async def prefix(bootstrap: str, topic_prefix: str) -> str:
    specs = catalog(topic_prefix, 2)
    await ensure_topics(bootstrap, [TopicRequest(t.name, t.partitions, t.config) for t in specs])
    return topic_prefix


async def control_records(bootstrap: str, prefix: str) -> list[DrainWorker]:
    consumer = make_consumer(bootstrap)
    await consumer.start()
    try:
        tps = [TopicPartition(f"{prefix}.control", p) for p in range(3)]
        ends = await consumer.end_offsets(tps)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        found = []
        async def behind() -> bool:
            return any([await consumer.position(tp) < end for tp, end in ends.items()])

        while await behind():
            batches = await consumer.getmany(timeout_ms=1_000)
            found += [decode(r.value, CONTROL_ADAPTER) for rs in batches.values() for r in rs]
        return [m for m in found if isinstance(m, DrainWorker)]
    finally:
        await consumer.stop()


async def test_drain_and_wait_until_the_worker_stopped(bootstrap: str, prefix: str) -> None:
    worker = FakeHeartbeatWorker(bootstrap, prefix, "w-drain", slot=1, interval_s=0.2,
                                 running=3)
    other = FakeHeartbeatWorker(bootstrap, prefix, "w-other", slot=0, interval_s=0.2)
    await worker.start()
    await other.start()
    updates: list[DrainUpdate] = []
    try:
        result = await request_drain(bootstrap, prefix, "w-drain", "test", True, 20.0,
                                     on_progress=updates.append)
        assert result.outcome == "drained", result
        assert result.ok and result.sent
        assert (result.running, result.waiting) == (0, 0)
        assert worker.stopped.is_set()
        assert [c.reason for c in worker.drain_commands] == ["test"]
        assert worker.drain_commands[0].issued_by == "cli"
        assert other.drain_commands == [] and not other.stopped.is_set()
        phases = [u.phase for u in updates]
        assert phases[0] == "requested" and phases[-1] == "stopped"
        assert "draining" in phases
        running = [u.running for u in updates if u.phase == "draining"]
        assert running == sorted(running, reverse=True) and running[-1] == 0
    finally:
        await worker.stop()
        await other.stop()


async def test_no_wait_only_sends_the_command(bootstrap: str, prefix: str) -> None:
    await publish(bootstrap, prefix, heartbeat("w-busy", interval_s=5.0, running=4))
    result = await request_drain(bootstrap, prefix, "w-busy", "resize", False, 5.0)
    assert (result.outcome, result.ok, result.sent, result.running) == ("requested", True,
                                                                        True, 4)
    sent = await control_records(bootstrap, prefix)
    assert [(c.worker_id, c.reason) for c in sent] == [("w-busy", "resize")]


async def test_wait_times_out_while_the_worker_keeps_working(bootstrap: str,
                                                             prefix: str) -> None:
    # A worker that beats but never reacts (its drain reader is not this fake's).
    await publish(bootstrap, prefix, heartbeat("w-deaf", interval_s=30.0, running=2))
    started = time.monotonic()
    result = await request_drain(bootstrap, prefix, "w-deaf", "", True, 1.5)
    assert result.outcome == "timeout" and not result.ok
    # The bound is what is under test: the wait gives up at its 1.5 s timeout instead of
    # waiting for the worker (it never answers); 10 s leaves room for a slow broker.
    assert time.monotonic() - started < 10
    assert "still requested" in result.message


async def test_unknown_and_gone_workers(bootstrap: str, prefix: str) -> None:
    with pytest.raises(UnknownWorker, match="unknown worker 'nobody'"):
        await request_drain(bootstrap, prefix, "nobody", "", True, 5.0)
    await publish(bootstrap, prefix, heartbeat("w-gone"), "w-gone")
    result = await request_drain(bootstrap, prefix, "w-gone", "", True, 5.0)
    assert (result.outcome, result.ok, result.sent) == ("already_gone", True, False)
    assert await control_records(bootstrap, prefix) == []


async def test_stale_worker_gets_the_command_but_is_reported_lost(bootstrap: str,
                                                                  prefix: str) -> None:
    await publish(bootstrap, prefix, heartbeat("w-stale", ts=time.time() - 20, running=1))
    result = await request_drain(bootstrap, prefix, "w-stale", "", True, 5.0)
    assert (result.outcome, result.ok, result.sent) == ("lost", False, True)


async def test_cli(bootstrap: str, prefix: str) -> None:
    settings = Settings(topic_prefix=prefix)
    runner = CliRunner()
    unknown = await asyncio.to_thread(runner.invoke, drain_command, ["ghost"], obj=settings)
    assert unknown.exit_code == 1
    assert "error: unknown worker 'ghost'" in unknown.output

    worker = FakeHeartbeatWorker(bootstrap, prefix, "w-cli", interval_s=0.2, running=2)
    await worker.start()
    try:
        done = await asyncio.to_thread(
            runner.invoke, drain_command,
            ["w-cli", "--wait", "--timeout", "20", "--reason", "cli test", "--json"],
            obj=settings)
    finally:
        await worker.stop()
    assert done.exit_code == 0, done.output
    body = json.loads(done.output)
    assert (body["outcome"], body["ok"], body["worker_id"]) == ("drained", True, "w-cli")
    assert worker.drain_commands[0].reason == "cli test"
