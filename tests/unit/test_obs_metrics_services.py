"""Each service's measurements, driven through its own code paths, read back from the one
registry (``services.common.metrics.REGISTRY``).

The registry is process-wide and other tests add to it too, so every check compares a
sample before and after the code under test ran.
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas.codec import decode, encode
from schemas.messages import ASSIGNMENT_ADAPTER, REQUEST_ADAPTER
from schemas.requests import AdmittedRequest, Assignment
from schemas.workers import WorkerHeartbeat
from services.common import metrics as m
from services.common import tracing
from services.common.guard import Guard
from services.health.lag import SlotLag, TopicFigures
from services.health.metrics import HealthMetrics
from services.ingest.cluster import ClusterTracker, Freshness
from services.ingest.intake import IntakeHandler
from services.ingest.tenants import hash_api_key, load_tenancy, parse_tenants
from services.ingest.topics import IngestTopics
from services.scheduler import DEFAULT_PROFILE, QueueConfig, build_pipeline
from services.scheduler.runtime.metrics import SchedulerMetrics
from services.scheduler.runtime.results import RuntimeConfig
from services.scheduler.runtime.state import SchedulerState
from services.worker.core.heartbeat import HeartbeatFields
from services.worker.engines.base import EngineCapacity, GenerateRequest, TokenDelta
from services.worker.kafka_io import Publisher
from services.worker.metrics import WorkerMetrics
from services.worker.runner import RequestRun, RunConfig
from tests.builders_schemas import (
    make_admitted,
    make_assignment,
    make_heartbeat,
    make_prompt_request,
    make_request,
)

T = 1_700_000_000.0


def value(name: str, **labels: str) -> float:
    found = m.REGISTRY.get_sample_value(name, labels or None)
    return 0.0 if found is None else found


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup("test", None, extra_processors=[SimpleSpanProcessor(exporter)])
    try:
        yield exporter
    finally:
        tracing.setup("test", None)  # tracing off again for the other tests


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


# -- the dead-letter guard ------------------------------------------------------------------
@dataclass
class _Record:
    topic: str = "t"
    partition: int = 0
    offset: int = 7
    key: Any = b"k"
    value: Any = b"{not json"
    headers: Any = None


async def test_guard_counts_dead_letters_by_source() -> None:
    sent: list[Any] = []

    async def send(key: bytes | None, val: bytes | None, headers: Any) -> None:
        sent.append(key)

    async def boom() -> None:
        raise ValueError("poison")

    before = value("llmq_dead_letters_total", source="unit.guard")
    await Guard(send, name="unit.guard").run(_Record(), boom)
    assert value("llmq_dead_letters_total", source="unit.guard") == before + 1
    assert sent == [b"k"]


# -- ingest admission -------------------------------------------------------------------
TOPICS = IngestTopics.of("llmq", "llmq-ingest", "a")
MODEL = "smollm2-135m"


@dataclass
class _Intake:
    value: Any
    key: Any
    partition: int = 0
    headers: Any = None


class _Ingest:
    def __init__(self) -> None:
        tenancy = parse_tenants(Path("t.toml"), {"tenants": {"obs-t": {
            "api_key_sha256": hash_api_key("k"), "rpm": 60, "request_burst": 1,
            "tpm": 100_000, "max_concurrency": 4,
        }}})
        tracker = ClusterTracker(tenancy.config.admission.registry, Freshness())
        tracker.observe_heartbeat(make_heartbeat(worker_id="w", model=MODEL, ts=T))
        self.sent: list[tuple[str, bytes, tracing.Headers | None]] = []
        self.handler = IntakeHandler(
            topics=TOPICS, tenancy=tenancy, tracker=tracker, buckets={}, reservations={},
            publish=self._publish, ensure_topic=self._ensure, clock=lambda: T,
        )

    async def _publish(self, topic: str, key: bytes, val: bytes,
                       headers: tracing.Headers | None = None) -> None:
        self.sent.append((topic, val, headers))

    async def _ensure(self, topic: str) -> None:
        pass

    async def submit(self, rid: str, headers: tracing.Headers | None = None) -> None:
        req = make_prompt_request("x" * 40, request_id=rid, tenant="obs-t", model=MODEL,
                                  max_tokens=10, priority="normal", reply_to=None,
                                  timeout_s=60.0, created_at=T)
        await self.handler.on_request(_Intake(encode(req), b"obs-t", headers=headers))


async def test_ingest_counts_admitted_tokens_and_refusals() -> None:
    ingest = _Ingest()
    tokens = value("llmq_admitted_tokens_total", tenant="obs-t")
    refused = value("llmq_rejections_total", code="rate_limited")
    ended = value("llmq_requests_total", outcome="rate_limited")
    await ingest.submit("obs-1")
    await ingest.submit("obs-2")  # request_burst 1: refused
    admitted = decode(ingest.sent[0][1], REQUEST_ADAPTER)
    assert value("llmq_admitted_tokens_total", tenant="obs-t") == (
        tokens + admitted.prompt_tokens + 10
    )
    assert value("llmq_rejections_total", code="rate_limited") == refused + 1
    assert value("llmq_requests_total", outcome="rate_limited") == ended + 1


async def test_admission_span_is_the_child_of_the_intake_record_and_parent_of_its_output(
    spans: InMemorySpanExporter,
) -> None:
    with tracing.tracer("test").start_as_current_span("client") as client:
        headers = tracing.inject()
    ingest = _Ingest()
    await ingest.submit("obs-3", headers)
    admission = by_name(spans)["llmq.admission"]
    assert admission.parent is not None
    assert admission.parent.span_id == client.get_span_context().span_id
    assert admission.context.trace_id == client.get_span_context().trace_id
    attrs = dict(admission.attributes or {})
    assert (attrs["llmq.outcome"], attrs["llmq.tenant"], attrs["llmq.lane"]) == (
        "admitted", "obs-t", "short"
    )
    out = tracing.extract(ingest.sent[0][2])
    carried = trace.get_current_span(out).get_span_context()
    assert carried.span_id == admission.context.span_id


# -- scheduler ---------------------------------------------------------------------------
def _state() -> SchedulerState:
    cfg = RuntimeConfig(scheduler_id="s", assignments_topic="p.assignments",
                        events_topic="p.events", status_topic="p.status")
    return SchedulerState(cfg, QueueConfig(), build_pipeline(DEFAULT_PROFILE), random.Random(1),
                          tracing.HeaderSpans("test"))


def _beat(worker_id: str, partition: int, ts: float, kv: int = 10_000) -> WorkerHeartbeat:
    return make_heartbeat(
        worker_id=worker_id, partition=partition, model="m", model_version=None, pool="any",
        kv_total_tokens=kv, kv_free_tokens=kv, kv_total_bytes=kv, kv_free_bytes=kv,
        block_size=16, running=0, waiting=0, max_num_seqs=64, draining=False, interval_s=1.0,
        started_at=T - 100, seq=int(ts - T) + 1, ts=ts,
    )


def _admitted(rid: str, at: float, prompt: int = 1_000, priority: str = "high",
              timeout_s: float = 60.0) -> AdmittedRequest:
    request = make_request(request_id=rid, tenant="acme", model="m", max_tokens=24,
                           timeout_s=timeout_s, created_at=at, prefix_hash=None)
    return make_admitted(request=request, priority=priority, lane="long", prompt_tokens=prompt,
                         reply_topic="p.replies.acme", admitted_at=at)


def test_scheduler_metrics_follow_a_cycle(spans: InMemorySpanExporter) -> None:
    state, metrics = _state(), SchedulerMetrics()
    state.observe_heartbeat(_beat("obs-w1", 0, T))
    state.restore()
    tp = TopicPartition("p.requests.high.long", 0)
    wait = m.REGISTRY.get_sample_value("llmq_queue_wait_seconds_count",
                                       {"priority": "high", "lane": "long"}) or 0.0
    decisions = value("llmq_schedule_decision_seconds_count")
    placed = value("llmq_placements_total", worker="obs-w1", lane="long")
    no_room = value("llmq_placement_failures_total", reason="no_room")
    with tracing.tracer("test").start_as_current_span("admission") as admission:
        parent = tuple(tracing.inject())
    state.on_request(_admitted("obs-a", T - 2.0), (tp, 0), T, parent)
    # fits the worker, but not beside the first one: deferred for want of room
    state.on_request(_admitted("obs-big", T - 1.0, prompt=9_400), (tp, 1), T)
    metrics.set_depth(state.depth())
    assert value("llmq_queue_depth", priority="high", lane="long") == 2

    result = state.tick(T)
    metrics.tick(result)
    metrics.set_depth(state.depth())
    metrics.set_reserved(state.reserved_by_worker())
    assert value("llmq_queue_depth", priority="high", lane="long") == 1  # the big one waits
    assert value("llmq_queue_depth", priority="low", lane="short") == 0
    assert value("llmq_schedule_decision_seconds_count") == decisions + 1
    assert m.REGISTRY.get_sample_value(
        "llmq_queue_wait_seconds_sum", {"priority": "high", "lane": "long"}
    ) is not None
    assert m.REGISTRY.get_sample_value(
        "llmq_queue_wait_seconds_count", {"priority": "high", "lane": "long"}
    ) == wait + 1
    assert value("llmq_placements_total", worker="obs-w1", lane="long") == placed + 1
    assert value("llmq_placement_failures_total", reason="no_room") == no_room + 1
    assert value("llmq_reserved_kv_tokens", worker="obs-w1") == 1_024

    # queue -> placement spans under the admission span; the assignment carries placement.
    found = by_name(spans)
    queue, placement = found["llmq.queue"], found["llmq.placement"]
    assert queue.parent is not None and placement.parent is not None
    assert queue.parent.span_id == admission.get_span_context().span_id
    assert placement.parent.span_id == queue.context.span_id
    assert queue.start_time == int((T - 2.0) * 1e9) and queue.end_time == int(T * 1e9)
    assert dict(placement.attributes or {})["llmq.worker"] == "obs-w1"
    [effect] = result.effects
    [out] = effect.first
    carried = trace.get_current_span(tracing.extract(out.headers)).get_span_context()
    assert carried.span_id == placement.context.span_id


def test_scheduler_counts_worker_loss_requeue_and_its_own_terminals() -> None:
    state, metrics = _state(), SchedulerMetrics()
    state.observe_heartbeat(_beat("obs-w2", 1, T))
    state.restore()
    tp = TopicPartition("p.requests.high.long", 0)
    state.on_request(_admitted("obs-r", T), (tp, 0), T)
    state.on_request(_admitted("obs-late", T, timeout_s=1.0, prompt=9_400), (tp, 1), T)
    first = state.tick(T)
    [(assigned, _)] = [(o, e) for e in first.effects for o in e.first
                       if o.topic == "p.assignments"]
    state.observe_assignment(decode_assignment(assigned.value))
    losses, requeues = value("llmq_worker_losses_total"), value("llmq_requeues_total")
    timeouts = value("llmq_requests_total", outcome="queue_timeout")
    later = state.tick(T + 30.0)  # no heartbeat for 30 s: the worker is dead
    metrics.tick(later)
    metrics.ended(state.ended, state.requeued)
    metrics.set_reserved(state.reserved_by_worker())
    assert later.lost_workers == ["obs-w2"]
    assert value("llmq_worker_losses_total") == losses + 1
    assert value("llmq_requeues_total") == requeues  # held for its reply-topic check
    [held] = later.held
    state.release(held, False, T + 30.5)  # not answered: requeued
    metrics.ended(state.ended, state.requeued)
    assert value("llmq_requeues_total") == requeues + 1
    assert value("llmq_requests_total", outcome="queue_timeout") == timeouts + 1
    metrics.ended(state.ended)  # cumulative: counted once
    assert value("llmq_requests_total", outcome="queue_timeout") == timeouts + 1


def decode_assignment(raw: bytes) -> Assignment:
    found: Assignment = decode(raw, ASSIGNMENT_ADAPTER)
    return found


def test_reserved_kv_series_of_a_departed_worker_is_removed() -> None:
    metrics = SchedulerMetrics()
    metrics.set_reserved({"obs-gone": 5, "obs-stays": 0})
    metrics.set_reserved({"obs-stays": 3})
    assert m.REGISTRY.get_sample_value("llmq_reserved_kv_tokens", {"worker": "obs-gone"}) is None
    assert value("llmq_reserved_kv_tokens", worker="obs-stays") == 3


def test_placement_series_of_a_forgotten_worker_are_removed() -> None:
    m.PLACEMENTS.labels(worker="obs-left", lane="short").inc()
    m.DECODE_STAGES.labels(worker="obs-left", lane="long").inc()
    m.PLACEMENTS.labels(worker="obs-here", lane="short").inc()
    SchedulerMetrics.forget_workers(["obs-left", "obs-never-placed"])
    for name in ("llmq_placements_total", "llmq_decode_stages_total"):
        for lane in ("short", "long"):
            assert m.REGISTRY.get_sample_value(name, {"worker": "obs-left", "lane": lane}) \
                is None
    assert value("llmq_placements_total", worker="obs-here", lane="short") >= 1


# -- worker --------------------------------------------------------------------------------
def _fields(**changes: Any) -> HeartbeatFields:
    base: dict[str, Any] = {
        "kv_total_tokens": 1000, "kv_free_tokens": 250, "kv_total_bytes": 0,
        "kv_free_bytes": 0, "block_size": 16, "vram_total_bytes": 0, "vram_used_bytes": 0,
        "gpu_util": None, "running": 3, "waiting": 2, "max_num_seqs": 8, "tokens_per_s": 0.0,
    }
    base.update(changes)
    return HeartbeatFields(**base)


def test_worker_capacity_gauges_and_gpu_only_where_there_is_one() -> None:
    WorkerMetrics("obs-sim").observe(_fields(), draining=True)
    assert value("llmq_worker_kv_utilization_ratio", worker="obs-sim") == 0.75
    assert value("llmq_worker_kv_total_tokens", worker="obs-sim") == 1000
    assert value("llmq_worker_running_sequences", worker="obs-sim") == 3
    assert value("llmq_worker_waiting_sequences", worker="obs-sim") == 2
    assert value("llmq_worker_draining", worker="obs-sim") == 1
    assert m.REGISTRY.get_sample_value("llmq_worker_vram_total_bytes",
                                       {"worker": "obs-sim"}) is None
    WorkerMetrics("obs-gpu").observe(
        _fields(vram_total_bytes=80 << 30, vram_used_bytes=60 << 30, gpu_util=0.9), False
    )
    assert value("llmq_worker_vram_total_bytes", worker="obs-gpu") == 80 << 30
    assert value("llmq_worker_vram_used_bytes", worker="obs-gpu") == 60 << 30
    assert value("llmq_worker_gpu_utilization_ratio", worker="obs-gpu") == 0.9


class _Engine:
    name = "fake"

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def abort(self, request_id: str) -> None: ...

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        for _ in range(3):
            await asyncio.sleep(0)
            yield TokenDelta("ab", 2)
        yield TokenDelta("", 0, finish_reason="stop", prompt_tokens=7, completion_tokens=6)

    def capacity(self) -> EngineCapacity:
        return EngineCapacity(100, 100, 0, 0, 16, 0, 0, 4)


class _Producer:
    def __init__(self) -> None:
        self.records: list[tuple[str, list[tuple[str, bytes]] | None]] = []

    async def send(self, topic: str, value: bytes, *, key: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[None]:
        self.records.append((topic, headers))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_worker_run_measures_ttft_e2e_tokens_outcome_and_traces_every_record(
    spans: InMemorySpanExporter,
) -> None:
    with tracing.tracer("test").start_as_current_span("placement") as placement:
        parent = tracing.extract(tracing.inject())
    now = [T]
    request = make_request(request_id="obs-run", tenant="acme", model="m", max_tokens=6,
                           timeout_s=60.0, created_at=T - 1.0)
    admitted = make_admitted(request=request, priority="low", lane="short", prompt_tokens=7,
                             reply_topic="p.replies.acme", admitted_at=T - 1.0)
    assignment = make_assignment(admitted=admitted, worker_id="obs-w", partition=0, attempt=1,
                                 kv_tokens=16, deadline=T + 60, assigned_at=T)
    producer, metrics = _Producer(), WorkerMetrics("obs-w")
    ttft_n = m.REGISTRY.get_sample_value("llmq_time_to_first_token_seconds_count",
                                         {"priority": "low", "lane": "short"}) or 0.0
    e2e_n = m.REGISTRY.get_sample_value("llmq_request_duration_seconds_count",
                                        {"priority": "low", "lane": "short"}) or 0.0
    done_n = value("llmq_requests_total", outcome="done")
    tokens_n = value("llmq_generated_tokens_total", worker="obs-w")
    run = RequestRun(
        assignment, _Engine(), Publisher(producer, 5.0),
        RunConfig(worker_id="obs-w", model="m", events_topic="p.events", chunk_tokens=2),
        clock=lambda: now[0], on_tokens=metrics.tokens,
        on_first_token=lambda ttft: metrics.first_token("low", "short", ttft),
        trace_parent=parent,
    )
    outcome = await run.run()
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("done", "done", True)
    metrics.finished(outcome.terminal or "", "low", "short", outcome.e2e_s)
    assert m.REGISTRY.get_sample_value("llmq_time_to_first_token_seconds_count",
                                       {"priority": "low", "lane": "short"}) == ttft_n + 1
    assert m.REGISTRY.get_sample_value("llmq_request_duration_seconds_count",
                                       {"priority": "low", "lane": "short"}) == e2e_n + 1
    assert value("llmq_requests_total", outcome="done") == done_n + 1
    assert value("llmq_generated_tokens_total", worker="obs-w") == tokens_n + 6

    [generate] = [s for s in spans.get_finished_spans()
                  if (s.attributes or {}).get("llmq.request_id") == "obs-run"]
    assert generate.name in ("chat m", "text_completion m")  # GenAI: "<operation> <model>"
    assert generate.parent is not None
    assert generate.parent.span_id == placement.get_span_context().span_id
    attrs = dict(generate.attributes or {})
    assert (attrs["llmq.outcome"], attrs["gen_ai.usage.input_tokens"],
            attrs["gen_ai.usage.output_tokens"], attrs["llmq.worker"]) == ("done", 7, 6, "obs-w")
    assert [e.name for e in generate.events] == [tracing.FIRST_TOKEN_EVENT]
    # events, chunks and the terminal all carry the generation span's context
    assert len(producer.records) >= 4
    for topic, headers in producer.records:
        carried = trace.get_current_span(tracing.extract(headers)).get_span_context()
        assert carried.span_id == generate.context.span_id, topic


# -- health ----------------------------------------------------------------------------
def test_health_publishes_consumer_lag_and_drops_groups_that_left() -> None:
    metrics = HealthMetrics()
    metrics.lag([
        TopicFigures("o.requests.high.short", "requests", 2, 10, 10, "o-scheduler", 4),
        TopicFigures("o.intake", "intake", 2, 5, 5, None, None),
        TopicFigures("o.assignments", "assignments", 2, 3, 3, None, 3,
                     (SlotLag(0, "o-worker-slot-0", 1, 3, 2),)),
    ])
    assert value("llmq_consumer_lag_records", topic="o.requests.high.short",
                 group="o-scheduler") == 4
    assert value("llmq_consumer_lag_records", topic="o.assignments",
                 group="o-worker-slot-0") == 2
    metrics.lag([TopicFigures("o.requests.high.short", "requests", 2, 10, 10, "o-scheduler", 0)])
    assert m.REGISTRY.get_sample_value(
        "llmq_consumer_lag_records", {"topic": "o.assignments", "group": "o-worker-slot-0"}
    ) is None


# -- one registry, one view per service ------------------------------------------------
@pytest.mark.parametrize(("service", "shown", "hidden"), [
    ("ingest", "llmq_rejections", "llmq_health_ready"),
    ("scheduler", "llmq_requeues", "llmq_health_ready"),
    ("worker", "llmq_worker_kv_utilization_ratio", "llmq_requeues"),
    ("health", "llmq_health_ready", "llmq_schedule_decision_seconds"),
])
def test_each_service_endpoint_shows_only_its_families(
    service: str, shown: str, hidden: str
) -> None:
    names = {family.name for family in m.view(service).collect()}
    assert shown in names and hidden not in names
    assert names <= m.family_names(service)
    assert "llmq_requests" in m.family_names(service) or service == "health"


def test_every_family_is_served_by_some_service() -> None:
    """A family no service owns is never scraped: its dashboard panel stays empty."""
    served = set().union(*(m.family_names(service) for service in m.OWNED))
    defined = {family.name for family in m.REGISTRY.collect()}
    assert defined - served == set()


def test_the_tenant_label_is_bounded_in_open_mode() -> None:
    tenancy = load_tenancy(None)  # open mode: any tenant name a Kafka client sends
    assert tenancy.metric_label("default") == "default"
    assert {tenancy.metric_label(f"t{i}") for i in range(300)} == {"other"}


async def test_the_metrics_port_is_retried_while_a_previous_process_holds_it() -> None:
    """A rolling restart: the new process binds once the old one frees the port."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    bound: list[int] = []

    def serve(p: int) -> None:
        probe = socket.socket()
        try:
            probe.bind(("127.0.0.1", p))  # what start_http_server does first
        finally:
            probe.close()
        bound.append(p)

    asyncio.get_running_loop().call_later(0.3, holder.close)
    await m.serve_when_free(serve, port, wait_s=5.0, retry_s=0.05)
    assert bound == [port]

    def taken(p: int) -> None:
        raise OSError(errno.EADDRINUSE, "Address already in use")

    with pytest.raises(OSError, match="LLMQ_METRICS_PORT"):
        await m.serve_when_free(taken, port, wait_s=0.2, retry_s=0.05)
