"""Faust wiring of ingest admission: topics, tables, agents, a timer. No decisions here —
every record goes to :class:`services.ingest.intake.IntakeHandler`, which calls the core.

Settlement design (``llmq.events`` is keyed by request_id, the tenant state by tenant):

1. agent ``ingest-events`` reads ``llmq.events`` and forwards each terminal event as a
   small ``SettleRecord`` to the internal topic ``<app id>-settle``, keyed by tenant;
2. agent ``ingest-admission`` reads ``llmq.intake`` *and* the settle topic. Both are
   keyed by tenant with the same partition count and partitioner, so partition p of
   each carries the same tenants and one actor owns a tenant's state: the token bucket
   (table ``buckets``, tenant → ``TenantState.to_dict()``) and the reservations of its
   requests in flight (table ``reservations``, request_id → tenant, reserved tokens,
   deadline). Faust writes a table change to the changelog partition of the record being
   handled, so a reservation keyed by request_id still lives on its tenant's partition;
   both tables are rebuilt from their changelogs at start (limits survive a restart);
3. timer ``ingest-expire`` scans the reservations for ones past their deadline (a safety
   net: every path ends a request with a terminal event, but one lost with a crashed
   scheduler or worker would otherwise hold its tenant's slot for ever) and sends
   ``expired`` settle records through the same topic, so that only the agent writes; and
   ``recount`` ones for tenants whose bucket counts other requests in flight than they
   have reservations (the two tables' writes of one decision, lost apart in a crash).

Records are consumed raw (``value_serializer="raw"``) and decoded by the handler inside a
:class:`~services.common.guard.Guard`: a bad record goes to ``llmq.deadletter`` with its
reason and the agent carries on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import faust
from mode import Service

from schemas.codec import encode
from services.common.faust_app import make_app
from services.common.guard import DeadLetterSend, Guard, Headers
from services.common.kafka import ensure_topics, key_partition, topic_exists, track_topics
from services.common.settings import Settings
from services.ingest.cluster import ClusterTracker, ClusterWatcher, Freshness
from services.ingest.core import TokenCounter
from services.ingest.intake import IntakeHandler, Publish, answer_topic
from services.ingest.redelivery import RedeliveryCheck
from services.ingest.settings import IngestSettings
from services.ingest.tenants import Tenancy
from services.ingest.topics import TABLES, IngestTopics

_log = logging.getLogger("services.ingest")
_RAW: dict[str, Any] = {
    "key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw",
}
#: Table keys are str and values plain dicts: JSON on the changelog.
_TABLE_SCHEMA: faust.Schema[str, dict[str, Any]] = faust.Schema(
    key_serializer="json", value_serializer="json"
)


@dataclass(frozen=True, slots=True)
class IngestRuntime:
    """What the Faust app and the HTTP API are built from (``__main__`` makes it)."""

    settings: Settings
    ingest: IngestSettings
    tenancy: Tenancy
    topics: IngestTopics
    counters: Mapping[str, TokenCounter] = field(default_factory=dict)
    clock: Callable[[], float] = time.time

    @property
    def app_id(self) -> str:
        return app_id(self.settings, self.ingest)


@dataclass(frozen=True, slots=True)
class IngestApp:
    """The built Faust app and the pieces the HTTP API shares with it."""

    app: faust.App
    watcher: ClusterWatcher


def app_id(settings: Settings, ingest: IngestSettings) -> str:
    """Faust app id (= consumer group): ``<topic_prefix>-<app_name>``, as make_app names it."""
    return f"{settings.topic_prefix}-{ingest.app_name}"


def build_app(rt: IngestRuntime) -> IngestApp:
    """The Faust app with its agents, tables and timer (module docstring)."""
    app = make_app(
        rt.ingest.app_name, rt.settings,
        # Each app id gets its own data dir: tests and deployments share a home.
        datadir=str(rt.settings.home / "faust" / rt.app_id),
        # The API is served by this worker through faust's framework-neutral hook
        # (serve_asgi), which is gated by web_enabled; faust's aiohttp stack stays off.
        web_enabled=True,
    )
    topics = rt.topics
    guard = Guard(_dead_letter(app, topics.deadletter), name="ingest", logger=_log)
    tracker = ClusterTracker(
        rt.tenancy.config.admission.registry,
        Freshness(rt.ingest.heartbeat_staleness, rt.ingest.status_stale_s),
    )
    watcher = ClusterWatcher(
        rt.settings.bootstrap, tracker, heartbeats_topic=topics.heartbeats,
        status_topic=topics.status, guard=guard, assignments_topic=topics.assignments,
    )
    buckets, reservations = (app.Table(name, partitions=topics.partitions, schema=_TABLE_SCHEMA)
                             for name in TABLES)
    publish = _publisher(app)
    handler = IntakeHandler(
        topics=topics, tenancy=rt.tenancy, tracker=tracker, buckets=buckets,
        reservations=reservations, publish=publish,
        ensure_topic=_topic_creator(rt.settings, topics), clock=rt.clock,
        counters=rt.counters, reservation_grace_s=rt.ingest.reservation_grace_s,
        owner_partition=_partitioner(topics.partitions),
        topic_exists=partial(topic_exists, rt.settings.bootstrap),
        answered_before=_redelivery_check(app, rt, reservations).answered_before,
    )
    _add_agents(app, rt, handler, guard, watcher)
    app.service(_ingest_service(app, rt, watcher))
    return IngestApp(app, watcher)


def _add_agents(
    app: faust.App, rt: IngestRuntime, handler: IntakeHandler, guard: Guard,
    watcher: ClusterWatcher,
) -> None:
    topics = rt.topics
    intake_and_settle = app.topic(topics.intake, topics.settle, **_RAW)

    @app.agent(intake_and_settle, name="ingest-admission")
    async def admission(stream: Any) -> None:
        await _await_cluster(watcher, rt.ingest.cluster_catchup_s)
        async for event in stream.events():
            message = event.message
            on_record = (
                handler.on_settle if message.topic == topics.settle else handler.on_request
            )
            await guard.run(message, partial(on_record, message))

    @app.agent(app.topic(topics.events, **_RAW), name="ingest-events")
    async def terminal_events(stream: Any) -> None:
        async for event in stream.events():
            message = event.message
            await guard.run(message, partial(handler.on_event, message))

    publish = _publisher(app)

    async def expire_reservations() -> None:
        try:
            owned = {tp.partition for tp in app.assignor.assigned_actives()
                     if tp.topic == topics.intake}
            now = rt.clock()
            for record in (*handler.expired(now, owned), *handler.miscounted(now, owned)):
                await publish(topics.settle, record.tenant.encode(), encode(record), None)
        except Exception:
            # A failed send (the broker away) must not end the app: a timer that raises
            # crashes it. The scan runs again next time, and expired reservations stay
            # expired until settled.
            _log.warning("ingest: expiring reservations failed; tried again in %.0f s",
                         rt.ingest.expiry_scan_s, exc_info=True)

    app.timer(rt.ingest.expiry_scan_s, name="ingest-expire")(expire_reservations)


def _redelivery_check(app: faust.App, rt: IngestRuntime, reservations: Any) -> RedeliveryCheck:
    """The check of intake records read again, told of each assignment of the intake
    topic's partitions (:mod:`services.ingest.redelivery`)."""
    intake = rt.topics.intake
    check = RedeliveryCheck.over_kafka(
        rt.settings.bootstrap, intake,
        target=partial(answer_topic, prefix=rt.topics.prefix),
        reserved=reservations.__contains__, timeout_s=rt.ingest.redelivery_check_s,
    )

    async def on_assigned(sender: Any, *args: Any, **_: Any) -> None:
        assigned = args[0] if args else ()
        check.assigned(tp.partition for tp in assigned if tp.topic == intake)

    app.on_partitions_assigned.connect(cast(Any, on_assigned))
    return check


