"""``llmq top --once --json`` against the real broker: workers and queue status from
heartbeats and ``QueueStatus`` records this test produces (unique topic prefix), rates and
percentiles from a metrics endpoint, an endpoint that is down, and no services.json.

The metrics endpoint is a FAKE: a real prometheus_client HTTP server on 127.0.0.1 standing
in for a scheduler/worker, whose figures advance by a fixed step on every scrape, so the
frame's rates and window percentiles are known exactly whatever the window turns out to be.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from schemas.codec import encode
from schemas.status import QueueStatus
from schemas.topics import catalog
from services.common.kafka import TopicRequest, ensure_topics, make_producer
from services.common.settings import Settings
from services.ops.status import services_file
from services.ops.top import top
from tests.fakes.heartbeat_worker import heartbeat, publish

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

SLOTS = 2


class FakeServiceMetrics(Collector):
    """FAKE service endpoint: scrape n (from 0) shows 100 + 10n done requests, 1000 + 500n
    tokens, 5n 429s, queue depth 7 for high/short, and a TTFT histogram that gains 10
    observations in (0.1, 0.5] per scrape."""

    def __init__(self) -> None:
        self.scrapes = 0

    def collect(self) -> Iterator[Metric]:
        n = self.scrapes
        self.scrapes += 1
        done = CounterMetricFamily("llmq_requests", "fake", labels=["outcome"])
        done.add_metric(["done"], 100 + 10 * n)
        tokens = CounterMetricFamily("llmq_generated_tokens", "fake", labels=["worker"])
        tokens.add_metric(["w-fake"], 1000 + 500 * n)
        refused = CounterMetricFamily("llmq_rejections", "fake", labels=["code"])
        refused.add_metric(["rate_limited"], 5 * n)
        depth = GaugeMetricFamily("llmq_queue_depth", "fake", labels=["priority", "lane"])
        depth.add_metric(["high", "short"], 7)
        depth.add_metric(["low", "long"], 0)
        ttft = HistogramMetricFamily("llmq_time_to_first_token_seconds", "fake",
                                     labels=["priority", "lane"])
        ttft.add_metric(["high", "short"], [("0.1", 5.0), ("0.5", 5.0 + 10 * n),
                                            ("+Inf", 5.0 + 10 * n)],
                        sum_value=0.25 + 3.0 * n)
        yield from (done, tokens, refused, depth, ttft)


@pytest.fixture
def fake_endpoint() -> Iterator[tuple[str, FakeServiceMetrics]]:
    registry = CollectorRegistry(auto_describe=False)
    fake = FakeServiceMetrics()
    registry.register(fake)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
async def cluster(bootstrap: str, topic_prefix: str, tmp_path: Path) -> Settings:
    s = Settings(topic_prefix=topic_prefix, assignment_partitions=SLOTS, home=tmp_path)
    specs = catalog(topic_prefix, SLOTS)
    await ensure_topics(bootstrap, [TopicRequest(t.name, t.partitions, t.config) for t in specs])
    return s


async def _queue_status(bootstrap: str, prefix: str) -> None:
    qs = QueueStatus(model="m1", scheduler_id="sched-a", pending_requests=7,
                     pending_tokens=7000, running_tokens=1500, drain_tokens_per_s=350.0,
                     live_workers=1, max_usable_kv_tokens=100_000, ts=time.time())
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(f"{prefix}.status", encode(qs), key=b"m1")
    finally:
        await producer.stop()


async def _top_json(settings: Settings, *extra: str) -> dict[str, Any]:
    result = await asyncio.to_thread(
        CliRunner().invoke, top, ["--once", "--json", "--interval", "0.3", *extra],
        obj=settings)
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(result.output)
    return doc


async def test_once_json_joins_kafka_and_metrics(
    cluster: Settings, bootstrap: str, fake_endpoint: tuple[str, FakeServiceMetrics]
) -> None:
    url, fake = fake_endpoint
    now = time.time()
    await publish(bootstrap, cluster.topic_prefix,
                  heartbeat("w-fake", partition=0, ts=now, interval_s=5.0,
                            kv_total_tokens=100_000, kv_free_tokens=25_000,
                            kv_total_bytes=100_000, kv_free_bytes=25_000, running=3),
                  heartbeat("w-old", partition=1, ts=now - 30, interval_s=1.0))
    await _queue_status(bootstrap, cluster.topic_prefix)
    down = f"http://127.0.0.1:{_closed_port()}/metrics"
    path = services_file(cluster.home)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"worker-0": {"pid": 1, "metrics_url": url},
                                "worker-1": {"pid": 2, "metrics_url": down}}))

    frame = await _top_json(cluster)

    assert frame["schema"] == 1 and frame["kafka"]["ok"] is True
    workers = {w["worker_id"]: w for w in frame["status"]["workers"]}
    assert {k: w["state"] for k, w in workers.items()} == {"w-fake": "up", "w-old": "stale"}
    assert workers["w-fake"]["kv_used_pct"] == 75.0
    (queue,) = frame["status"]["queues"]
    assert (queue["model"], queue["pending_requests"], queue["scheduler_id"]) == (
        "m1", 7, "sched-a")

    # Two scrapes of the fake, one step apart: exact per-window figures.
    assert fake.scrapes == 2
    window = frame["window_s"]
    assert window >= 0.3
    rates = frame["rates"]
    assert rates["requests_per_s"] * window == pytest.approx(10, rel=0.02)
    assert rates["done_per_s"] * window == pytest.approx(10, rel=0.02)
    assert rates["tokens_per_s"] * window == pytest.approx(500, rel=0.02)
    assert rates["rejected_429_per_s"] * window == pytest.approx(5, rel=0.02)
    assert rates["placements_per_s"] is None  # the fake exposes no placements
    ttft = frame["latency"]["ttft"]
    assert ttft["window"]["count"] == 10
    assert ttft["window"]["p50"] == pytest.approx(0.1 + 0.4 * 5 / 10)
    assert ttft["total"]["count"] == 15
    hs = next(c for c in frame["classes"] if (c["priority"], c["lane"]) == ("high", "short"))
    assert hs["depth"] == 7

    endpoints = {e["name"]: e for e in frame["endpoints"]}
    assert endpoints["worker-0"]["ok"] and endpoints["worker-0"]["series"] > 0
    assert not endpoints["worker-1"]["ok"]
    assert any(line.startswith(f"worker-1 ({down}): unreachable") for line in frame["missing"])
    assert frame["status"]["metrics_urls"] == {"worker-0": url, "worker-1": down}


async def test_once_without_services_json_shows_kafka_and_says_what_is_missing(
    cluster: Settings, bootstrap: str
) -> None:
    await publish(bootstrap, cluster.topic_prefix, heartbeat("w-1", ts=time.time()))
    frame = await _top_json(cluster)
    assert [w["worker_id"] for w in frame["status"]["workers"]] == ["w-1"]
    assert set(frame["rates"].values()) == {None}
    assert frame["endpoints"] == [] and frame["classes"] == []
    assert any("no metrics endpoints listed in" in line for line in frame["missing"])


async def test_once_renders_for_a_person(
    cluster: Settings, bootstrap: str, fake_endpoint: tuple[str, FakeServiceMetrics]
) -> None:
    url, _ = fake_endpoint
    await publish(bootstrap, cluster.topic_prefix,
                  heartbeat("w-fake", ts=time.time(), kv_total_tokens=1000, kv_free_tokens=500,
                            kv_total_bytes=1000, kv_free_bytes=500))
    path = services_file(cluster.home)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"worker-0": {"pid": 1, "metrics_url": url}}))
    result = await asyncio.to_thread(CliRunner(env={"COLUMNS": "200"}).invoke, top,
                                     ["--once", "--interval", "0.2"], obj=cluster)
    assert result.exit_code == 0, result.output
    for needle in ("llmq top", "w-fake", "50.0%", "429/s", "high/short", "time to first token"):
        assert needle in result.output, needle
