"""Metrics and traces of the whole live stack: real processes, real broker, real Jaeger.

One stack (ingest, scheduler, health, two short-pool and one long-pool sim worker at 20×
speed) with a unique topic prefix, free loopback ports and ``LLMQ_OTLP_ENDPOINT`` pointing
at a local Jaeger (``llmq dev jaeger up``: the cached binary, built once if missing; the
test is skipped when it cannot be built). Requests go through the HTTP API, each with its
own W3C ``traceparent``; then

- every service's ``/metrics`` is scraped: each family of the observability issue is
  there, and the ones this traffic exercises moved;
- Jaeger's query API holds one trace per request spanning ingest, scheduler and worker,
  linked parent → child: client → ``POST`` → ``llmq.admission`` → ``llmq.queue`` →
  ``llmq.placement`` → the worker's generation span (with its first-token event).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.kafka import make_producer
from services.common.settings import Settings
from services.dev.jaeger import OTLP_HTTP_TRACES, QUERY_URL, Jaeger, JaegerError, query_answers
from services.stack import Stack, metrics_url, settings_env, stack_services
from tests.fakes.live_stack import loopback_config, wait_stack_ready, write_tenants_file
from tests.prefixes import unique_prefix

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "llama-3.1-8b"

#: Families each service must show, and those this test's traffic must move (> 0).
EXPECTED: dict[str, tuple[set[str], set[str]]] = {
    "ingest": (
        {"llmq_requests", "llmq_rejections", "llmq_admitted_tokens", "llmq_dead_letters"},
        {"llmq_requests", "llmq_rejections", "llmq_admitted_tokens", "llmq_dead_letters"},
    ),
    "scheduler": (
        {"llmq_queue_depth", "llmq_queue_wait_seconds", "llmq_schedule_decision_seconds",
         "llmq_placements", "llmq_placement_failures", "llmq_requeues",
         "llmq_worker_losses", "llmq_reserved_kv_tokens", "llmq_requests",
         "llmq_dead_letters"},
        {"llmq_queue_wait_seconds", "llmq_schedule_decision_seconds", "llmq_placements"},
    ),
    "worker": (
        {"llmq_requests", "llmq_time_to_first_token_seconds", "llmq_request_duration_seconds",
         "llmq_generated_tokens", "llmq_worker_kv_utilization_ratio",
         "llmq_worker_running_sequences", "llmq_worker_waiting_sequences",
         "llmq_worker_vram_used_bytes", "llmq_worker_vram_total_bytes",
         "llmq_worker_gpu_utilization_ratio", "llmq_dead_letters"},
        {"llmq_requests", "llmq_time_to_first_token_seconds", "llmq_request_duration_seconds",
         "llmq_generated_tokens", "llmq_worker_kv_total_tokens"},
    ),
    "health": (
        {"llmq_consumer_lag_records", "llmq_health_workers", "llmq_health_ready"},
        {"llmq_health_workers", "llmq_health_ready"},
    ),
}


@pytest.fixture(scope="module")
def jaeger() -> Iterator[None]:
    """A Jaeger answering on 127.0.0.1 (ours if one runs; else started, and stopped after)."""
    if query_answers():
        yield
        return
    local = Jaeger.from_settings(Settings())
    try:
        local.up(timeout_s=60.0)
    except JaegerError as exc:
        pytest.skip(f"no Jaeger: {exc}")
    try:
        yield
    finally:
        local.down()


class TracedStack:
    def __init__(self, tmp: Path) -> None:
        self.prefix = unique_prefix("o")
        self.settings = Settings(topic_prefix=self.prefix, assignment_partitions=8)
        cfg = loopback_config(time_scale=0.05, model=MODEL)
        self.http_port = cfg.http_port
        self.specs = stack_services(cfg)
        env = settings_env(self.settings) | {
            "LLMQ_TENANTS_FILE": str(write_tenants_file(tmp / "tenants.toml")),
            "LLMQ_HEALTH_LAG_S": "0.5",
            "LLMQ_OTLP_ENDPOINT": OTLP_HTTP_TRACES,
            # Export spans within half a second instead of the default 5 s batches.
            "OTEL_BSP_SCHEDULE_DELAY": "500",
        }
        self.log_dir = tmp / "logs"
        self.stack = Stack(self.specs, env)
        self.base_url = f"http://127.0.0.1:{self.http_port}"

    def metrics_urls(self) -> dict[str, str]:
        urls = {spec.name: metrics_url(spec) for spec in self.specs}
        return {name: url for name, url in urls.items() if url is not None}

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        wait_stack_ready(self.stack, self.base_url, self.log_dir, timeout_s)


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, bootstrap: str, jaeger: None
) -> Iterator[TracedStack]:
    stack = TracedStack(tmp_path_factory.mktemp("obs-stack"))
    stack.stack.start(log_dir=stack.log_dir)
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stack.stop(grace_s=20.0)


def _chat(stack: TracedStack, text: str, key: str = "open-key",
          traceparent: str | None = None, stream: bool = False) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if traceparent is not None:
        headers["traceparent"] = traceparent
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": 24, "stream": stream}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, headers=headers,
                      timeout=60)


def _scrape(url: str) -> dict[str, list[Any]]:
    text = httpx.get(url, timeout=5).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _moved(samples: list[Any]) -> bool:
    return any(s.value > 0 for s in samples if not s.name.endswith("_created"))


async def _poison_intake(stack: TracedStack, bootstrap: str) -> None:
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(f"{stack.prefix}.intake", b"{not json", key=b"default")
    finally:
        await producer.stop()


def _trace(trace_id: str, deadline_s: float = 30.0) -> dict[str, Any]:
    """The trace from Jaeger once its spans from all three services arrived, the ingest's
    HTTP span included."""
    deadline = time.monotonic() + deadline_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        resp = httpx.get(f"{QUERY_URL}/api/traces/{trace_id}", timeout=5)
        if resp.status_code == 200 and resp.json().get("data"):
            last = resp.json()["data"][0]
            services = {p["serviceName"] for p in last["processes"].values()}
            names = {s["operationName"] for s in last["spans"]}
            # The HTTP server span ends last (after the response) and may come a batch later.
            if {"llmq-ingest", "llmq-scheduler", "llmq-worker"} <= services and \
                    {"llmq.placement", "POST /v1/chat/completions"} <= names and \
                    any(n.startswith("chat ") for n in names):
                return last
        time.sleep(0.5)
    raise AssertionError(f"trace {trace_id} incomplete in Jaeger after {deadline_s} s: "
                         f"{json.dumps(last)[:3000]}")


async def test_metrics_and_one_trace_per_request(traced: TracedStack, bootstrap: str) -> None:
    client_spans: dict[str, tuple[str, str]] = {}  # request id -> (trace id, client span)
    for i, stream in enumerate((False, False, True)):
        trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
        resp = _chat(traced, f"hello {i}", traceparent=f"00-{trace_id}-{span_id}-01",
                     stream=stream)
        assert resp.status_code == 200, resp.text
        client_spans[resp.headers["x-request-id"]] = (trace_id, span_id)
    refused = [_chat(traced, "hi", key="limited-key").status_code for _ in range(3)]
    assert 429 in refused
    await _poison_intake(traced, bootstrap)

    # -- metrics: every family present on its service, the exercised ones moved ----------
    urls = traced.metrics_urls()
    deadline = time.monotonic() + 30.0
    while True:
        problems: list[str] = []
        merged: dict[str, dict[str, list[Any]]] = {}  # service -> family -> samples
        for name, url in sorted(urls.items()):
            service = "worker" if name.startswith("worker-") else name
            families = _scrape(url)
            problems += [f"{name}: no {f}" for f in sorted(EXPECTED[service][0] - families.keys())]
            for family, samples in families.items():
                merged.setdefault(service, {}).setdefault(family, []).extend(samples)
        for service, (_, moving) in EXPECTED.items():
            # Summed over the service's processes: the traffic need not reach every worker.
            problems += [f"{service}: {f} did not move" for f in sorted(moving)
                         if not _moved(merged.get(service, {}).get(f, []))]
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # gauges follow heartbeats and health's lag rounds
    assert not problems, problems
    scheduler = _scrape(urls["scheduler"])
    depth = {(s.labels["priority"], s.labels["lane"]) for s in scheduler["llmq_queue_depth"]}
    assert len(depth) == 6  # every priority × lane, emptied ones at 0
    health = _scrape(urls["health"])
    assert any(s.labels["topic"].startswith(f"{traced.prefix}.") for s in
               health["llmq_consumer_lag_records"])

    # -- traces: one per request, across the three services, linked ------------------------
    for request_id, (trace_id, client_span) in client_spans.items():
        data = _trace(trace_id)
        spans = {s["spanID"]: s for s in data["spans"]}
        service_of = {pid: p["serviceName"] for pid, p in data["processes"].items()}

        def parent_of(span: dict[str, Any]) -> str | None:
            refs = [r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"]
            return refs[0] if refs else None

        def only(name: str, spans: dict[str, dict[str, Any]] = spans) -> dict[str, Any]:
            found = [s for s in spans.values() if s["operationName"] == name
                     or (name == "generate" and s["operationName"].startswith("chat "))]
            assert len(found) == 1, (name, [s["operationName"] for s in spans.values()])
            return found[0]

        http = only("POST /v1/chat/completions")
        admission, queue = only("llmq.admission"), only("llmq.queue")
        placement, generate = only("llmq.placement"), only("generate")
        assert parent_of(http) == client_span
        assert parent_of(admission) == http["spanID"]
        assert parent_of(queue) == admission["spanID"]
        assert parent_of(placement) == queue["spanID"]
        assert parent_of(generate) == placement["spanID"]
        assert [service_of[s["processID"]] for s in (http, admission, queue, generate)] == [
            "llmq-ingest", "llmq-ingest", "llmq-scheduler", "llmq-worker"]
        tags = {t["key"]: t["value"] for t in generate["tags"]}
        assert tags["llmq.request_id"] == request_id and tags["llmq.outcome"] == "done"
        assert tags["gen_ai.request.model"] == MODEL and tags["gen_ai.usage.output_tokens"] > 0
        events = [f["value"] for log in generate["logs"] for f in log["fields"]
                  if f["key"] == "event"]
        assert "gen_ai.first_token" in events
        assert all(s["traceID"] == trace_id for s in data["spans"])
        # nothing of another request in this trace
        assert {t["value"] for s in data["spans"] for t in s["tags"]
                if t["key"] == "llmq.request_id"} == {request_id}
    services = httpx.get(f"{QUERY_URL}/api/services", timeout=5).json()["data"]
    assert {"llmq-ingest", "llmq-scheduler", "llmq-worker"} <= set(services)
