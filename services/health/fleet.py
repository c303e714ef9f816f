"""The fleet as the health side sees it: newest heartbeat per worker, drains, queue status.

:class:`FleetTracker` is plain state (tests drive it synchronously). It keeps, per worker,
the newest heartbeat by ``(started_at, seq)`` — so a restarted worker's first beat wins over
the old process's last one — whether a tombstone (null value) followed it, and the newest
``DrainWorker`` command; and the newest ``QueueStatus`` per (model, scheduler).

:class:`FleetFeed` fills a tracker from Kafka with one plain consumer (no group: every
reader sees everything): ``llmq.heartbeats`` and ``llmq.status`` from the beginning (both
are compacted, so the beginning is the latest state of everything), ``llmq.control`` from
its end (drains issued from now on; a drain issued earlier shows in the worker's own
draining heartbeat, which is the source of truth). ``caught_up`` turns true once everything
that was in the two compacted topics at start has been read.

Undecodable records are logged and counted, not dead-lettered: every health instance and
every ``llmq status`` reads the whole topic, so dead-lettering here would repeat each bad
record once per reader; the scheduler's group consumer dead-letters them once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas.codec import SchemaError, decode
from schemas.control import DrainWorker
from schemas.messages import CONTROL_ADAPTER, HEARTBEAT_ADAPTER, STATUS_ADAPTER
from schemas.status import QueueStatus
from schemas.workers import WorkerHeartbeat
from services.common.kafka import make_consumer
from services.health.core import DrainRequest, WorkerRecord
from services.health.lag import describe_partitions, offsets_by_topic

_log = logging.getLogger(__name__)

#: How long a silent worker is kept (shown ``gone``) before :meth:`FleetTracker.prune`.
GONE_KEPT_S: Final = 3600.0


class FleetTracker:
    """Newest heartbeat, tombstone and drain per worker; newest status per (model,
    scheduler). See the module docstring."""

    def __init__(self) -> None:
        self._beats: dict[str, WorkerHeartbeat] = {}
        self._tombstoned: set[str] = set()
        self._drains: dict[str, DrainRequest] = {}
        self._statuses: dict[tuple[str, str], QueueStatus] = {}
        #: Heartbeats observed since start, and records that did not decode.
        self.heartbeats_seen = 0
        self.bad_records = 0
        self._listeners: list[Callable[[WorkerHeartbeat], object]] = []

    def subscribe(self, listener: Callable[[WorkerHeartbeat], object]) -> None:
        """Call ``listener`` with every heartbeat observed from now on, older ones too: the
        tracker keeps only each worker's newest, and a follower may need the one before
        (a drained process's last beat, read in the same poll as its successor's first)."""
        self._listeners.append(listener)

    def observe_heartbeat(self, hb: WorkerHeartbeat) -> bool:
        """Keep ``hb`` if it is the newest of its worker; returns whether it was kept."""
        self.heartbeats_seen += 1
        for listener in self._listeners:
            listener(hb)
        old = self._beats.get(hb.worker_id)
        if old is not None and (hb.started_at, hb.seq) < (old.started_at, old.seq):
            return False
        self._beats[hb.worker_id] = hb
        # Same key, same partition: a beat after a tombstone in the log is a worker back.
        self._tombstoned.discard(hb.worker_id)
        return True

    def observe_tombstone(self, worker_id: str) -> None:
        """A null value on the heartbeats topic: the worker is gone."""
        self._tombstoned.add(worker_id)

    def observe_drain(self, cmd: DrainWorker) -> None:
        old = self._drains.get(cmd.worker_id)
        if old is None or cmd.issued_at >= old.issued_at:
            self._drains[cmd.worker_id] = DrainRequest(cmd.reason, cmd.issued_at)

    def observe_status(self, status: QueueStatus) -> None:
        # The last one read: statuses of a model share a key, so the log orders them (by
        # its own stamp, one from a clock far ahead would shadow every later one).
        self._statuses[(status.model, status.scheduler_id)] = status

    def prune(self, now: float, keep_s: float = GONE_KEPT_S) -> None:
        """Forget workers silent for more than ``keep_s`` (an hour: ``gone`` for that long
        in ``llmq status`` and /status), and drain commands for workers not kept. Nothing
        writes a heartbeat tombstone, so every worker id ever seen (a pod name per
        restart) stayed for the process's life (found by an audit)."""
        for worker_id in [w for w, hb in self._beats.items() if abs(now - hb.ts) > keep_s]:
            del self._beats[worker_id]
            self._tombstoned.discard(worker_id)
        for worker_id in [w for w, d in self._drains.items()
                          if w not in self._beats and abs(now - d.issued_at) > keep_s]:
            del self._drains[worker_id]
        for key in [k for k, st in self._statuses.items() if abs(now - st.ts) > keep_s]:
            del self._statuses[key]

    def record(self, worker_id: str) -> WorkerRecord | None:
        """What is known of one worker; None when no heartbeat of it was ever read."""
        hb = self._beats.get(worker_id)
        if hb is None:
            return None
        return WorkerRecord(hb, worker_id in self._tombstoned, self._drains.get(worker_id))

    def records(self) -> dict[str, WorkerRecord]:
        """Every worker with a heartbeat, by worker_id (a fresh dict: safe to keep)."""
        found = (self.record(worker_id) for worker_id in self._beats)
        return {rec.worker_id: rec for rec in found if rec is not None}

    def tombstoned(self, worker_id: str) -> bool:
        """A tombstone was read for ``worker_id`` (and no heartbeat after it)."""
        return worker_id in self._tombstoned

    def queue_statuses(self) -> list[QueueStatus]:
        """Newest status per (model, scheduler), sorted by model then scheduler."""
        return [self._statuses[k] for k in sorted(self._statuses)]


