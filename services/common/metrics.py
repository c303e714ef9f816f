"""Every Prometheus metric family of llmq, defined once; each service uses what it owns.

Names follow Prometheus conventions (``_seconds``, ``_bytes``, ``_total``); label sets are
small and bounded (priority, lane, outcome, code, worker, topic, tenant). Latency
histograms use :data:`LATENCY_BUCKETS`, chosen for LLM serving: from 5 ms (a cached short
completion's first token) to 20 minutes (a long document behind a backlog). Decision
latency uses :data:`DECISION_BUCKETS` (1 µs .. 100 ms).

A service exposes the registry with :func:`serve`, bound to 127.0.0.1 only, on the port in
``LLMQ_METRICS_PORT`` (read by the service's ``main``). Every family lives in the one
:data:`REGISTRY` (tests read it with ``REGISTRY.get_sample_value``), but a service's
endpoint shows only the families it owns (:data:`OWNED`): an unlabelled family such as
``llmq_requeues_total`` or ``llmq_health_ready`` would otherwise be exported as a constant
0 by every process, and a dashboard summing or alerting on it would be misled.

Which process measures what: ingest counts refusals (``llmq_requests_total`` and
``llmq_rejections_total``) and admitted tokens; the scheduler the queue, its decisions and
the terminals it sends itself (queue timeouts, cancels while pending, worker_lost); workers
their capacity, tokens, TTFT and end-to-end latency and the terminals they send; health the
fleet as heartbeats show it and consumer lag. ``llmq_requests_total`` is counted where the
one terminal reply of a request is sent, so its sum over services counts each request once.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0, 600.0, 1200.0,
)
DECISION_BUCKETS: Final = (
    1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2, 0.1,
)

REGISTRY: Final = CollectorRegistry(auto_describe=True)

# -- queue and scheduling (scheduler) -----------------------------------------------------
QUEUE_DEPTH: Final = Gauge(
    "llmq_queue_depth", "Requests waiting in the pending queue.", ["priority", "lane"],
    registry=REGISTRY,
)
QUEUE_WAIT: Final = Histogram(
    "llmq_queue_wait_seconds", "Time from admission to placement.", ["priority", "lane"],
    buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
SCHEDULE_DECISION: Final = Histogram(
    "llmq_schedule_decision_seconds", "Wall time of one schedule() call.",
    buckets=DECISION_BUCKETS, registry=REGISTRY,
)
PLACEMENTS: Final = Counter(
    "llmq_placements_total", "Requests placed on a worker.", ["worker", "lane"],
    registry=REGISTRY,
)
DECODE_STAGES: Final = Counter(
    "llmq_decode_stages_total",
    "Decode stages (prefill and decode apart) placed on a worker; their requests count once "
    "in llmq_placements_total, on the prefill worker.", ["worker", "lane"], registry=REGISTRY,
)
HANDOFF_WAIT: Final = Histogram(
    "llmq_handoff_wait_seconds",
    "Time from a prefill stage's hand-off (event.prefilled read) to its decode stage's "
    "placement.", ["lane"], buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
PLACEMENT_FAILURES: Final = Counter(
    "llmq_placement_failures_total", "Scheduling cycles that could not place a queue head.",
    ["reason"], registry=REGISTRY,
)
REQUEUES: Final = Counter(
    "llmq_requeues_total", "Requests requeued after their worker was lost.", registry=REGISTRY,
)
WORKER_LOSSES: Final = Counter(
    "llmq_worker_losses_total", "Workers declared dead (stale heartbeat).", registry=REGISTRY,
)
WORKER_RESTARTS: Final = Counter(
    "llmq_worker_restarts_total",
    "Workers seen restarted while work placed on their earlier process was active.",
    registry=REGISTRY,
)
RESERVED_KV: Final = Gauge(
    "llmq_reserved_kv_tokens", "KV tokens reserved on a worker by the scheduler.", ["worker"],
    registry=REGISTRY,
)
PAUSED_TOPICS: Final = Gauge(
    "llmq_scheduler_paused_topics", "Request topics paused for backpressure.",
    registry=REGISTRY,
)
OUTBOX_EFFECTS: Final = Gauge(
    "llmq_scheduler_outbox_effects", "Scheduler effects waiting for the broker's ack.",
    registry=REGISTRY,
)
SEND_FAILURES: Final = Counter(
    "llmq_scheduler_send_failures_total", "Scheduler records resent after a failed send.",
    registry=REGISTRY,
)
REPLIES_GIVEN_UP: Final = Counter(
    "llmq_scheduler_replies_given_up_total",
    "Scheduler records to a client's reply topic given up (the topic could not be created, "
    "refused them, or they did not get through in LLMQ_SCHEDULER_REPLY_GIVE_UP_S); the "
    "terminal event that follows still goes.",
    registry=REGISTRY,
)

# -- requests (ingest and workers) ----------------------------------------------------------
REQUESTS: Final = Counter(
    "llmq_requests_total", "Requests by terminal outcome (done or an error code).",
    ["outcome"], registry=REGISTRY,
)
HTTP_RESPONSES: Final = Counter(
    "llmq_http_responses_total",
    "Completion calls to ingest's OpenAI-compatible API, by the HTTP status answered: its "
    "own refusals before anything is queued (400, 401, 409, 413, 503: Kafka out of reach) "
    "too, which no other counter sees; 499: the caller left.", ["status"],
    registry=REGISTRY,
)
REJECTIONS: Final = Counter(
    "llmq_rejections_total", "Requests refused at admission, by code.", ["code"],
    registry=REGISTRY,
)
ADMITTED_TOKENS: Final = Counter(
    "llmq_admitted_tokens_total",
    "Tokens (prompt + max_tokens) admitted, by tenant (tenants not in the tenants file: other).",
    ["tenant"], registry=REGISTRY,
)
TTFT: Final = Histogram(
    "llmq_time_to_first_token_seconds", "From submission to the first generated token.",
    ["priority", "lane"], buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
E2E: Final = Histogram(
    "llmq_request_duration_seconds", "From submission to the terminal reply.",
    ["priority", "lane"], buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
GENERATED_TOKENS: Final = Counter(
    "llmq_generated_tokens_total", "Tokens generated by a worker.", ["worker"],
    registry=REGISTRY,
)

# -- workers ----------------------------------------------------------------------------------
KV_UTILIZATION: Final = Gauge(
    "llmq_worker_kv_utilization_ratio", "Used / total KV cache of a worker.", ["worker"],
    registry=REGISTRY,
)
RUNNING: Final = Gauge(
    "llmq_worker_running_sequences", "Sequences in a worker's running batch.", ["worker"],
    registry=REGISTRY,
)
WAITING: Final = Gauge(
    "llmq_worker_waiting_sequences", "Sequences accepted by a worker but not running.",
    ["worker"], registry=REGISTRY,
)
VRAM_USED: Final = Gauge(
    "llmq_worker_vram_used_bytes", "GPU memory in use.", ["worker"], registry=REGISTRY,
)
VRAM_TOTAL: Final = Gauge(
    "llmq_worker_vram_total_bytes", "GPU memory of the worker's device(s).", ["worker"],
    registry=REGISTRY,
)
GPU_UTILIZATION: Final = Gauge(
    "llmq_worker_gpu_utilization_ratio", "GPU utilisation (NVML), where a GPU exists.",
    ["worker"], registry=REGISTRY,
)
KV_TOTAL_TOKENS: Final = Gauge(
    "llmq_worker_kv_total_tokens", "Usable KV cache of a worker, in tokens (compare with "
    "llmq_reserved_kv_tokens).", ["worker"], registry=REGISTRY,
)
DRAINING: Final = Gauge(
    "llmq_worker_draining", "1 while the worker drains (takes no new work).", ["worker"],
    registry=REGISTRY,
)
FENCES: Final = Counter(
    "llmq_worker_fences_total",
    "Times a worker fenced itself: its lease lapsed (no acknowledged heartbeat for "
    "lease_beats intervals), so its runs ended unanswered for the scheduler to requeue.",
    ["worker"], registry=REGISTRY,
)
LEASE_RENEWALS: Final = Counter(
    "llmq_worker_lease_renewals_total",
    "Lapsed leases a worker asked the scheduler to renew, by how the asking ended: granted "
    "(runs went on), revoked or unanswered (the worker fenced).",
    ["worker", "outcome"], registry=REGISTRY,
)
LEASE_ANSWERS: Final = Counter(
    "llmq_lease_answers_total",
    "The scheduler's answers to workers asking to renew a lapsed lease.",
    ["answer"], registry=REGISTRY,
)

# -- Kafka plumbing ---------------------------------------------------------------------------
CONSUMER_LAG: Final = Gauge(
    "llmq_consumer_lag_records", "Records behind the end of a topic, per consumer group.",
    ["topic", "group"], registry=REGISTRY,
)
DEAD_LETTERS: Final = Counter(
    "llmq_dead_letters_total", "Records sent to the dead-letter topic.", ["source"],
    registry=REGISTRY,
)

# -- health -----------------------------------------------------------------------------------
HEALTH_READY: Final = Gauge(
    "llmq_health_ready", "1 when the health service's /readyz answers 200.", registry=REGISTRY,
)
HEALTH_REGISTRY_ERRORS: Final = Counter(
    "llmq_health_registry_errors", "Failed calls to the service registry (Consul).",
    registry=REGISTRY,
)
HEALTH_BAD_RECORDS: Final = Gauge(
    "llmq_health_bad_records", "Undecodable heartbeat records skipped since start.",
    registry=REGISTRY,
)


@dataclass(frozen=True, slots=True)
class FleetRow:
    """One worker as the health service's gauges show it (its last heartbeat)."""

    worker_id: str
    model: str
    pool: str
    state: str
    kv_utilisation: float
    running: int
    waiting: int


