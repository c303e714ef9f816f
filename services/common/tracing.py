"""OpenTelemetry tracing for llmq: one provider per process, W3C context in Kafka headers.

- :func:`setup` installs a ``TracerProvider`` named after the service, sampling
  ``ParentBased(TraceIdRatioBased(ratio))`` (a sampled request stays sampled across every
  hop), exporting OTLP/HTTP to ``endpoint`` (Jaeger's collector on 127.0.0.1:4318 by
  default) in batches. With ``endpoint=None`` tracing is a no-op provider: spans cost
  nothing measurable and nothing leaves the process.
- :func:`inject` / :func:`extract` carry the W3C ``traceparent``/``tracestate`` in Kafka
  record headers (a list of ``(str, bytes)`` pairs, as aiokafka and faust use), so one
  request is one trace across ingest → scheduler → worker → reply.

Span attributes follow the GenAI semantic conventions where they apply
(``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``)
plus llmq's own under ``llmq.*`` (tenant, priority, lane, worker, attempt, outcome).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Headers = list[tuple[str, bytes]]

_PROPAGATOR = TraceContextTextMapPropagator()

# GenAI semantic-convention attribute names (OpenTelemetry semconv, gen_ai.*).
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_OPERATION = "gen_ai.operation.name"


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


def setup(
    service: str,
    endpoint: str | None,
    ratio: float = 1.0,
    extra_processors: Iterable[SpanProcessor] = (),
) -> TracerProvider:
    """Install the global tracer provider of this process and return it."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "service.namespace": "llmq"}),
        sampler=ParentBased(TraceIdRatioBased(ratio)),
    )
    if endpoint:
        # Imported here: the exporter pulls in requests/protobuf, unneeded without it.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    for processor in extra_processors:
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: Headers | None = None, ctx: otel_context.Context | None = None) -> Headers:
    """Headers (new list or the given one) carrying the current (or ``ctx``'s) trace."""
    carrier: Headers = list(headers or [])
    _PROPAGATOR.inject(carrier, context=ctx, setter=_SETTER)
    return carrier


def extract(headers: Sequence[tuple[str, bytes]] | None) -> otel_context.Context:
    """The trace context a record's headers carry (an empty context when none)."""
    return _PROPAGATOR.extract(list(headers or []), getter=_GETTER)


def request_attributes(**values: Any) -> dict[str, Any]:
    """Span attributes without the Nones (OTel rejects None values)."""
    return {k: v for k, v in values.items() if v is not None}
