"""Prometheus metrics of the health service (served on 127.0.0.1 when LLMQ_METRICS_PORT is
set): the fleet by state and each worker's KV utilisation, from the last tick's snapshot.

The per-worker series come from a collector that reads an immutable snapshot swapped in
by the tick, so the scrape thread never reads the tracker while the event loop writes it,
and a worker that is gone simply stops being reported (no stale label sets).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.health.core import WORKER_STATES, WorkerState
from services.health.settings import BIND_HOST


@dataclass(frozen=True, slots=True)
class WorkerGauge:
    """What the gauges show of one worker."""

    worker_id: str
    model: str
    pool: str
    state: WorkerState
    kv_utilisation: float
    running: int
    waiting: int


class _FleetCollector(Collector):
    def __init__(self, metrics: HealthMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[GaugeMetricFamily]:
        rows = self._metrics.snapshot
        by_state = GaugeMetricFamily(
            "llmq_health_workers", "Workers by state (up, draining, stale, gone).",
            labels=["state"],
        )
        for state in WORKER_STATES:
            by_state.add_metric([state], sum(1 for r in rows if r.state == state))
        labels = ["worker_id", "model", "pool", "state"]
        kv = GaugeMetricFamily(
            "llmq_health_worker_kv_utilisation",
            "KV-cache in use / usable, from the worker's last heartbeat (0 without KV).",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "llmq_health_worker_running", "Sequences running, last heartbeat.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "llmq_health_worker_waiting", "Sequences waiting, last heartbeat.", labels=labels
        )
        for r in rows:
            if r.state == "gone":
                continue
            values = [r.worker_id, r.model, r.pool, r.state]
            kv.add_metric(values, r.kv_utilisation)
            running.add_metric(values, r.running)
            waiting.add_metric(values, r.waiting)
        return [by_state, kv, running, waiting]


class HealthMetrics:
    """The service's registry: fleet gauges, readiness, registry errors."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.snapshot: tuple[WorkerGauge, ...] = ()
        self.ready = Gauge("llmq_health_ready", "1 when /readyz answers 200.",
                           registry=self.registry)
        self.registry_errors = Counter(
            "llmq_health_registry_errors", "Failed calls to the registry (Consul).",
            registry=self.registry,
        )
        self.bad_records = Gauge(
            "llmq_health_bad_records", "Undecodable records skipped since start.",
            registry=self.registry,
        )
        self.registry.register(_FleetCollector(self))

    def observe(self, rows: Sequence[WorkerGauge]) -> None:
        """Swap in the fleet of this tick (one reference assignment: atomic for readers)."""
        self.snapshot = tuple(rows)

    def serve(self, port: int) -> None:
        """Expose the registry on http://127.0.0.1:<port>/metrics (loopback only)."""
        start_http_server(port, addr=BIND_HOST, registry=self.registry)