class FleetCollector(Collector):
    """The fleet as the health service sees it, from a snapshot the tick swaps in whole.

    The scrape thread reads one immutable tuple while the event loop replaces it, so it
    never reads a half-updated tracker; a worker that is gone stops being reported (no
    stale label sets, which plain labelled gauges would keep).
    """

    def __init__(self) -> None:
        self._snapshot: tuple[tuple[str, ...], tuple[FleetRow, ...]] = ((), ())

    def observe(self, states: Sequence[str], rows: Iterable[FleetRow]) -> None:
        """Swap in the fleet of this tick (one reference assignment: atomic for readers)."""
        self._snapshot = (tuple(states), tuple(rows))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        states, rows = self._snapshot
        by_state = GaugeMetricFamily(
            "llmq_health_workers", "Workers by state (up, draining, stale, gone).",
            labels=["state"],
        )
        for state in states:
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
        yield from (by_state, kv, running, waiting)


HEALTH_FLEET: Final = FleetCollector()
REGISTRY.register(HEALTH_FLEET)

#: The families each service's endpoint shows (module docstring).
OWNED: Final[dict[str, tuple[MetricWrapperBase | Collector, ...]]] = {
    "ingest": (REQUESTS, REJECTIONS, ADMITTED_TOKENS, HTTP_RESPONSES, DEAD_LETTERS),
    "scheduler": (
        QUEUE_DEPTH, QUEUE_WAIT, SCHEDULE_DECISION, PLACEMENTS, DECODE_STAGES, HANDOFF_WAIT,
        PLACEMENT_FAILURES, REQUEUES,
        WORKER_LOSSES, WORKER_RESTARTS, LEASE_ANSWERS, RESERVED_KV, PAUSED_TOPICS,
        OUTBOX_EFFECTS, SEND_FAILURES, REPLIES_GIVEN_UP, REQUESTS, DEAD_LETTERS,
    ),
    "worker": (
        REQUESTS, TTFT, E2E, GENERATED_TOKENS, KV_UTILIZATION, KV_TOTAL_TOKENS, RUNNING,
        WAITING, VRAM_USED, VRAM_TOTAL, GPU_UTILIZATION, DRAINING, FENCES, LEASE_RENEWALS,
        DEAD_LETTERS,
    ),
    "health": (
        CONSUMER_LAG, HEALTH_READY, HEALTH_REGISTRY_ERRORS, HEALTH_BAD_RECORDS, HEALTH_FLEET,
        DEAD_LETTERS,
    ),
}


