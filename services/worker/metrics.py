"""Prometheus metrics of one worker (served on 127.0.0.1 when LLMQ_METRICS_PORT is set).

A private registry per worker, so that several workers in one process (tests) do not
collide. The observability issue extends these; names follow ``llmq_worker_*``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from services.worker.core.heartbeat import HeartbeatFields


class WorkerMetrics:
    """Gauges of the last heartbeat, counters of tokens and request outcomes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.kv_used_tokens = Gauge("llmq_worker_kv_used_tokens", "KV tokens in use.",
                                    registry=r)
        self.kv_total_tokens = Gauge("llmq_worker_kv_total_tokens", "Usable KV tokens.",
                                     registry=r)
        self.running = Gauge("llmq_worker_running", "Sequences in the batch.", registry=r)
        self.waiting = Gauge("llmq_worker_waiting", "Sequences waiting.", registry=r)
        self.draining = Gauge("llmq_worker_draining", "1 while draining.", registry=r)
        self.tokens = Counter("llmq_worker_tokens", "Tokens streamed.", registry=r)
        self.requests = Counter("llmq_worker_requests", "Assignments by outcome.",
                                ["outcome"], registry=r)

    def serve(self, port: int) -> None:
        """Expose the registry on http://127.0.0.1:<port>/metrics (loopback only)."""
        start_http_server(port, addr="127.0.0.1", registry=self.registry)

    def observe(self, fields: HeartbeatFields, draining: bool) -> None:
        self.kv_total_tokens.set(fields.kv_total_tokens)
        self.kv_used_tokens.set(fields.kv_total_tokens - fields.kv_free_tokens)
        self.running.set(fields.running)
        self.waiting.set(fields.waiting)
        self.draining.set(1 if draining else 0)
