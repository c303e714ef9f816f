"""The scheduler's figures onto the shared families of :mod:`services.common.metrics`.

:class:`SchedulerMetrics` turns what the dispatch loop learns — a :class:`TickResult`, the
queue depth, the reservations per worker, the terminals the scheduler sent itself — into
the process registry; ``__main__`` serves it on ``127.0.0.1:<LLMQ_METRICS_PORT>``
(:func:`services.common.metrics.serve`, the scheduler's families only).

Per-worker series (``llmq_reserved_kv_tokens``) are removed when the worker is neither in
the fleet view nor holds bookings, so a departed worker stops being reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from itertools import product
from typing import get_args

from schemas.common import LANES, ErrorCode, Lane, Priority
from services.common import metrics as m
from services.scheduler.runtime.results import TickResult

_CLASSES = tuple(product(get_args(Priority), get_args(Lane)))


class SchedulerMetrics:
    """Records the scheduler's figures (module docstring); one per scheduler."""

    def __init__(self) -> None:
        self._ended: dict[ErrorCode, int] = {}
        self._requeued = 0
        self._reserved_workers: set[str] = set()

    @staticmethod
    def serve(port: int) -> None:
        m.serve(port, "scheduler")

    def tick(self, result: TickResult) -> None:
        """One dispatch cycle: decision latency, placements, failures, losses."""
        m.SCHEDULE_DECISION.observe(result.schedule_s)
        for placed in result.placements:
            if placed.phase == "decode":  # its request was counted at its prefill stage
                m.DECODE_STAGES.labels(worker=placed.worker_id, lane=placed.lane).inc()
                m.HANDOFF_WAIT.labels(lane=placed.lane).observe(placed.waited_s)
                continue
            m.PLACEMENTS.labels(worker=placed.worker_id, lane=placed.lane).inc()
            m.QUEUE_WAIT.labels(priority=placed.priority, lane=placed.lane).observe(
                placed.waited_s
            )
        for reason, n in result.deferred.items():
            m.PLACEMENT_FAILURES.labels(reason=reason).inc(n)
        if result.lost_workers:
            m.WORKER_LOSSES.inc(len(result.lost_workers))
        if result.restarted_workers:
            m.WORKER_RESTARTS.inc(len(result.restarted_workers))
        for _, granted in result.leases:
            m.LEASE_ANSWERS.labels(answer="granted" if granted else "refused").inc()

    def ended(self, totals: Mapping[ErrorCode, int], requeued: int = 0) -> None:
        """The cumulative counts of terminals the scheduler sent, by code, and of requeues
        done: adds what is new (they also happen outside a cycle: a cancel before queueing,
        a requeue once its reply-topic check is back). A total that went down (an ending
        taken back, or found answered by its worker) leaves the counter as it is, and the
        next endings of that code are not counted until the total passes its highest
        again: a Prometheus counter cannot go down, and counting from the lower total
        counted the same ending twice."""
        for code, total in totals.items():
            new = total - self._ended.get(code, 0)
            if new > 0:
                m.REQUESTS.labels(outcome=code).inc(new)
                self._ended[code] = total
        if requeued > self._requeued:
            m.REQUEUES.inc(requeued - self._requeued)
            self._requeued = requeued

    @staticmethod
    def set_depth(depth: Mapping[tuple[Priority, Lane], int]) -> None:
        # Every class, so that one that emptied shows 0 rather than its last depth.
        for priority, lane in _CLASSES:
            m.QUEUE_DEPTH.labels(priority=priority, lane=lane).set(depth.get((priority, lane), 0))

    @staticmethod
    def forget_workers(worker_ids: Iterable[str]) -> None:
        """Drop the per-worker series of workers the fleet view forgot (they left)."""
        for worker_id in worker_ids:
            for lane in LANES:
                for counter in (m.PLACEMENTS, m.DECODE_STAGES):
                    with contextlib.suppress(KeyError):
                        counter.remove(worker_id, lane)

    def set_reserved(self, reserved: Mapping[str, int]) -> None:
        for worker, tokens in reserved.items():
            m.RESERVED_KV.labels(worker=worker).set(tokens)
        for gone in self._reserved_workers - reserved.keys():
            m.RESERVED_KV.remove(gone)
        self._reserved_workers = set(reserved)

    @staticmethod
    def plumbing(paused_topics: int, outbox: int, send_failures: int,
                 given_up: int = 0) -> None:
        m.PAUSED_TOPICS.set(paused_topics)
        m.OUTBOX_EFFECTS.set(outbox)
        if send_failures:
            m.SEND_FAILURES.inc(send_failures)
        if given_up:
            m.REPLIES_GIVEN_UP.inc(given_up)
