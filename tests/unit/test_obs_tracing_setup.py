"""Tracing setup and the pieces around it: off means no provider and the parent context
passes through; settings; the deferral labels; the Jaeger config binds only loopback."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import tracing
from services.common.settings import Settings
from services.dev import jaeger
from services.scheduler import DEFAULT_PROFILE, QueueConfig, build_pipeline
from services.scheduler.runtime.results import RuntimeConfig, defer_reason
from services.scheduler.runtime.state import SchedulerState
from tests.builders_schemas import make_admitted, make_heartbeat, make_request

T = 1_700_000_000.0
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def off() -> Iterator[None]:
    tracing.setup("test", None)
    yield


def test_off_is_no_provider_and_the_parent_passes_through(off: None) -> None:
    assert not tracing.enabled()
    parent = tracing.extract([("traceparent", TRACEPARENT.encode())])
    span = tracing.tracer("t").start_span("x", context=parent)
    assert not span.is_recording()
    out = tracing.inject(ctx=trace.set_span_in_context(span))
    assert out == [("traceparent", TRACEPARENT.encode())]
    spans = tracing.HeaderSpans("t")
    assert spans.span("q", (("traceparent", TRACEPARENT.encode()),), T, T + 1, {}) == (
        ("traceparent", TRACEPARENT.encode()),
    )


def test_on_records_child_spans_and_sampling_follows_the_parent() -> None:
    exporter = InMemorySpanExporter()
    tracing.setup("test", None, 0.0, extra_processors=[SimpleSpanProcessor(exporter)])
    try:
        # ratio 0 samples no new root, but a sampled parent keeps its children sampled
        root = tracing.tracer("t").start_span("root")
        assert not root.is_recording()
        parent = tracing.extract([("traceparent", TRACEPARENT.encode())])
        with tracing.tracer("t").start_as_current_span("child", context=parent) as child:
            assert child.is_recording()
            headers = tracing.inject([("other", b"1")])
        assert headers[0] == ("other", b"1")
        [finished] = exporter.get_finished_spans()
        assert finished.context.trace_id == int(TRACEPARENT.split("-")[1], 16)
        assert finished.parent is not None
        assert finished.parent.span_id == int(TRACEPARENT.split("-")[2], 16)
    finally:
        tracing.setup("test", None)


@pytest.mark.parametrize(("ratio", "flag"), [(0.0, "01"), (1.0, "00"), (1.0, "01")])
def test_an_http_callers_trace_goes_on_but_ingest_decides_its_sampling(
    ratio: float, flag: str,
) -> None:
    """Found by an audit of the tracing: the API's span followed the sampled flag of the
    caller's traceparent, so any caller (no API key needed) made every hop record and
    export its calls at a ratio of 0, or turned them off at 1."""
    from starlette.requests import Request

    from services.ingest.http.routes import _http_span

    exporter = InMemorySpanExporter()
    tracing.setup("test", None, ratio, extra_processors=[SimpleSpanProcessor(exporter)])
    try:
        traceparent = TRACEPARENT[:-2] + flag
        call = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                        "headers": [(b"traceparent", traceparent.encode())],
                        "query_string": b""})
        span = _http_span(call, "chat")
        assert span.is_recording() == (ratio == 1.0)
        with trace.use_span(span, end_on_exit=True):
            headers = tracing.inject()  # what the next hop (the intake record) carries
        assert headers[0][1].decode().endswith("-01" if ratio == 1.0 else "-00")
        if ratio == 1.0:
            [finished] = exporter.get_finished_spans()
            assert finished.context.trace_id == int(TRACEPARENT.split("-")[1], 16)
            assert finished.parent is not None
            assert finished.parent.span_id == int(TRACEPARENT.split("-")[2], 16)
        else:
            assert exporter.get_finished_spans() == ()
    finally:
        tracing.setup("test", None)


def test_headers_of_reads_aiokafka_and_faust_shapes() -> None:
    class Record:
        def __init__(self, headers: Any) -> None:
            self.headers = headers

    assert tracing.headers_of(Record(None)) == []
    assert tracing.headers_of(object()) == []
    assert tracing.headers_of(Record((("a", b"1"),))) == [("a", b"1")]
    assert tracing.headers_of(Record({"a": b"1"})) == [("a", b"1")]


def test_settings_read_the_tracing_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMQ_OTLP_ENDPOINT", raising=False)
    assert Settings().otlp_endpoint is None  # tracing is off unless asked for
    monkeypatch.setenv("LLMQ_OTLP_ENDPOINT", jaeger.OTLP_HTTP_TRACES)
    monkeypatch.setenv("LLMQ_TRACE_SAMPLE_RATIO", "0.25")
    settings = Settings()
    assert (settings.otlp_endpoint, settings.trace_sample_ratio) == (
        "http://127.0.0.1:4318/v1/traces", 0.25
    )
    monkeypatch.setenv("LLMQ_TRACE_SAMPLE_RATIO", "1.5")
    with pytest.raises(ValueError):
        Settings()


@pytest.mark.parametrize(("given", "used"), [
    # OpenTelemetry's base-endpoint habit: posted to "/", every span was dropped.
    ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
    ("http://127.0.0.1:4318/", "http://127.0.0.1:4318/v1/traces"),
    ("https://otel.example:4318/custom/traces", "https://otel.example:4318/custom/traces"),
    ("", None),
])
def test_an_otlp_endpoint_without_a_path_posts_to_v1_traces(
    monkeypatch: pytest.MonkeyPatch, given: str, used: str | None
) -> None:
    monkeypatch.setenv("LLMQ_OTLP_ENDPOINT", given)
    assert Settings().otlp_endpoint == used


def test_an_otlp_endpoint_that_is_not_a_url_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMQ_OTLP_ENDPOINT", "127.0.0.1:4318")
    with pytest.raises(ValueError, match="not an http"):
        Settings()


# -- deferral labels pinned against the core's wording -------------------------------
@pytest.mark.parametrize(("reason", "label"), [
    ("no fresh worker in the fleet: saturated", "saturated"),
    ("only draining workers serve this route", "draining"),
    ("no room: largest free 10 < 20", "no_room"),
    ("no room: largest free 10 < 20; holding w1", "no_room"),
    ("refused by hold", "held"),
    ("refused by prefix_affinity", "filtered"),
    ("ledger refused the reservation", "ledger"),
    ("something new", "other"),
])
def test_defer_reason_labels(reason: str, label: str) -> None:
    assert defer_reason(reason) == label


def _beat(draining: bool) -> Any:
    return make_heartbeat(
        worker_id="w", partition=0, model="m", model_version=None, pool="any",
        kv_total_tokens=10_000, kv_free_tokens=10_000, kv_total_bytes=1, kv_free_bytes=1,
        block_size=16, running=0, waiting=0, max_num_seqs=64, draining=draining,
        interval_s=1.0, started_at=T - 100, seq=1, ts=T,
    )


@pytest.mark.parametrize(("fleet", "prompts", "label"), [
    ([], [100], "saturated"),
    ([_beat(draining=True)], [100], "draining"),
    ([_beat(draining=False)], [5_000, 5_000], "no_room"),
])
def test_the_core_defers_with_the_words_the_labels_expect(
    fleet: list[Any], prompts: list[int], label: str
) -> None:
    cfg = RuntimeConfig(scheduler_id="s", assignments_topic="a", events_topic="e",
                        status_topic="s")
    state = SchedulerState(cfg, QueueConfig(), build_pipeline(DEFAULT_PROFILE), random.Random(1))
    for hb in fleet:
        state.observe_heartbeat(hb)
    for i, prompt in enumerate(prompts):
        request = make_request(request_id=f"r{i}", tenant="t", model="m", max_tokens=16,
                               timeout_s=60.0, created_at=T, prefix_hash=None)
        # distinct priorities: each request heads its own class and is decided this cycle
        admitted = make_admitted(request=request, priority=("high", "low")[i], lane="short",
                                 prompt_tokens=prompt, reply_topic="p.replies.t",
                                 admitted_at=T)
        state.on_request(admitted, ("tp", i), T)
    assert dict(state.tick(T).deferred) == {label: 1}


# -- Jaeger's config -----------------------------------------------------------------
def _endpoints(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "endpoint" and isinstance(value, str):
                yield value
            else:
                yield from _endpoints(value)
    elif isinstance(node, list):
        for value in node:
            yield from _endpoints(value)


def test_jaeger_config_listens_on_loopback_only_and_matches_the_dev_tool() -> None:
    config = yaml.safe_load(jaeger.CONFIG_FILE.read_text())
    endpoints = sorted(_endpoints(config))
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", e) for e in endpoints), endpoints
    assert sorted(int(e.rsplit(":", 1)[1]) for e in endpoints) == sorted(jaeger.PORTS.values())
    # nothing that opens a port of its own beyond these
    assert config["service"]["extensions"] == ["jaeger_storage", "jaeger_query"]
    assert list(config["receivers"]) == ["otlp"]
    assert config["service"]["telemetry"]["metrics"]["level"] == "none"
