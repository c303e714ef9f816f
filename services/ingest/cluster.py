"""Ingest's view of the fleet: live workers from ``llmq.heartbeats``, queue figures from
``llmq.status``, turned into the core's frozen :class:`ClusterView` on demand.

:class:`ClusterTracker` is plain state (tests drive it synchronously): it keeps the newest
heartbeat per worker (ordered by ``(started_at, seq)``, so a restarted worker's first beat
wins over the old process's last one) and the newest ``QueueStatus`` per (model,
scheduler). :meth:`ClusterTracker.view` applies the rules, failing closed:

- a worker is live when ``now - ts <= staleness × interval_s``, it is not draining, it
  reports a KV budget (``kv_total_tokens > 0``) and its partition is one of the
  assignments topic's (``slots``, as the watcher found them at start; the scheduler
  refuses a worker of any other, so it is no capacity); ``max_usable_kv_tokens`` is the largest
  such budget (its whole capacity, not what is free now), lowered to the schedulers'
  own figure when a fresh status gives one (theirs keeps the KV safety margin, and a
  request ingest admitted past it would only be refused ``too_large`` a round trip
  later); ``block_size`` is the largest of the live workers', as the scheduler rounds;
- over fresh statuses (``now - ts <= status_stale_s``) of every scheduler, queued tokens
  are summed (each replica queues the requests of its own partitions), while running
  tokens and the drain rate are the largest one (every replica reads every assignment
  and terminal event, so each reports the whole fleet's: a sum would count it once per
  replica). No fresh status means no known backlog: the scheduler bounds its own queue,
  and admission still needs a live worker;
- a model none of whose workers is live, but one of which beat within ``model_memory_s``
  (5 min: it drains, restarts or is late), still has a capacity, of no live worker:
  admission answers it 503 with a Retry-After, not 404 ``unknown_model`` (a model the
  registry does not list would else be "unknown" for the seconds of a rolling restart,
  and clients do not retry a 404).

Models are keyed by their canonical registry name when the registry knows them.

:class:`ClusterWatcher` feeds a tracker from both compacted topics through a
:class:`~services.common.log_reader.LogReader` (no group: every instance reads everything
from the beginning). New undecodable records go through the guard to the dead letter
(replayed ones are only logged); a null value (tombstone) removes a worker.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError

from schemas.codec import decode
from schemas.messages import HEARTBEAT_ADAPTER, STATUS_ADAPTER
from schemas.status import QueueStatus
from schemas.workers import WorkerHeartbeat
from services.common.guard import Guard
from services.common.log_reader import LogReader
from services.common.replies import topic_partitions
from services.ingest.core import ClusterView, ModelCapacity, ModelRegistry

_log = logging.getLogger(__name__)
#: How long the watcher waits at start for the assignments topic's partitions.
_SLOTS_TIMEOUT_S = 10.0
#: How often :meth:`ClusterTracker.view` forgets workers and statuses long silent.
_PRUNE_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Freshness:
    """When heartbeats and statuses count (see the module docstring)."""

    heartbeat_staleness: float = 3.0
    status_stale_s: float = 5.0
    model_memory_s: float = 300.0


class ClusterTracker:
    """Newest heartbeat per worker and status per (model, scheduler); see module doc."""

    def __init__(self, registry: ModelRegistry, freshness: Freshness = Freshness()) -> None:
        self._registry = registry
        self._freshness = freshness
        self._workers: dict[str, WorkerHeartbeat] = {}
        self._statuses: dict[tuple[str, str], QueueStatus] = {}
        #: Heartbeats observed since start, stale or not (for readiness).
        self.heartbeats_seen = 0
        #: Partitions of the assignments topic (None: not known, any partition counts).
        self.slots: frozenset[int] | None = None
        self._pruned_at = -math.inf

    def observe_heartbeat(self, hb: WorkerHeartbeat) -> None:
        self.heartbeats_seen += 1
        old = self._workers.get(hb.worker_id)
        if old is None or (hb.started_at, hb.seq) >= (old.started_at, old.seq):
            self._workers[hb.worker_id] = hb

    def forget_worker(self, worker_id: str) -> None:
        """A tombstone on the heartbeats topic: the worker is gone."""
        self._workers.pop(worker_id, None)

    def observe_status(self, status: QueueStatus) -> None:
        # The last one read: statuses of a model share a key, so the log orders them (by
        # its own stamp, one from a clock far ahead would shadow every later one).
        self._statuses[(self._canonical(status.model), status.scheduler_id)] = status

    def live_workers(self, now: float) -> list[WorkerHeartbeat]:
        """Fresh, not draining, with a KV budget, able to run a request to its end (not a
        prefill worker: it only computes prompts for decode workers)."""
        return [hb for hb in self._workers.values() if self._live(hb, now)]

    def served_models(self, now: float) -> list[str]:
        """Model names (as the workers serve them) of live workers, sorted."""
        return sorted({hb.model for hb in self.live_workers(now)})

    def prune(self, now: float) -> None:
        """Forget workers and statuses older than ``model_memory_s``: they count for
        nothing here (a live worker is fresh; a recent one within that memory). Nothing
        writes a heartbeat tombstone, so every worker id ever seen (a pod name per restart)
        stayed, and each admission's :meth:`view` walked them all (found by an audit:
        20,000 ids, 32 ms an admission). At most once a minute, from :meth:`view`."""
        self._pruned_at = now
        memory = self._freshness.model_memory_s
        for worker_id in [w for w, hb in self._workers.items() if abs(now - hb.ts) > memory]:
            del self._workers[worker_id]
        for key in [k for k, st in self._statuses.items() if abs(now - st.ts) > memory]:
            del self._statuses[key]

    def view(self, now: float) -> ClusterView:
        """The frozen snapshot admission decides on."""
        if abs(now - self._pruned_at) >= _PRUNE_EVERY_S:
            self.prune(now)
        workers: dict[str, list[WorkerHeartbeat]] = defaultdict(list)
        for hb in self.live_workers(now):
            workers[self._canonical(hb.model)].append(hb)
        # model -> (queued tokens, drain, running tokens, usable KV): module docstring
        queued: dict[str, tuple[int, float, int, int]] = {}
        for (model, _), st in self._statuses.items():
            if abs(now - st.ts) <= self._freshness.status_stale_s:
                tokens, drain, running, usable = queued.get(model, (0, 0.0, 0, 0))
                queued[model] = (tokens + st.pending_tokens,
                                 max(drain, st.drain_tokens_per_s),
                                 max(running, st.running_tokens),
                                 max(usable, st.max_usable_kv_tokens))
        recent = {self._canonical(hb.model) for hb in self._workers.values()
                  if abs(now - hb.ts) <= self._freshness.model_memory_s}
        capacities = []
        for model in workers.keys() | queued.keys() | recent:
            live = workers.get(model, [])
            tokens, drain, running, usable = queued.get(model, (0, 0.0, 0, 0))
            best_kv = max((hb.kv_total_tokens for hb in live), default=0)
            if usable > 0:
                best_kv = min(best_kv, usable)
            headroom = max(0, sum(hb.kv_total_tokens for hb in live) - running)
            block = max((hb.block_size for hb in live), default=None)
            capacities.append(ModelCapacity(model, len(live), best_kv, tokens, drain,
                                            kv_headroom_tokens=headroom, block_size=block))
        return ClusterView.of(capacities)

    def _live(self, hb: WorkerHeartbeat, now: float) -> bool:
        # Either side of now: a heartbeat from a clock far ahead is not fresh.
        fresh = abs(now - hb.ts) <= self._freshness.heartbeat_staleness * hb.interval_s
        return fresh and not hb.draining and hb.kv_total_tokens > 0 \
            and hb.role != "prefill" and (self.slots is None or hb.partition in self.slots)

    def _canonical(self, model: str) -> str:
        shape = self._registry.get(model)
        return model if shape is None else shape.name


class ClusterWatcher:
    """Reads ``heartbeats_topic`` and ``status_topic`` into ``tracker`` until stopped.

    ``caught_up`` is set once everything that was in both topics at start has been read,
    so admission does not refuse early requests for want of a fleet it has not read yet.
    The reading is :class:`services.common.log_reader.LogReader`'s (as the scheduler's).
    """

    def __init__(
        self,
        bootstrap: str,
        tracker: ClusterTracker,
        *,
        heartbeats_topic: str,
        status_topic: str,
        guard: Guard,
        assignments_topic: str | None = None,
    ) -> None:
        self.tracker = tracker
        self._bootstrap = bootstrap
        self._assignments_topic = assignments_topic
        self._reader = LogReader(
            bootstrap,
            {heartbeats_topic: self._on_heartbeat, status_topic: self._on_status},
            guard,
            poll_ms=200,
            name="ingest-cluster-watcher",
        )

    @property
    def caught_up(self) -> asyncio.Event:
        return self._reader.caught_up

    @property
    def running(self) -> bool:
        return self._reader.running

    async def start(self) -> None:
        if self._assignments_topic is not None:
            await self._read_slots(self._assignments_topic)
        await self._reader.start()

    async def _read_slots(self, topic: str) -> None:
        """``tracker.slots`` from ``topic`` (ingest made it before starting). Not found:
        every partition counts, as before this check, and a warning says so."""
        try:
            found = await topic_partitions(self._bootstrap, topic, _SLOTS_TIMEOUT_S)
        except (KafkaError, OSError, TimeoutError) as exc:
            _log.warning("ingest: the partitions of %s are unknown (%s): workers of any "
                         "partition count as capacity", topic, exc)
            return
        self.tracker.slots = frozenset(found)

    async def stop(self) -> None:
        await self._reader.stop()

    def _on_heartbeat(self, record: Any) -> None:
        if record.value is None:
            if record.key is not None:
                self.tracker.forget_worker(record.key.decode(errors="replace"))
            return
        self.tracker.observe_heartbeat(decode(record.value, HEARTBEAT_ADAPTER))

    def _on_status(self, record: Any) -> None:
        if record.value is not None:
            self.tracker.observe_status(decode(record.value, STATUS_ADAPTER))
