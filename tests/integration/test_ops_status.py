"""``cluster_status`` against the real broker: worker states and KV from heartbeats, depth
and lag from real commits of real consumer groups, queue status, metrics URLs.

The workers are test-side fakes (tests/fakes/heartbeat_worker.py): they only publish
heartbeats. Each test has its own topic prefix.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata
from click.testing import CliRunner

from schemas.codec import encode
from schemas.status import QueueStatus
from schemas.topics import catalog, request_topic
from services.common.kafka import TopicRequest, ensure_topics, make_consumer, make_producer
from services.common.settings import Settings
from services.ops.cli import status as status_command
from services.ops.status import cluster_status, services_file
from tests.builders_schemas import make_admitted
from tests.fakes.heartbeat_worker import heartbeat, publish

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

SLOTS = 4


@pytest.fixture
async def cluster(bootstrap: str, topic_prefix: str, tmp_path: Path) -> Settings:
    s = Settings(topic_prefix=topic_prefix, assignment_partitions=SLOTS, home=tmp_path)
    specs = catalog(topic_prefix, SLOTS)
    await ensure_topics(bootstrap, [TopicRequest(t.name, t.partitions, t.config) for t in specs])
    return s


async def produce(bootstrap: str, topic: str, per_partition: dict[int, int]) -> None:
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        value = encode(make_admitted())  # the figures count records, not their content
        for partition, count in per_partition.items():
            for _ in range(count):
                await producer.send_and_wait(topic, value, partition=partition)
    finally:
        await producer.stop()


async def commit(bootstrap: str, group: str, offsets: dict[TopicPartition, int]) -> None:
    """Commit ``offsets`` for ``group`` as its consumer would (real group commit)."""
    consumer = make_consumer(bootstrap, group_id=group)
    await consumer.start()
    try:
        consumer.assign(list(offsets))
        await consumer.commit({tp: OffsetAndMetadata(off, "") for tp, off in offsets.items()})
    finally:
        await consumer.stop()


async def test_no_workers(cluster: Settings) -> None:
    doc = await cluster_status(cluster)
    assert doc["workers"] == []
    assert doc["summary"]["total"] == 0
    assert doc["metrics_urls"] == {}
    assert doc["missing_topics"] == []
    result = await asyncio.to_thread(CliRunner().invoke, status_command, [], obj=cluster)
    assert result.exit_code == 0, result.output
    assert "no workers" in result.output


async def test_worker_states_and_kv(cluster: Settings, bootstrap: str) -> None:
    now = time.time()
    prefix = cluster.topic_prefix
    await publish(
        bootstrap, prefix,
        heartbeat("w-fresh", partition=0, ts=now, interval_s=5.0, kv_total_tokens=100_000,
                  kv_free_tokens=25_000, kv_total_bytes=100_000, kv_free_bytes=25_000,
                  running=5, waiting=2),
        heartbeat("w-stale", partition=1, ts=now - 30, interval_s=1.0),
        heartbeat("w-draining", partition=2, ts=now, interval_s=5.0, draining=True, running=1),
        heartbeat("w-dead", partition=3, ts=now, interval_s=5.0),
        "w-dead",  # tombstone
    )
    doc = await cluster_status(cluster)
    by_id = {w["worker_id"]: w for w in doc["workers"]}
    assert {k: w["state"] for k, w in by_id.items()} == {
        "w-fresh": "up", "w-stale": "stale", "w-draining": "draining", "w-dead": "gone"}
    fresh = by_id["w-fresh"]
    assert (fresh["slot"], fresh["kv_free_tokens"], fresh["kv_total_tokens"]) == (0, 25_000,
                                                                                100_000)
    assert (fresh["kv_free_pct"], fresh["kv_used_pct"]) == (25.0, 75.0)
    assert (fresh["running"], fresh["waiting"]) == (5, 2)
    assert doc["summary"] == {"up": 1, "draining": 1, "stale": 1, "gone": 1, "total": 4}

    result = await asyncio.to_thread(CliRunner().invoke, status_command, ["--json"], obj=cluster)
    assert result.exit_code == 0, result.output
    assert {w["worker_id"] for w in json.loads(result.output)["workers"]} == set(by_id)


async def test_depth_and_lag(cluster: Settings, bootstrap: str) -> None:
    prefix = cluster.topic_prefix
    high = request_topic(prefix, "high", "short")
    low = request_topic(prefix, "low", "long")
    intake = f"{prefix}.intake"
    assignments = f"{prefix}.assignments"
    await produce(bootstrap, high, {0: 6, 1: 4})
    await produce(bootstrap, low, {2: 3})
    await produce(bootstrap, intake, {0: 5})
    await produce(bootstrap, assignments, {1: 4, 2: 2})
    scheduler = f"{prefix}-scheduler"
    await commit(bootstrap, scheduler, {TopicPartition(high, 0): 4, TopicPartition(high, 1): 1,
                                        TopicPartition(low, 2): 3})
    # A decoy that consumed more, but is not named like a scheduler.
    await commit(bootstrap, f"{prefix}-replayer", {TopicPartition(high, 0): 6})
    await commit(bootstrap, f"{prefix}-ingest", {TopicPartition(intake, 0): 2})
    await commit(bootstrap, f"{prefix}-worker-slot-1", {TopicPartition(assignments, 1): 3})

    doc = await cluster_status(cluster)
    topics = {t["topic"]: t for t in doc["topics"]}
    assert doc["groups"] == {"scheduler": scheduler, "ingest": f"{prefix}-ingest"}
    assert (topics[high]["depth"], topics[high]["lag"], topics[high]["group"]) == (
        10, 2 + 3, scheduler)
    assert (topics[low]["depth"], topics[low]["lag"]) == (3, 0)
    medium = request_topic(prefix, "normal", "short")
    assert (topics[medium]["depth"], topics[medium]["lag"]) == (0, 0)
    assert (topics[intake]["depth"], topics[intake]["lag"]) == (5, 3)
    slots = topics[assignments]
    assert slots["depth"] == 6 and slots["partitions"] == SLOTS
    assert slots["slots"] == [{"partition": 1, "group": f"{prefix}-worker-slot-1",
                               "committed": 3, "end": 4, "lag": 1}]
    assert slots["lag"] == 1
    assert topics[f"{prefix}.events"]["lag"] is None

    # --group overrides discovery: a group with no commits has consumed nothing.
    other = await cluster_status(cluster, group=f"{prefix}-nobody")
    high_other = next(t for t in other["topics"] if t["topic"] == high)
    assert (high_other["group"], high_other["lag"]) == (f"{prefix}-nobody", 10)


async def test_queue_status_and_metrics_urls(cluster: Settings, bootstrap: str) -> None:
    qs = QueueStatus(model="m1", scheduler_id="sched-a", pending_requests=7,
                     pending_tokens=7000, running_tokens=1500, drain_tokens_per_s=350.0,
                     live_workers=2, max_usable_kv_tokens=100_000, ts=time.time())
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(f"{cluster.topic_prefix}.status", encode(qs), key=b"m1")
    finally:
        await producer.stop()
    path = services_file(cluster.home)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({
        "health": {"pid": 1, "metrics_url": "http://127.0.0.1:9402/metrics"},
        "worker-0": {"pid": 2, "metrics_url": "http://127.0.0.1:9403/metrics"},
    }))
    doc = await cluster_status(cluster)
    assert len(doc["queues"]) == 1
    q = doc["queues"][0]
    assert (q["model"], q["pending_requests"], q["drain_tokens_per_s"], q["fresh"]) == (
        "m1", 7, 350.0, True)
    assert doc["metrics_urls"] == {"health": "http://127.0.0.1:9402/metrics",
                                   "worker-0": "http://127.0.0.1:9403/metrics"}
    result = await asyncio.to_thread(CliRunner().invoke, status_command, [], obj=cluster)
    text = result.output
    assert "sched-a" in text and "http://127.0.0.1:9403/metrics" in text


async def test_missing_topics_are_reported_not_created(bootstrap: str, tmp_path: Path) -> None:
    settings = Settings(topic_prefix=f"absent{int(time.time() * 1000) % 10**9}", home=tmp_path)
    doc = await cluster_status(settings)
    assert doc["workers"] == [] and doc["topics"] == []
    assert f"{settings.topic_prefix}.heartbeats" in doc["missing_topics"]
    again = await cluster_status(settings)
    assert again["topics"] == []  # still absent: status created nothing


async def test_a_worker_beating_a_slot_the_assignments_topic_lacks_is_a_warning(
    cluster: Settings, bootstrap: str
) -> None:
    """The schedulers refuse a heartbeat naming partition 7 of 4; `llmq status` says so, with
    the count it read from the broker, and what to do."""
    now = time.time()
    await publish(bootstrap, cluster.topic_prefix,
                  heartbeat("w-ok", partition=3, ts=now, interval_s=5.0),
                  heartbeat("w-stray", partition=7, ts=now, interval_s=5.0))
    doc = await cluster_status(cluster)
    assert {w["worker_id"] for w in doc["workers"]} == {"w-ok", "w-stray"}
    (warning,) = doc["warnings"]
    assert "slot 7 is not a partition of the assignments topic (4 partitions)" in warning
    assert "w-stray" in warning
    result = await asyncio.to_thread(CliRunner().invoke, status_command, [], obj=cluster)
    assert result.exit_code == 0, result.output
    assert "slot 7 is not a partition" in " ".join(result.output.split())