async def _await_cluster(watcher: ClusterWatcher, timeout_s: float) -> None:
    """Let the fleet view catch up first: deciding on an empty view refuses everything."""
    try:
        await asyncio.wait_for(watcher.caught_up.wait(), timeout_s)
    except TimeoutError:
        _log.warning("fleet view not caught up after %.0f s; deciding with what is known",
                     timeout_s)


def _partitioner(partitions: int) -> Callable[[bytes], int]:
    """The partition our producers (aiokafka's default, Java-compatible murmur2) give a key:
    where the settle records of a tenant land, so where its intake records must be."""
    every = range(partitions)
    return lambda key: key_partition(key, every)


def _publisher(app: faust.App) -> Publish:
    """Produce through the Faust producer. Not awaiting delivery here is safe: Faust
    flushes its producer before it commits the offset of the record being handled."""

    async def publish(
        topic: str, key: bytes, value: bytes, headers: Headers | None = None,
        timestamp: float | None = None,
    ) -> None:
        producer = await app.maybe_start_producer()
        await producer.send(topic, key, value, None, timestamp, headers or None)

    return publish


def _dead_letter(app: faust.App, topic: str) -> DeadLetterSend:
    async def send(key: bytes | None, value: bytes | None, headers: Headers) -> object:
        producer = await app.maybe_start_producer()
        return await producer.send_and_wait(topic, key, value, None, None, headers)

    return send


def _topic_creator(settings: Settings, topics: IngestTopics) -> Callable[[str], Awaitable[None]]:
    async def ensure(topic: str) -> None:
        await ensure_topics(settings.bootstrap, [topics.reply_request(topic)],
                            replication_factor=settings.replication_factor)

    return ensure


def _ingest_service(app: faust.App, rt: IngestRuntime, watcher: ClusterWatcher) -> type[Any]:
    """A mode Service (started by the app) that runs the fleet reader and logs the banner."""

    class IngestService(Service):
        async def on_start(self) -> None:
            # Faust's producer is a plain AIOKafkaProducer: give its metadata every topic
            # this app writes to before the first send (services.common.kafka.Producer).
            producer = await app.maybe_start_producer()
            track_topics(producer._ensure_producer(), [t.name for t in rt.topics.to_create()])
            await watcher.start()
            ingest, topics = rt.ingest, rt.topics
            _log.info(
                "ingest ready: API http://%s:%d/v1 | app id %s | reply topic %s | %s",
                ingest.http_host, ingest.http_port, rt.app_id, topics.reply,
                rt.tenancy.describe(),
            )

        async def on_stop(self) -> None:
            await watcher.stop()

    return IngestService
