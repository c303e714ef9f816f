"""Read topics from the beginning, every partition, without a consumer group.

The "GlobalTable" of llmq: one plain aiokafka consumer, assigned every partition of its
topics (so every replica sees everything), replays them from the beginning into one
handler per topic and then follows them. Users: the scheduler (``llmq.heartbeats`` → the
fleet view, ``llmq.assignments`` and ``llmq.events`` → the assignment log the ledger is
rebuilt from) and ingest's cluster watcher (``llmq.heartbeats`` and ``llmq.status``).
faust 0.15 wants a table to own its changelog topic, while these topics are written by
other services as plain JSON (the compacted ones already are a table).

:attr:`LogReader.caught_up` is set once everything that was in the topics at start was
handled; callers act on nothing before that. :meth:`LogReader.barrier` waits until what is
in some topics *now* was handled (the scheduler uses it after a rebalance, so a request
redelivered from another replica is recognised as assigned).

Records that fail to decode are dead-lettered through the guard when they are new; the
history replayed at start was dead-lettered by whoever read it first, so it is only
logged (a restart must not flood the dead letter with old records).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from aiokafka import TopicPartition

from services.common.guard import Guard
from services.common.kafka import fetch_forever, make_consumer
from services.common.replies import topic_partitions

#: Handles one record of a topic (decoding included); raising dead-letters it.
Handler = Callable[[Any], None]

_log = logging.getLogger(__name__)


class LogReader:
    """Reads ``handlers``' topics from the beginning into their handlers (module docstring)."""

    def __init__(
        self,
        bootstrap: str,
        handlers: Mapping[str, Handler],
        guard: Guard,
        *,
        on_batch: Callable[[], None] | None = None,
        poll_ms: int = 50,
        name: str = "log-reader",
    ) -> None:
        self._read_up_to: dict[TopicPartition, float] = {}  # read_up_to, per partition
        #: The latest fetch stamp seen per partition, and the one before it (_advance).
        self._stamps: dict[TopicPartition, tuple[float | None, float | None]] = {}
        self.caught_up = asyncio.Event()
        self._bootstrap = bootstrap
        self._handlers = dict(handlers)
        self._guard = guard
        self._on_batch = on_batch
        self._poll_ms = poll_ms
        self._name = name
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None
        self._tps: list[TopicPartition] = []
        self._partitions: dict[str, frozenset[int]] = {}  # _tps by topic
        self._history: dict[TopicPartition, int] = {}  # end offsets at start
        self._handled: dict[TopicPartition, int] = {}  # next offset to handle
        self._targets: list[dict[TopicPartition, int]] = []  # ends barriers wait for
        self._progress = asyncio.Condition()
        #: Replayed records that did not decode (logged, not dead-lettered).
        self.bad_history = 0

    def partitions(self, topic: str) -> frozenset[int]:
        """The partitions of ``topic`` this reader follows (read once, at start)."""
        return self._partitions.get(topic, frozenset())

    @property
    def poll_s(self) -> float:
        """How long a fetch waits for records before it is answered empty."""
        return self._poll_ms / 1000.0

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        tps = [
            TopicPartition(topic, p)
            for topic in self._handlers
            for p in await topic_partitions(self._bootstrap, topic)
        ]
        # A fetch with nothing new returns after poll_ms, not aiokafka's 500 ms: how fresh
        # ``caught_up_at`` is on a quiet topic.
        consumer = make_consumer(self._bootstrap, fetch_max_wait_ms=self._poll_ms)
        await consumer.start()
        try:
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends: dict[TopicPartition, int] = await consumer.end_offsets(tps)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer, self._tps, self._history = consumer, tps, dict(ends)
        self._partitions = {topic: frozenset(tp.partition for tp in tps if tp.topic == topic)
                            for topic in self._handlers}
        self._task = asyncio.create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def barrier(self, topics: set[str], timeout_s: float) -> bool:
        """Wait until ``topics`` were handled up to their current end; False on timeout."""
        tps = [tp for tp in self._tps if tp.topic in topics]
        ends: dict[TopicPartition, int] = await self._consumer.end_offsets(tps)
        self._targets.append(ends)
        try:
            async with self._progress:
                await asyncio.wait_for(
                    self._progress.wait_for(lambda: self._reached(ends) or not self.running),
                    timeout_s,
                )
        except TimeoutError:
            return False
        finally:
            self._targets.remove(ends)
        return self._reached(ends)

    def read_up_to(self, topic: str) -> dict[int, float]:
        """Per partition of ``topic``: the latest wall time (seconds) of a fetch after which
        the partition was handled up to its end as the broker reported it then, so that
        everything written to it before about that time was handled. Only moves forward;
        0.0 while never. Per partition, unlike :meth:`caught_up_at`: one partition that
        cannot be fetched (its leader offline) holds only its own time back."""
        found: dict[int, float] = {}
        for tp in self._tps:
            if tp.topic == topic:
                self._advance(tp)
                found[tp.partition] = self._read_up_to.get(tp, 0.0)
        return found

    def _advance(self, tp: TopicPartition) -> None:
        """Move :meth:`read_up_to` of ``tp`` on. aiokafka stamps a fetch response when it
        processes it, which can be long after the broker built it (a pause in between),
        so the time credited is the stamp of an *earlier* response: aiokafka sends the
        next fetch only once the last one was processed, so the response now in hand was
        built after that earlier stamp, and its highwater covers what was written before
        it (a review found the current stamp let a pause declare live workers dead)."""
        consumer = self._consumer
        if consumer is None:
            return
        end, polled = consumer.highwater(tp), consumer.last_poll_timestamp(tp)
        if polled is None:
            return
        stamp = polled / 1000.0
        current, earlier = self._stamps.get(tp, (None, None))
        if stamp != current:
            current, earlier = stamp, current
            self._stamps[tp] = (current, earlier)
        if end is not None and earlier is not None and self._handled.get(tp, 0) >= end \
                and earlier > self._read_up_to.get(tp, 0.0):
            self._read_up_to[tp] = earlier

    def caught_up_at(self, topic: str) -> float:
        """The wall time (seconds) of the latest fetch after which every partition of
        ``topic`` was handled up to its end as the broker reported it then: everything
        written to ``topic`` before about that time was handled. 0.0 while unknown or
        behind. (The scheduler's replicas wait for it before placing in their turn.)"""
        consumer = self._consumer
        if consumer is None:
            return 0.0
        oldest = float("inf")
        for tp in self._tps:
            if tp.topic != topic:
                continue
            end, polled = consumer.highwater(tp), consumer.last_poll_timestamp(tp)
            if end is None or polled is None or self._handled.get(tp, 0) < end:
                return 0.0
            oldest = min(oldest, polled / 1000.0)
        return 0.0 if oldest == float("inf") else oldest

    async def _run(self) -> None:
        async for batches in fetch_forever(self._consumer, self._poll_ms, self._name):
            for tp, records in batches.items():
                handler = self._handlers[tp.topic]
                history = self._history.get(tp, 0)
                for record in records:
                    await self._handle(handler, record, record.offset < history)
                    self._handled[tp] = record.offset + 1
            if batches and self._on_batch is not None:
                self._on_batch()
            await self._skip_empty_tails()
            for tp in self._tps:  # every fetch stamp seen keeps read_up_to's lag short
                self._advance(tp)
            if not self.caught_up.is_set() and self._reached(self._history):
                self.caught_up.set()
            async with self._progress:
                self._progress.notify_all()

    async def _handle(self, handler: Handler, record: Any, replayed: bool) -> None:
        if not replayed:
            await self._guard.run(record, _sync(handler, record))
            return
        try:
            handler(record)
        except Exception as exc:
            self.bad_history += 1
            _log.warning("%s: skipped replayed record %s/%s/%s: %s", self._name,
                         record.topic, record.partition, record.offset, exc)

    def _reached(self, ends: Mapping[TopicPartition, int]) -> bool:
        return all(self._handled.get(tp, 0) >= end for tp, end in ends.items())

    async def _skip_empty_tails(self) -> None:
        """A partition whose tail was compacted or deleted has no record at ``end - 1``
        (the broker keeps an empty batch there, and the consumer's position moves past
        it): between batches every record before the position was handled, so the
        position counts as handled. Without it, a partition whose last records were
        compacted away (a worker's heartbeats a week after it left) stayed "behind" for
        good, and :meth:`caught_up_at` with it."""
        consumer = self._consumer
        for tp in self._tps:
            end = consumer.highwater(tp)
            if end is None or self._handled.get(tp, 0) >= end:
                continue  # not behind (or never fetched): no position to ask for
            position = await consumer.position(tp)
            if self._handled.get(tp, 0) < position:
                self._handled[tp] = position


def _sync(handler: Handler, record: Any) -> Callable[[], Any]:
    async def run() -> None:
        handler(record)

    return run
