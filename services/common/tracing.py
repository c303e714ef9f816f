"""OpenTelemetry tracing for llmq: one provider per process, W3C context in Kafka headers.

- :func:`setup` installs this process's ``TracerProvider`` named after the service,
  sampling ``ParentBased(TraceIdRatioBased(ratio))`` (the root — ingest — decides; every
  later hop follows the ``sampled`` flag it receives), exporting OTLP/HTTP to ``endpoint``
  (Jaeger's collector on 127.0.0.1:4318 with ``llmq dev jaeger up``) in batches. With
  ``endpoint=None`` (``LLMQ_OTLP_ENDPOINT`` unset) no SDK provider exists at all: the API's
  no-op tracer hands back the parent's span, so spans cost a function call, nothing is
  recorded or exported, and the incoming ``traceparent`` still passes through untouched
  (a hop with tracing off does not cut the trace of hops that have it on).
- :func:`inject` / :func:`extract` carry the W3C ``traceparent``/``tracestate`` in Kafka
  record headers (a list of ``(str, bytes)`` pairs, as aiokafka and faust use), so one
  request is one trace across ingest → scheduler → worker → reply.
- :func:`record_span` writes a span whose start and end are already known (the
  scheduler's queue wait, which starts long before anyone could hold a span open).

The provider is kept here rather than installed as OTel's global one: the global can be
set only once per process, and tests install a fresh provider (in-memory exporter) per
test. llmq's own code asks :func:`tracer` for its tracers, at span time.

Span attributes follow the GenAI semantic conventions where they apply
(``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``)
plus llmq's own under ``llmq.*`` (tenant, priority, lane, worker, attempt, outcome).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Headers = list[tuple[str, bytes]]
Context = otel_context.Context

_PROPAGATOR = TraceContextTextMapPropagator()
_NOOP_TRACER = trace.NoOpTracer()
#: One export's time, retries included. The queue is flushed at exit, a batch at a time:
#: with 5 s, a process whose collector was down took 12 s to exit with 2,048 spans queued,
#: most of the stack's grace before SIGKILL (found by an audit). The collector is local.
_EXPORT_TIMEOUT_S = 2.0

# GenAI semantic-convention attribute names (OpenTelemetry semconv, gen_ai.*).
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_RESPONSE_FINISH = "gen_ai.response.finish_reasons"

# llmq's own attributes.
LLMQ_REQUEST_ID = "llmq.request_id"
LLMQ_TENANT = "llmq.tenant"
LLMQ_PRIORITY = "llmq.priority"
LLMQ_LANE = "llmq.lane"
LLMQ_WORKER = "llmq.worker"
LLMQ_ATTEMPT = "llmq.attempt"
LLMQ_OUTCOME = "llmq.outcome"

#: Name of the span event a worker adds when the first token is generated.
FIRST_TOKEN_EVENT = "gen_ai.first_token"


class _HeaderGetter(Getter[Sequence[tuple[str, bytes]]]):
    def get(self, carrier: Sequence[tuple[str, bytes]], key: str) -> list[str] | None:
        found = [v.decode("latin-1") for k, v in carrier if k.lower() == key and v is not None]
        return found or None

    def keys(self, carrier: Sequence[tuple[str, bytes]]) -> list[str]:
        return [k for k, _ in carrier]


class _HeaderSetter(Setter[Headers]):
    def set(self, carrier: Headers, key: str, value: str) -> None:
        carrier[:] = [(k, v) for k, v in carrier if k != key]
        carrier.append((key, value.encode("latin-1")))


_GETTER = _HeaderGetter()
_SETTER = _HeaderSetter()


class _State:
    """The process's provider and its tracers by name (one process, one provider)."""

    provider: ClassVar[TracerProvider | None] = None
    tracers: ClassVar[dict[str, trace.Tracer]] = {}
    ratio: ClassVar[float] = 1.0


def setup(
    service: str,
    endpoint: str | None,
    ratio: float = 1.0,
    extra_processors: Iterable[SpanProcessor] = (),
) -> TracerProvider | None:
    """Install this process's tracer provider and return it; None when tracing is off
    (no ``endpoint`` and no ``extra_processors``). Replaces an earlier one (tests)."""
    processors = list(extra_processors)
    _State.ratio = ratio
    if not endpoint and not processors:
        _install(None)
        return None
    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "service.namespace": "llmq"}),
        sampler=ParentBased(TraceIdRatioBased(ratio)),
    )
    if endpoint:
        # Imported here: the exporter pulls in requests/protobuf, unneeded without it.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=_EXPORT_TIMEOUT_S))
        )
    for processor in processors:
        provider.add_span_processor(processor)
    _install(provider)
    return provider