class _Only(Collector):
    """The families of :data:`REGISTRY` named in ``names``, read at scrape time."""

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if family.name in self._names:
                yield family


def family_names(service: str) -> frozenset[str]:
    """Family names (as ``collect()`` names them, without ``_total``) ``service`` shows."""
    names: set[str] = set()
    for owned in OWNED[service]:
        names.update(f.name for f in owned.collect())
    return frozenset(names)


def view(service: str | None = None) -> CollectorRegistry:
    """A registry to serve: :data:`REGISTRY` itself, or only ``service``'s families."""
    if service is None:
        return REGISTRY
    restricted = CollectorRegistry(auto_describe=False)
    restricted.register(_Only(family_names(service)))
    return restricted


def serve(port: int, service: str | None = None) -> None:
    """Expose :data:`REGISTRY` (or ``service``'s families of it, :data:`OWNED`) on
    http://127.0.0.1:<port>/metrics — never beyond loopback."""
    start_http_server(port, addr="127.0.0.1", registry=view(service))


async def serve_when_free(serve: Callable[[int], None], port: int, wait_s: float = 15.0,
                          retry_s: float = 0.25) -> None:
    """``serve(port)``; while the port is taken, try again for up to ``wait_s``, then raise
    an OSError that names the setting to change."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            serve(port)
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise OSError(exc.errno, f"metrics port 127.0.0.1:{port} is taken "
                              "(LLMQ_METRICS_PORT): stop what holds it or pick another "
                              "port") from exc
            await asyncio.sleep(retry_s)