class FleetFeed:
    """Reads heartbeats, queue status and drains of ``prefix`` into ``tracker``.

    ``start()`` then ``poll()`` repeatedly (or ``run()``); ``stop()`` closes the consumer.
    Topics that do not exist are skipped and listed in ``missing_topics`` (a read-only
    caller such as ``llmq status`` must not create them).
    """

    def __init__(
        self,
        bootstrap: str,
        prefix: str,
        tracker: FleetTracker,
        *,
        read_status: bool = True,
        read_control: bool = True,
    ) -> None:
        self.tracker = tracker
        self.heartbeats_topic = f"{prefix}.heartbeats"
        self.status_topic = f"{prefix}.status"
        self.control_topic = f"{prefix}.control"
        self.caught_up = asyncio.Event()
        self.missing_topics: list[str] = []
        self._bootstrap = bootstrap
        self._compacted = [self.heartbeats_topic] + ([self.status_topic] if read_status else [])
        self._tail = [self.control_topic] if read_control else []
        self._consumer: AIOKafkaConsumer | None = None
        self._pending: dict[TopicPartition, int] = {}

    async def start(self, timeout_s: float = 15.0) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self._bootstrap, request_timeout_ms=5_000)
        await asyncio.wait_for(admin.start(), timeout_s)
        try:
            parts = await asyncio.wait_for(
                describe_partitions(admin, self._compacted + self._tail), timeout_s
            )
        finally:
            await admin.close()
        self.missing_topics = [t for t in self._compacted + self._tail if t not in parts]
        compacted = _tps(parts, self._compacted)
        tail = _tps(parts, self._tail)
        consumer = make_consumer(self._bootstrap)
        await asyncio.wait_for(consumer.start(), timeout_s)
        try:
            # End offsets before assign(): once partitions are assigned, the fetcher's own
            # metadata refresh makes this first offset request wait (≈0.5 s).
            ends = await asyncio.wait_for(offsets_by_topic(consumer, compacted, end=True),
                                          timeout_s)
            self._pending = {tp: end for tp, end in ends.items() if end > 0}
            consumer.assign(compacted + tail)
            if compacted:
                await consumer.seek_to_beginning(*compacted)
            if tail:
                await consumer.seek_to_end(*tail)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer
        if not self._pending:
            self.caught_up.set()

    async def poll(self, timeout_ms: int = 200) -> int:
        """Read one batch into the tracker; returns the number of records read."""
        if self._consumer is None:
            raise RuntimeError("FleetFeed.poll before start")
        batches = await self._consumer.getmany(timeout_ms=timeout_ms)
        count = 0
        for tp, records in batches.items():
            for record in records:
                count += 1
                self._handle(record)
                if record.offset + 1 >= self._pending.get(tp, 0):
                    self._pending.pop(tp, None)
        if self._pending:
            # A partition whose tail was compacted away ends before its end offset: ask
            # where we are rather than wait for a record that will never come.
            for tp in list(self._pending):
                if await self._consumer.position(tp) >= self._pending[tp]:
                    self._pending.pop(tp)
        if not self._pending:
            self.caught_up.set()
        return count

    async def catch_up(self, timeout_s: float) -> None:
        """Poll until ``caught_up``; TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while not self.caught_up.is_set():
                await self.poll()

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()

    def _handle(self, record: Any) -> None:
        try:
            if record.topic == self.heartbeats_topic:
                if record.value is None:
                    if record.key is not None:
                        self.tracker.observe_tombstone(bytes(record.key).decode("utf-8", "replace"))
                    return
                self.tracker.observe_heartbeat(decode(record.value, HEARTBEAT_ADAPTER))
            elif record.topic == self.status_topic:
                if record.value is not None:
                    self.tracker.observe_status(decode(record.value, STATUS_ADAPTER))
            elif record.topic == self.control_topic and record.value is not None:
                msg = decode(record.value, CONTROL_ADAPTER)
                if isinstance(msg, DrainWorker):
                    self.tracker.observe_drain(msg)
        except SchemaError as exc:
            self.tracker.bad_records += 1
            _log.warning("skipping undecodable record %s/%d/%d: %s",
                         record.topic, record.partition, record.offset, exc)


def _tps(parts: dict[str, list[int]], topics: Iterable[str]) -> list[TopicPartition]:
    return [TopicPartition(t, p) for t in topics for p in parts.get(t, [])]
