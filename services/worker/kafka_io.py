"""The worker's Kafka plumbing: topic names, a batching publisher, the control reader.

- :class:`WorkerTopics` names the topics a worker uses, taken from the catalog by the
  messages they carry (the catalog is the only place that spells topic names).
- :class:`Publisher` produces wire messages without waiting for each ack: ``send`` returns
  the delivery future, ``acked`` waits for many at once (bounded by a timeout). Hot paths
  (token chunks) never wait per message; a request waits once, before its terminal.
- :class:`ControlReader` reads every partition of ``llmq.control`` from its end, without a
  consumer group (every worker must see every command), and hands decoded commands to a
  callback. Undecodable control records are logged and skipped here, not dead-lettered:
  the scheduler's control consumer (a group, so once per record) dead-letters them, and
  every worker doing it too would multiply one bad record by the size of the fleet.
- :class:`EventFollower` reads ``llmq.events`` the same way, from a given time: a
  draining prefill worker follows its hand-offs there (``services.worker.core.handoffs``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from schemas.base import WireMessage
from schemas.codec import SchemaError, decode, encode
from schemas.control import CancelRequest, DrainWorker, LeaseAnswer
from schemas.messages import CONTROL_ADAPTER, EVENT_ADAPTER
from schemas.requests import Assignment
from schemas.topics import TopicSpec, catalog, message_key
from schemas.workers import EventStarted, LifecycleEvent, WorkerHeartbeat
from services.common.kafka import TopicRequest, fetch_forever, make_consumer
from services.common.replies import topic_partitions
from services.common.tracing import Headers

_log = logging.getLogger(__name__)

ControlMessage = DrainWorker | CancelRequest | LeaseAnswer


@dataclass(frozen=True, slots=True)
class WorkerTopics:
    """Topic names of one deployment (prefix) as a worker sees them."""

    assignments: str
    heartbeats: str
    events: str
    control: str
    deadletter: str
    specs: tuple[TopicSpec, ...]

    @classmethod
    def of(cls, prefix: str, assignment_partitions: int) -> WorkerTopics:
        specs = tuple(catalog(prefix, assignment_partitions))

        def carrying(model: type[WireMessage] | None) -> str:
            for spec in specs:
                if (model is None and spec.adapter is None) or model in spec.models:
                    return spec.name
            raise LookupError(f"no catalog topic carries {model}")

        return cls(
            assignments=carrying(Assignment),
            heartbeats=carrying(WorkerHeartbeat),
            events=carrying(EventStarted),
            control=carrying(CancelRequest),
            deadletter=carrying(None),
            specs=specs,
        )

    def to_create(self) -> list[TopicRequest]:
        """The catalog topics (every service ensures them at start; idempotent)."""
        return [TopicRequest(s.name, s.partitions, s.config) for s in self.specs]


class Publisher:
    """Sends wire messages on a started aiokafka producer (idempotent, acks=all)."""

    def __init__(self, producer: Any, timeout_s: float) -> None:
        self._producer = producer
        self.timeout_s = timeout_s

    async def send(
        self, topic: str, msg: WireMessage, headers: Headers | None = None
    ) -> asyncio.Future[Any]:
        """Queue ``msg`` for ``topic`` (key from the catalog, ``headers``: the request's trace
        context); returns its delivery future. Waits only for buffer space, not the broker.
        """
        future: asyncio.Future[Any] = await asyncio.wait_for(
            self._producer.send(topic, encode(msg), key=message_key(msg),
                                headers=headers or None),
            self.timeout_s,
        )
        return future

    async def acked(self, futures: Iterable[asyncio.Future[Any]]) -> bool:
        """True once every future is acknowledged; False on an error or the timeout."""
        pending = list(futures)
        if not pending:
            return True
        # asyncio.wait, not wait_for(gather(...)): a gather cancelled at shutdown would be
        # logged as "exception was never retrieved"; the futures stay the producer's.
        done, late = await asyncio.wait(pending, timeout=self.timeout_s)
        if late:
            _log.error("broker did not acknowledge %d of %d record(s) within %.0f s",
                        len(late), len(pending), self.timeout_s)
            return False
        for future in done:
            if future.cancelled():
                return False
            exc = future.exception()
            if exc is not None:
                _log.error("broker did not acknowledge %d record(s): %r", len(pending), exc)
                return False
        return True

    async def send_acked(
        self, topic: str, msg: WireMessage, headers: Headers | None = None
    ) -> bool:
        """Send one message and wait for its ack (low-rate messages: heartbeats, terminals)."""
        try:
            future = await self.send(topic, msg, headers)
        except (KafkaError, TimeoutError, OSError) as exc:
            _log.error("could not send %s to %s: %r", msg.kind, topic, exc)
            return False
        return await self.acked([future])


class TopicFollower:
    """Every record of one topic from a point on, decoded with ``adapter`` and handed to a
    callback: every partition, no consumer group (module docstring). Undecodable records
    are logged and skipped; a failing callback is logged and the next record is read."""

    def __init__(self, bootstrap: str, topic: str, adapter: Any,
                 handle: Callable[[Any], Awaitable[None]], what: str) -> None:
        self.topic = topic
        self._bootstrap = bootstrap
        self._adapter = adapter
        self._handle = handle
        self._what = what
        self._consumer: Any = None

    async def start(self, since_s: float | None = None) -> None:
        """Assign every partition at its current end, or (``since_s``, Unix seconds) at its
        first record stamped at or after that time; what is sent after this is seen."""
        partitions = await topic_partitions(self._bootstrap, self.topic)
        consumer = make_consumer(self._bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            tps = [TopicPartition(self.topic, p) for p in partitions]
            consumer.assign(tps)
            # The ends first: a partition with nothing stamped since ``since_s`` starts
            # there, so a record sent while the times are looked up is not skipped.
            ends = await consumer.end_offsets(tps)
            found = {} if since_s is None else await consumer.offsets_for_times(
                {tp: max(0, int(since_s * 1000)) for tp in tps})
            for tp in tps:
                at = found.get(tp)
                consumer.seek(tp, ends[tp] if at is None else at.offset)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def run(self) -> None:
        """Read until cancelled."""
        async for batches in fetch_forever(self._consumer, 200, f"{self._what} reader"):
            for records in batches.values():
                for record in records:
                    await self._one(record)

    async def _one(self, record: Any) -> None:
        try:
            msg = decode(record.value, self._adapter)
        except SchemaError as exc:
            _log.warning("%s: undecodable record %s/%s/%s skipped: %s", self._what,
                         record.topic, record.partition, record.offset, exc)
            return
        try:
            await self._handle(msg)
        except Exception:
            # One record must not stop the worker from seeing the next one.
            _log.exception("%s: handling %s failed", self._what, msg.kind)


class ControlReader(TopicFollower):
    """Every command on the control topic from now on, decoded (see the module docstring)."""

    def __init__(self, bootstrap: str, topic: str,
                 handle: Callable[[ControlMessage], Awaitable[None]]) -> None:
        super().__init__(bootstrap, topic, CONTROL_ADAPTER, handle, "control")


class EventFollower(TopicFollower):
    """Lifecycle events on ``llmq.events`` (a draining prefill worker reads them to learn
    when its hand-offs' KV was taken: ``services.worker.core.handoffs``). Undecodable
    events are skipped here: the scheduler's reader dead-letters them."""

    def __init__(self, bootstrap: str, topic: str,
                 handle: Callable[[LifecycleEvent], Awaitable[None]]) -> None:
        super().__init__(bootstrap, topic, EVENT_ADAPTER, handle, "events")
