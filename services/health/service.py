"""The running health service: the fleet feed, the registry reconciler, the Kafka probe.

:class:`HealthService` owns one :class:`~services.health.fleet.FleetTracker` (filled by the
feed task) and, each tick: refreshes the gauges, and — with a registry (Consul) — applies
the plans of :func:`services.health.core.reconcile` from a worker thread (Consul calls
block). Its own instance is registered too (service ``llmq-health``, check passing while
ready), so Consul shows when the mirror itself is down.

Fail closed:

- the registry is reconciled only once the feed has read the heartbeats topic to its end:
  before that, absence of a heartbeat means "not read yet", not "gone";
- a failed registry call leaves that service id in an unknown state, so the next tick
  registers it again from scratch (this also repopulates a restarted Consul agent);
- ``/readyz`` is 200 only while the last Kafka probe answered *and* the feed caught up;
- ``/status`` (:meth:`HealthService.status`) refuses with :class:`FleetNotRead` until the
  feed caught up: a fleet read half-way (or not at all) would look smaller than it is.

Kafka being down at start does not stop the service: ``/healthz`` answers, ``/readyz``
says why not, and the feed is retried until the broker answers.

Every ``lag_s`` the consumer lag of each catalog topic's owning group goes to
``llmq_consumer_lag_records`` (the same offsets ``/status`` reads, one inspector shared).
The same round counts the assignments topic's partitions: a worker whose heartbeat names
another slot is registered with a critical check (the schedulers refuse it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka.errors import KafkaError

from schemas.topics import catalog
from services.common.kafka import TopicRequest, broker_answers, ensure_topics
from services.common.settings import Settings
from services.health.core import (
    UNKNOWN,
    WORKER_SERVICE,
    Action,
    Deregister,
    Desired,
    Plan,
    Register,
    SetCheck,
    SetMaintenance,
    WorkerRecord,
    WorkerState,
    desired_fleet,
    reconcile,
    worker_state,
)
from services.health.fleet import FleetFeed, FleetTracker
from services.health.lag import LagInspector, TopicFigures, assignment_slots
from services.health.metrics import HealthMetrics, WorkerGauge
from services.health.registry import Registry, RegistryError, ServiceRegistration
from services.health.settings import BIND_HOST, HealthSettings
from services.ops.status import build_status, read_metrics_urls

_log = logging.getLogger(__name__)

#: Consul service name of the health service's own instance.
HEALTH_SERVICE = "llmq-health"
#: Every this many ticks (30 s at the default tick) the registry is listed again.
_RESYNC_TICKS = 30


class FleetNotRead(Exception):
    """The heartbeats topic has not been read to its end yet: the fleet is not known."""


class HealthService:
    """See the module docstring. ``run(stop)`` until ``stop`` is set."""

    def __init__(
        self,
        settings: Settings,
        hs: HealthSettings,
        *,
        registry: Registry | None = None,
        metrics: HealthMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.hs = hs
        self.policy = hs.policy()
        self.registry = registry
        self.metrics = metrics or HealthMetrics()
        self.tracker = FleetTracker()
        self.kafka_ok = False
        self.kafka_error: str | None = "not probed yet"
        self.applied: dict[str, Desired | None] = {}
        #: Set once the heartbeats topic was read to its end (by the feed task).
        self.heartbeats_caught_up = asyncio.Event()
        self._clock = clock
        self._feed: FleetFeed | None = None
        self._synced = False
        self._ticks = 0
        self._registry_failing = False
        self._inspector: LagInspector | None = None
        self._inspector_lock = asyncio.Lock()
        self.own_id = f"{HEALTH_SERVICE}-{hs.resolved_instance_id()}"
        #: Partitions of the assignments topic, from the newest lag round (None until one
        #: found the topic): a worker beating another slot is refused by the schedulers,
        #: and its check is failed (:func:`services.health.core.is_stray`).
        self.slots: int | None = None

    # ---- readiness ---------------------------------------------------------------------
    @property
    def caught_up(self) -> bool:
        return self.heartbeats_caught_up.is_set()

    def ready(self) -> bool:
        return self.kafka_ok and self.caught_up

    def readiness(self) -> dict[str, Any]:
        return {
            "ready": self.ready(),
            "kafka": self.kafka_ok,
            "kafka_error": self.kafka_error,
            "heartbeats_caught_up": self.caught_up,
            "consul": self.registry is not None,
        }

    # ---- status ------------------------------------------------------------------------
    async def figures(
        self, group: str | None = None
    ) -> tuple[list[TopicFigures], dict[str, str | None], list[str]]:
        """Depth and lag per catalog topic (:meth:`LagInspector.figures`), fresh."""
        async with self._inspector_lock:
            if self._inspector is None:
                inspector = LagInspector(self.settings.bootstrap, self.settings.topic_prefix,
                                         self.settings.assignment_partitions)
                await inspector.start()
                self._inspector = inspector
            try:
                found = await asyncio.wait_for(self._inspector.figures(group), 10.0)
            except BaseException:
                # Rebuild the clients on the next request rather than reuse broken ones.
                inspector, self._inspector = self._inspector, None
                await inspector.stop()
                raise
        self.slots = assignment_slots(found[0])
        return found

    async def status(self, group: str | None = None) -> dict[str, Any]:
        """The ``llmq status --json`` document, from the tracker and fresh offsets.

        Raises :class:`FleetNotRead` before the heartbeats topic was read to its end.
        """
        if not self.caught_up:
            raise FleetNotRead(f"still reading {self.settings.topic_prefix}.heartbeats to its "
                               "end; the fleet is not known yet (see /readyz)")
        topics, groups, missing = await self.figures(group)
        return build_status(
            bootstrap=self.settings.bootstrap,
            prefix=self.settings.topic_prefix,
            records=self.tracker.records().values(),
            queues=self.tracker.queue_statuses(),
            topics=topics,
            groups=groups,
            missing_topics=missing,
            metrics_urls=read_metrics_urls(self.settings.home),
            now=self._clock(),
            policy=self.policy,
            status_stale_s=self.hs.status_stale_s,
        )

    # ---- running -----------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        tasks = [
            asyncio.create_task(self._probe_loop(), name="health-probe"),
            asyncio.create_task(self._feed_loop(), name="health-feed"),
            asyncio.create_task(self._tick_loop(), name="health-tick"),
            asyncio.create_task(self._lag_loop(), name="health-lag"),
        ]
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._feed is not None:
                await self._feed.stop()
            if self._inspector is not None:
                await self._inspector.stop()
            if self.registry is not None:
                # Our own instance goes; the workers stay, and their TTL checks expire to
                # critical while nobody vouches for them (fail closed).
                with contextlib.suppress(RegistryError):
                    await asyncio.to_thread(self.registry.deregister, self.own_id)

    async def _probe_loop(self) -> None:
        while True:
            ok = await broker_answers(self.settings.bootstrap, min(3.0, self.hs.probe_s))
            self.kafka_ok = ok
            self.kafka_error = None if ok else f"no broker answers at {self.settings.bootstrap}"
            self.metrics.ready.set(1 if self.ready() else 0)
            await asyncio.sleep(self.hs.probe_s)

    async def _feed_loop(self) -> None:
        backoff = 0.5
        while True:
            feed = FleetFeed(self.settings.bootstrap, self.settings.topic_prefix, self.tracker)
            try:
                # Every service creates the catalog at start (idempotent): the health
                # service must not wait forever for topics nobody created yet.
                specs = catalog(self.settings.topic_prefix, self.settings.assignment_partitions)
                await ensure_topics(self.settings.bootstrap,
                                    [TopicRequest(s.name, s.partitions, s.config) for s in specs],
                                    timeout_s=10.0,
                                    replication_factor=self.settings.replication_factor)
                await feed.start()
            except (KafkaError, OSError, TimeoutError) as exc:
                await feed.stop()
                self.kafka_error = f"cannot read heartbeats: {exc!r}"
                _log.warning("health: Kafka not usable yet (%r); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            self._feed = feed
            _log.info("health: reading %s", feed.heartbeats_topic)
            while True:
                try:
                    await feed.poll(timeout_ms=200)
                except KafkaError as exc:
                    _log.warning("health: fetch failed: %r", exc)
                    await asyncio.sleep(0.5)
                if feed.caught_up.is_set():
                    self.heartbeats_caught_up.set()
                self.metrics.bad_records.set(self.tracker.bad_records)

    async def _lag_loop(self) -> None:
        while True:
            if self.kafka_ok:
                try:
                    topics, _, _ = await self.figures()
                    self.metrics.lag(topics)
                except (KafkaError, OSError, TimeoutError) as exc:
                    _log.debug("health: consumer lag not read this round: %r", exc)
                except Exception:
                    # The gauges must not stop for good because of one bad round.
                    _log.exception("health: reading consumer lag failed")
            await asyncio.sleep(self.hs.lag_s)

    async def _tick_loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                # The tick must not die: the next one starts from what is known.
                _log.exception("health: tick failed")
            await asyncio.sleep(self.hs.tick_s)

    async def tick(self) -> None:
        """Refresh the gauges and, with a registry, reconcile it once."""
        now = self._clock()
        self._ticks += 1
        self.tracker.prune(now)
        records = self.tracker.records()
        self.metrics.observe([_gauge(rec, worker_state(rec, now, self.policy))
                              for rec in records.values()])
        self.metrics.ready.set(1 if self.ready() else 0)
        if self.registry is None or not self.caught_up:
            return
        desired = desired_fleet(records, now, self.policy, self.slots)
        desired[self.own_id] = self._own_desired()
        await asyncio.to_thread(self._sync_and_apply, self.registry, desired)

    def _own_desired(self) -> Desired:
        ready = self.ready()
        return Desired(
            registration=ServiceRegistration(
                name=HEALTH_SERVICE, service_id=self.own_id, tags=("llmq",),
                ttl_s=max(self.policy.min_ttl_s, 3 * self.hs.tick_s),
                address=BIND_HOST, port=self.hs.port,
            ),
            check="passing" if ready else "critical",
            note="ready" if ready else f"not ready: {self.readiness()}",
            beat=(0.0, self._ticks),
        )

    # Runs in a worker thread: only registry calls and dict updates of ``applied``, which
    # nothing else touches while a tick is in flight (ticks run one after the other).
    def _sync_and_apply(self, registry: Registry, desired: dict[str, Desired]) -> None:
        if not self._synced or self._ticks % _RESYNC_TICKS == 0:
            # At start, and every so often: what the registry holds. An agent that
            # restarted forgot instances whose checks no tick sends again (a critical one
            # is sent only when it changes): those are registered again.
            try:
                # Our own instance, not another health service's (each keeps its own).
                own = registry.service_ids(HEALTH_SERVICE) & {self.own_id}
                listed = registry.service_ids(WORKER_SERVICE) | own
            except RegistryError as exc:
                self._registry_error(exc)
                return
            for service_id in listed:
                self.applied.setdefault(service_id, UNKNOWN)
            for service_id in [s for s in self.applied if s not in listed]:
                del self.applied[service_id]
            self._synced = True
        self.apply(registry, reconcile(desired, self.applied))

    def apply(self, registry: Registry, plans: Sequence[Plan]) -> None:
        """Perform ``plans``; update ``applied`` with what succeeded."""
        for plan in plans:
            try:
                for action in plan.actions:
                    _perform(registry, action)
            except RegistryError as exc:
                self._registry_error(exc)
                self.applied[plan.service_id] = UNKNOWN
                continue
            if plan.after is None:
                self.applied.pop(plan.service_id, None)
            else:
                self.applied[plan.service_id] = plan.after
            if self._registry_failing:
                _log.info("health: registry reachable again")
                self._registry_failing = False

    def _registry_error(self, exc: RegistryError) -> None:
        self.metrics.registry_errors.inc()
        # One warning per outage, not one per call per tick.
        if not self._registry_failing:
            _log.warning("health: registry call failed: %s (will retry every tick)", exc)
            self._registry_failing = True
        else:
            _log.debug("health: registry call failed: %s", exc)


def _perform(registry: Registry, action: Action) -> None:
    match action:
        case Register(registration=reg):
            registry.register(reg)
        case SetCheck(service_id=sid, status=status, note=note):
            registry.set_check(sid, status, note)
        case SetMaintenance(service_id=sid, reason=reason):
            registry.set_maintenance(sid, reason)
        case Deregister(service_id=sid):
            registry.deregister(sid)


def _gauge(rec: WorkerRecord, state: WorkerState) -> WorkerGauge:
    hb = rec.heartbeat
    used = hb.kv_total_tokens - hb.kv_free_tokens
    return WorkerGauge(
        worker_id=hb.worker_id, model=hb.model, pool=hb.pool, state=state,
        kv_utilisation=used / hb.kv_total_tokens if hb.kv_total_tokens else 0.0,
        running=hb.running, waiting=hb.waiting,
    )
