"""Reading a reply topic: one consumer routes records to per-request streams.

Shared by ingest.http and the client SDK. A process that waits for many requests on one
reply topic runs one :class:`ReplyRouter` (a single consumer, no consumer group: it reads
every partition from the end, so it must be started before the first request is sent).
For each request it waits on, it calls :meth:`ReplyRouter.open` *before* producing the
request and reads the returned :class:`ReplyStream`; records of requests nobody waits for
are skipped without decoding (the record key is the request_id).

Delivery is at-least-once, so the stream applies the client rules of
docs/live-system.md: keep the newest attempt (anything of an older attempt is dropped),
drop chunks whose ``(attempt, seq)`` was seen, and end at the first terminal (``Done`` or
``Error``) of the newest attempt. A terminal of attempt 0 is ingest's (or the scheduler's)
refusal before any worker ran the request.

Usage::

    router = ReplyRouter(bootstrap, reply_topic(prefix, "ingest-a"))
    await router.start()
    stream = router.open(request_id)
    try:
        await producer.send_and_wait(intake, encode(request), key=...)
        async for msg in stream:          # TokenChunk ..., then Done or Error
            ...
    finally:
        router.close(request_id)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas.codec import SchemaError, decode
from schemas.messages import REPLY_ADAPTER
from schemas.replies import Done, Error, TokenChunk
from services.common.kafka import fetch_forever, make_consumer

Reply = TokenChunk | Done | Error
#: Called with the raw record and its decode error (e.g. to dead-letter it).
BadRecordHook = Callable[[Any, SchemaError], Awaitable[object]]

_log = logging.getLogger(__name__)


class DuplicateRequestError(ValueError):
    """``open()`` for a request_id that already has an open stream."""


class ReplyStream:
    """The deduplicated replies of one request, in order, ending with its terminal.

    Iterate it (``async for``) or call :meth:`get`. :meth:`offer` is how messages get in
    (the router calls it; tests may too): it returns whether the message was accepted.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        #: Newest attempt seen (None before the first message).
        self.attempt: int | None = None
        #: The accepted terminal, once there is one.
        self.terminal: Done | Error | None = None
        self._seen: set[int] = set()
        self._queue: asyncio.Queue[Reply] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        """True once a terminal was accepted: nothing more gets in."""
        return self.terminal is not None

    def offer(self, msg: Reply) -> bool:
        """Accept ``msg`` unless it is a duplicate, stale, foreign or after the terminal."""
        if msg.request_id != self.request_id or self.terminal is not None:
            return False
        if self.attempt is not None and msg.attempt < self.attempt:
            return False
        if self.attempt is None or msg.attempt > self.attempt:
            # A newer attempt supersedes everything seen of the older one.
            self.attempt = msg.attempt
            self._seen.clear()
        if isinstance(msg, TokenChunk):
            if msg.seq in self._seen:
                return False
            self._seen.add(msg.seq)
        else:
            self.terminal = msg
        self._queue.put_nowait(msg)
        return True

    async def get(self, timeout: float | None = None) -> Reply:
        """The next accepted message; ``TimeoutError`` when none comes within ``timeout``."""
        if timeout is None:
            return await self._queue.get()
        return await asyncio.wait_for(self._queue.get(), timeout)

    def get_nowait(self) -> Reply | None:
        """The next accepted message if one is waiting, else None."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def __aiter__(self) -> AsyncIterator[Reply]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Reply]:
        while True:
            msg = await self._queue.get()
            yield msg
            if not isinstance(msg, TokenChunk):
                return


class ReplyRouter:
    """One consumer on ``topic`` feeding the open :class:`ReplyStream` of each request.

    ``on_bad_record`` is awaited with records that do not decode (ingest dead-letters
    them); without it they are logged and skipped. ``consumer_options`` go to
    :func:`services.common.kafka.make_consumer`.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        on_bad_record: BadRecordHook | None = None,
        poll_timeout_s: float = 0.2,
        **consumer_options: Any,
    ) -> None:
        self.topic = topic
        self._bootstrap = bootstrap
        self._on_bad_record = on_bad_record
        self._poll_ms = int(poll_timeout_s * 1000)
        self._options = consumer_options
        self._streams: dict[str, ReplyStream] = {}
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None
        self._assigned = False

    @property
    def assigned(self) -> bool:
        """True once every partition is assigned and positioned at its end."""
        return self._assigned and self._task is not None and not self._task.done()

    @property
    def open_requests(self) -> int:
        return len(self._streams)

    async def start(self, timeout_s: float = 30.0) -> None:
        """Assign every partition of the topic at its current end, then start routing."""
        partitions = await topic_partitions(self._bootstrap, self.topic, timeout_s)
        consumer = make_consumer(self._bootstrap, **self._options)
        await consumer.start()
        try:
            tps = [TopicPartition(self.topic, p) for p in partitions]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            for tp in tps:
                # Resolve the lazy seek now: a reply produced after start() returns is read.
                await consumer.position(tp)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer
        self._assigned = True
        self._task = asyncio.create_task(self._run(), name=f"reply-router:{self.topic}")

    async def stop(self) -> None:
        """Stop routing and close the consumer; open streams get nothing more."""
        self._assigned = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def __aenter__(self) -> ReplyRouter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def open(self, request_id: str) -> ReplyStream:
        """Start waiting for ``request_id``; call before producing the request."""
        if request_id in self._streams:
            raise DuplicateRequestError(f"request {request_id!r} is already awaited")
        stream = ReplyStream(request_id)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        """Stop waiting for ``request_id`` (idempotent); later records of it are skipped."""
        self._streams.pop(request_id, None)

    def route(self, msg: Reply) -> bool:
        """Hand a decoded reply to its stream; False when nobody waits or it was a dup."""
        stream = self._streams.get(msg.request_id)
        return stream is not None and stream.offer(msg)

    async def _run(self) -> None:
        async for batches in fetch_forever(
            self._consumer, self._poll_ms, f"reply router {self.topic}"
        ):
            for records in batches.values():
                for record in records:
                    await self._handle(record)

    async def _handle(self, record: Any) -> None:
        key = record.key.decode(errors="replace") if record.key is not None else None
        if key is not None and key not in self._streams:
            return  # somebody else's request, or one we stopped waiting for
        try:
            msg: Reply = decode(record.value, REPLY_ADAPTER)
        except SchemaError as exc:
            _log.warning(
                "reply router %s: undecodable record %s/%s: %s",
                self.topic, record.partition, record.offset, exc,
            )
            if self._on_bad_record is not None:
                await self._on_bad_record(record, exc)
            return
        self.route(msg)


async def topic_partitions(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[int]:
    """Partition ids of ``topic``, waiting up to ``timeout_s`` for it to exist.

    Asks an admin client: a manually assigned consumer has no public way to load the
    metadata of a topic it does not subscribe to. (General; a candidate for
    services.common.kafka.)
    """
    deadline = time.monotonic() + timeout_s
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000)
    await asyncio.wait_for(admin.start(), timeout_s)
    try:
        while True:
            described = await admin.describe_topics([topic])
            partitions = sorted(
                p["partition"] for t in described if t["topic"] == topic and not t["error_code"]
                for p in t["partitions"]
            )
            if partitions:
                return partitions
            if time.monotonic() >= deadline:
                raise TimeoutError(f"topic {topic!r} has no partitions (does it exist?)")
            await asyncio.sleep(0.2)
    finally:
        await admin.close()
