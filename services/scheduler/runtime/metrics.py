"""Prometheus metrics of the scheduler (the basics; the observability issue extends them).

Served on ``127.0.0.1:<LLMQ_METRICS_PORT>`` when that is set. Own registry, so building
the metrics twice in one process (tests) never collides.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from schemas.common import ErrorCode, Lane, Priority


class SchedulerMetrics:
    """Queue depth, placements, rejections, requeues, decision latency, outbox health."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "llmq_scheduler_queue_depth", "Requests in the pending queue.",
            ["priority", "lane"], registry=r,
        )
        self.placements = Counter(
            "llmq_scheduler_placements_total", "Assignments decided.", registry=r
        )
        self.rejections = Counter(
            "llmq_scheduler_rejections_total", "Requests ended by the scheduler.",
            ["code"], registry=r,
        )
        self.requeues = Counter(
            "llmq_scheduler_requeues_total", "Requests requeued after a worker loss.",
            registry=r,
        )
        self.workers_lost = Counter(
            "llmq_scheduler_workers_lost_total", "Workers declared dead with work.", registry=r
        )
        self.decision_seconds = Histogram(
            "llmq_schedule_decision_seconds", "Duration of one schedule() call.",
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0),
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "llmq_scheduler_queue_wait_seconds",
            "From admission to the worker's started event.",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.paused_topics = Gauge(
            "llmq_scheduler_paused_topics", "Request topics paused for backpressure.",
            registry=r,
        )
        self.outbox = Gauge(
            "llmq_scheduler_outbox_effects", "Effects waiting for the broker.", registry=r
        )
        self.send_failures = Counter(
            "llmq_scheduler_send_failures_total", "Records resent after a failed send.",
            registry=r,
        )

    def serve(self, port: int) -> None:
        start_http_server(port, addr="127.0.0.1", registry=self.registry)

    def set_depth(self, depth: Mapping[tuple[Priority, Lane], int]) -> None:
        for (priority, lane), n in depth.items():
            self.queue_depth.labels(priority=priority, lane=lane).set(n)

    def rejected(self, counts: Mapping[ErrorCode, int]) -> None:
        for code, n in counts.items():
            self.rejections.labels(code=code).inc(n)
