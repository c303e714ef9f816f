"""The health service's figures onto the shared families of :mod:`services.common.metrics`:
readiness, registry errors, skipped records, the fleet by state with each worker's KV
utilisation (from the last tick's snapshot, :class:`~services.common.metrics.FleetCollector`),
and consumer lag per topic and group. Served on 127.0.0.1 when ``LLMQ_METRICS_PORT`` is set
(:func:`services.common.metrics.serve`, the health families only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry

from services.common import metrics as m
from services.common.metrics import FleetRow
from services.health.core import WORKER_STATES
from services.health.lag import TopicFigures

#: What the gauges show of one worker.
WorkerGauge = FleetRow


class HealthMetrics:
    """The service's series; ``registry`` is the process registry (for tests to read)."""

    def __init__(self) -> None:
        self.registry: CollectorRegistry = m.REGISTRY
        self.ready = m.HEALTH_READY
        self.registry_errors = m.HEALTH_REGISTRY_ERRORS
        self.bad_records = m.HEALTH_BAD_RECORDS
        self._lag_series: set[tuple[str, str]] = set()

    def observe(self, rows: Sequence[WorkerGauge]) -> None:
        """Swap in the fleet of this tick."""
        m.HEALTH_FLEET.observe(WORKER_STATES, rows)

    def lag(self, figures: Iterable[TopicFigures]) -> None:
        """Consumer lag of each topic's owning group (per slot group on the assignments
        topic); series of groups that own nothing any more are removed."""
        seen: set[tuple[str, str]] = set()
        for fig in figures:
            if fig.slots:
                for slot in fig.slots:
                    seen.add((fig.topic, slot.group))
                    m.CONSUMER_LAG.labels(topic=fig.topic, group=slot.group).set(slot.lag)
            elif fig.group is not None and fig.lag is not None:
                seen.add((fig.topic, fig.group))
                m.CONSUMER_LAG.labels(topic=fig.topic, group=fig.group).set(fig.lag)
        for topic, group in self._lag_series - seen:
            m.CONSUMER_LAG.remove(topic, group)
        self._lag_series = seen

    @staticmethod
    def serve(port: int) -> None:
        """Expose the health families on http://127.0.0.1:<port>/metrics (loopback only)."""
        m.serve(port, "health")
