"""One worker's figures onto the shared families of :mod:`services.common.metrics`.

Every series is labelled with the worker id (several workers may share a process in
tests); latency histograms with the request's priority and lane. Served on 127.0.0.1 when
``LLMQ_METRICS_PORT`` is set (:func:`services.common.metrics.serve`, worker families only).

- capacity, from each heartbeat's fields: KV utilisation and usable KV, running and
  waiting sequences, draining; VRAM and GPU utilisation only where the worker reports a
  device (a sim or remote engine reports none, and a 0 would read as "idle GPU");
- per request: generated tokens, TTFT at the first token, end-to-end latency and
  ``llmq_requests_total{outcome}`` at the terminal this worker sends (both measured from
  the request's ``created_at``, the client's submission).
"""

from __future__ import annotations

from schemas.common import Lane, Priority
from services.common import metrics as m
from services.worker.core.heartbeat import HeartbeatFields


class WorkerMetrics:
    """The series of one worker (module docstring)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        label = {"worker": worker_id}
        self._kv_util = m.KV_UTILIZATION.labels(**label)
        self._kv_total = m.KV_TOTAL_TOKENS.labels(**label)
        self._running = m.RUNNING.labels(**label)
        self._waiting = m.WAITING.labels(**label)
        self._draining = m.DRAINING.labels(**label)
        self._tokens = m.GENERATED_TOKENS.labels(**label)
        self._fences = m.FENCES.labels(**label)

    @staticmethod
    def serve(port: int) -> None:
        """Expose the worker families on http://127.0.0.1:<port>/metrics (loopback only)."""
        m.serve(port, "worker")

    def observe(self, fields: HeartbeatFields, draining: bool) -> None:
        """The load of the heartbeat just built."""
        total = fields.kv_total_tokens
        self._kv_total.set(total)
        self._kv_util.set((total - fields.kv_free_tokens) / total if total else 0.0)
        self._running.set(fields.running)
        self._waiting.set(fields.waiting)
        self._draining.set(1 if draining else 0)
        if fields.vram_total_bytes > 0:
            m.VRAM_TOTAL.labels(worker=self.worker_id).set(fields.vram_total_bytes)
            m.VRAM_USED.labels(worker=self.worker_id).set(fields.vram_used_bytes)
        if fields.gpu_util is not None:
            m.GPU_UTILIZATION.labels(worker=self.worker_id).set(fields.gpu_util)

    def fenced(self) -> None:
        self._fences.inc()

    def lease_asked(self, outcome: str) -> None:
        """How an asked renewal ended: granted, revoked or unanswered."""
        m.LEASE_RENEWALS.labels(worker=self.worker_id, outcome=outcome).inc()

    def tokens(self, n: int) -> None:
        self._tokens.inc(n)

    @staticmethod
    def first_token(priority: Priority, lane: Lane, ttft_s: float) -> None:
        m.TTFT.labels(priority=priority, lane=lane).observe(ttft_s)

    @staticmethod
    def finished(outcome: str, priority: Priority, lane: Lane, e2e_s: float | None) -> None:
        """A terminal this worker sent: ``done`` or the error code."""
        m.REQUESTS.labels(outcome=outcome).inc()
        if e2e_s is not None:
            m.E2E.labels(priority=priority, lane=lane).observe(e2e_s)
