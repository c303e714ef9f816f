"""W3C trace context survives a real broker round trip in Kafka record headers.

Three hops the way the services do them: a producer injects its span's context into the
record's headers, a consumer extracts it and starts a child span, produces the next record
with that child's context, and so on. Spans go to an in-memory exporter; one trace id
throughout, each span the child of the one before, across the broker twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from services.common import tracing
from services.common.kafka import TopicRequest, ensure_topics, make_consumer, make_producer

pytestmark = [pytest.mark.kafka]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup("test-propagation", None, extra_processors=[SimpleSpanProcessor(exporter)])
    try:
        yield exporter
    finally:
        tracing.setup("test-propagation", None)


async def _one_record(bootstrap: str, topic: str) -> Any:
    consumer = make_consumer(bootstrap, topic, group_id=f"{topic}-reader")
    await consumer.start()
    try:
        batches = await consumer.getmany(timeout_ms=15_000, max_records=1)
        [record] = [r for records in batches.values() for r in records]
        return record
    finally:
        await consumer.stop()


async def test_one_trace_across_two_broker_hops(
    bootstrap: str, topic_prefix: str, spans: InMemorySpanExporter
) -> None:
    first, second = f"{topic_prefix}.hop1", f"{topic_prefix}.hop2"
    await ensure_topics(bootstrap, [TopicRequest(first, 1), TopicRequest(second, 1)])
    producer = make_producer(bootstrap)
    await producer.start()
    tracer = tracing.tracer("test")
    try:
        with tracer.start_as_current_span("ingest", kind=SpanKind.PRODUCER):
            await producer.send_and_wait(first, b"request", key=b"r1",
                                         headers=tracing.inject([("x-other", b"kept")]))
        record = await _one_record(bootstrap, first)
        assert ("x-other", b"kept") in record.headers  # our headers travel beside it
        with tracer.start_as_current_span(
            "scheduler", context=tracing.extract(record.headers), kind=SpanKind.CONSUMER
        ):
            await producer.send_and_wait(second, b"assignment", key=b"r1",
                                         headers=tracing.inject())
        record = await _one_record(bootstrap, second)
        with tracer.start_as_current_span(
            "worker", context=tracing.extract(tracing.headers_of(record)),
            kind=SpanKind.CONSUMER,
        ):
            pass
    finally:
        await producer.stop()

    found = {s.name: s for s in spans.get_finished_spans()}
    ingest, scheduler, worker = found["ingest"], found["scheduler"], found["worker"]
    assert len({ingest.context.trace_id, scheduler.context.trace_id,
                worker.context.trace_id}) == 1
    assert ingest.parent is None
    assert scheduler.parent is not None and scheduler.parent.is_remote
    assert scheduler.parent.span_id == ingest.context.span_id
    assert worker.parent is not None and worker.parent.span_id == scheduler.context.span_id