def _install(provider: TracerProvider | None) -> None:
    previous = _State.provider
    _State.provider = provider
    _State.tracers = {}
    if previous is not None and previous is not provider:
        previous.shutdown()


def enabled() -> bool:
    """True when spans are recorded (a provider is installed)."""
    return _State.provider is not None


def shutdown() -> None:
    """Flush what is buffered and stop exporting (the provider also does it at exit)."""
    _install(None)


def tracer(name: str) -> trace.Tracer:
    """The tracer ``name`` of this process's provider (the no-op tracer when off)."""
    provider = _State.provider
    if provider is None:
        return _NOOP_TRACER
    found = _State.tracers.get(name)
    if found is None:
        found = _State.tracers[name] = provider.get_tracer(name)
    return found


def inject(headers: Sequence[tuple[str, bytes]] | None = None,
           ctx: Context | None = None) -> Headers:
    """A new header list: ``headers`` plus the current (or ``ctx``'s) trace context."""
    carrier: Headers = list(headers or [])
    _PROPAGATOR.inject(carrier, context=ctx, setter=_SETTER)
    return carrier


def sampled_by_us(caller: Context) -> Context:
    """``caller``'s trace context (an untrusted one: an HTTP caller's ``traceparent``) with
    the sampling decided here, at the configured ratio, instead of by its sampled flag:
    the trace goes on under the caller's ids, but with a sampler that follows the parent,
    any caller (one without an API key too) could otherwise make every hop record and
    export its calls at a ratio of 0, or turn them off. An empty context if it has none."""
    theirs = trace.get_current_span(caller).get_span_context()
    if not theirs.is_valid:
        return Context()
    flags = trace.TraceFlags(trace.TraceFlags.SAMPLED if random.random() < _State.ratio
                             else trace.TraceFlags.DEFAULT)
    return trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
        theirs.trace_id, theirs.span_id, is_remote=True, trace_flags=flags,
        trace_state=theirs.trace_state)))


def extract(headers: Sequence[tuple[str, bytes]] | Mapping[str, bytes] | None) -> Context:
    """The trace context a record's headers carry (an empty context when none)."""
    if not headers:
        return Context()
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    return _PROPAGATOR.extract(pairs, getter=_GETTER)


def headers_of(record: Any) -> Headers:
    """A consumed record's headers (aiokafka ``ConsumerRecord``, faust ``Message``) as a
    list of ``(str, bytes)``; [] for records without any (and for test doubles)."""
    raw = getattr(record, "headers", None)
    if not raw:
        return []
    pairs = raw.items() if isinstance(raw, Mapping) else raw
    return [(str(k), bytes(v) if v is not None else b"") for k, v in pairs]


def record_span(
    name: str,
    parent: Context,
    start: float,
    end: float,
    attributes: Mapping[str, Any] | None = None,
    *,
    tracer_name: str = "llmq",
) -> Context:
    """Write a finished span that ran from ``start`` to ``end`` (epoch seconds) under
    ``parent``; returns a context carrying it (to inject, or to parent the next span)."""
    span = tracer(tracer_name).start_span(
        name, context=parent, attributes=request_attributes(**dict(attributes or {})),
        start_time=int(start * 1e9),
    )
    span.end(end_time=int(max(start, end) * 1e9))
    return trace.set_span_in_context(span, parent)


def request_attributes(**values: Any) -> dict[str, Any]:
    """Span attributes without the Nones (OTel rejects None values)."""
    return {k: v for k, v in values.items() if v is not None}


class HeaderSpans:
    """Finished spans between header-carried contexts: ``span`` writes one under the
    context ``parent`` carries and returns headers carrying it (``parent`` unchanged while
    tracing is off). Fits the scheduler's ``SpanRecorder``, which knows no OTel."""

    def __init__(self, tracer_name: str) -> None:
        self._tracer_name = tracer_name

    @property
    def active(self) -> bool:
        return enabled()

    def span(
        self, name: str, parent: Sequence[tuple[str, bytes]], start: float, end: float,
        attributes: Mapping[str, str | int | float],
    ) -> tuple[tuple[str, bytes], ...]:
        if not enabled():
            return tuple(parent)
        ctx = record_span(name, extract(parent), start, end, attributes,
                          tracer_name=self._tracer_name)
        return tuple(inject(ctx=ctx))
