"""Reading a reply topic: one consumer routes records to per-request streams.

Shared by ingest.http and the client SDK. A process that waits for many requests on one
reply topic runs one :class:`ReplyRouter` (a single consumer, no consumer group: it reads
every partition from the end, so it must be started before the first request is sent).
For each request it waits on, it calls :meth:`ReplyRouter.open` *before* producing the
request and reads the returned :class:`ReplyStream`; records of requests nobody waits for
are skipped without decoding (the record key is the request_id).

Delivery is at-least-once, so the stream applies the client rules of
docs/live-system.md: keep the newest attempt (anything of an older attempt is dropped,
including what of it is still queued unread), drop chunks whose ``(attempt, seq)`` was
seen, and end at the first terminal (``Done`` or ``Error``) of the newest attempt. A
terminal of attempt 0 is ingest's (or the scheduler's) refusal before any worker ran the
request. Chunks come out in ``seq`` order: one that arrives ahead of a missing one is held
until the gap fills (a worker sends a chunk whose delivery failed again before its reply,
so after the chunks that followed it), or until the terminal, which lets what is held out
first.

A reader may already have taken chunks of an attempt that a newer one then supersedes (a
worker's chunk landed but not its ``first_token`` event before it died, so the scheduler
requeued the request): their text is void. :class:`AttemptText` joins the text of the
newest attempt; a reader that passed text on already (a started SSE stream) cannot take it
back and must end the call instead.

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
import heapq
import itertools
import logging
import time
import weakref
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


class StreamClosed(RuntimeError):
    """The stream was ended where it is read (:meth:`ReplyStream.close`, e.g. its client
    stopped): no more replies will come."""


class _Closed:
    """Queued after the last reply of a closed stream."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class ReplyStream:
    """The deduplicated replies of one request, in order, ending with its terminal.

    Iterate it (``async for``) or call :meth:`get`. :meth:`offer` is how messages get in
    (the router calls it; tests may too): it returns whether the message was accepted.
    After :meth:`close`, the replies already accepted are still read, then reading raises
    :class:`StreamClosed`.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        #: Newest attempt seen (None before the first message).
        self.attempt: int | None = None
        #: The accepted terminal, once there is one.
        self.terminal: Done | Error | None = None
        #: Why the stream was closed locally (None: it was not).
        self.closed: str | None = None
        self._seen: set[int] = set()
        #: The seq the reader gets next, and chunks that came ahead of it.
        self._next_seq = 0
        self._ahead: dict[int, TokenChunk] = {}
        self._queue: asyncio.Queue[Reply | _Closed] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        """True once a terminal was accepted: nothing more gets in."""
        return self.terminal is not None

    def offer(self, msg: Reply) -> bool:
        """Accept ``msg`` unless it is a duplicate, stale, foreign, after the terminal or
        after :meth:`close`."""
        if (msg.request_id != self.request_id or self.terminal is not None
                or self.closed is not None):
            return False
        if self.attempt is not None and msg.attempt < self.attempt:
            return False
        if self.attempt is None or msg.attempt > self.attempt:
            # A newer attempt supersedes everything of the older one: what was seen, and
            # what is queued unread (all of it is older: the attempt only goes up).
            self.attempt = msg.attempt
            self._seen.clear()
            self._next_seq = 0
            self._ahead.clear()
            while not self._queue.empty():
                self._queue.get_nowait()
        if isinstance(msg, TokenChunk):
            if msg.seq in self._seen:
                return False
            self._seen.add(msg.seq)
            self._ahead[msg.seq] = msg
            while self._next_seq in self._ahead:
                self._queue.put_nowait(self._ahead.pop(self._next_seq))
                self._next_seq += 1
            return True
        self.terminal = msg
        for seq in sorted(self._ahead):  # a gap no chunk will fill any more
            self._queue.put_nowait(self._ahead[seq])
        self._ahead.clear()
        self._queue.put_nowait(msg)
        return True

    def close(self, reason: str) -> None:
        """End the stream here (idempotent): nothing more gets in; once what was accepted
        is read, readers (those waiting now too) get :class:`StreamClosed` with ``reason``."""
        if self.closed is None:
            self.closed = reason
            self._queue.put_nowait(_Closed(reason))

    async def get(self, timeout: float | None = None) -> Reply:
        """The next accepted message; ``TimeoutError`` when none comes within ``timeout``,
        :class:`StreamClosed` after :meth:`close`."""
        if timeout is None:
            msg = await self._queue.get()
        else:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that
            # comes as a reply does (gh-86296), and the caller would wait on.
            async with asyncio.timeout(timeout):
                msg = await self._queue.get()
        return self._opened(msg)

    def get_nowait(self) -> Reply | None:
        """The next accepted message if one is waiting, else None (:class:`StreamClosed`
        after :meth:`close`)."""
        try:
            return self._opened(self._queue.get_nowait())
        except asyncio.QueueEmpty:
            return None

    def _opened(self, msg: Reply | _Closed) -> Reply:
        if isinstance(msg, _Closed):
            self._queue.put_nowait(msg)  # every later read ends the same way
            raise StreamClosed(msg.reason)
        return msg

    def __aiter__(self) -> AsyncIterator[Reply]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Reply]:
        while True:
            msg = await self.get()
            yield msg
            if not isinstance(msg, TokenChunk):
                return


class AttemptText:
    """The text of a request's newest attempt, joined from the replies a reader took.

    Feed it every reply (:meth:`add`): a message of a newer attempt voids the text of the
    older one (DESIGN.md: clients keep the newest attempt), one of an older attempt is
    ignored.
    """

    def __init__(self) -> None:
        #: Attempt of the text held (None before the first reply).
        self.attempt: int | None = None
        self._parts: list[str] = []

    def add(self, msg: Reply) -> None:
        if self.attempt is not None and msg.attempt < self.attempt:
            return
        if self.attempt is not None and msg.attempt > self.attempt:
            self._parts.clear()
        self.attempt = msg.attempt
        if isinstance(msg, TokenChunk):
            self._parts.append(msg.text)

    @property
    def text(self) -> str:
        return "".join(self._parts)


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
        #: (expires_at, n, request_id, stream) of streams opened with an expiry, soonest
        #: first; weak, so a stream closed and dropped by its reader is not kept.
        self._expiry: list[tuple[float, int, str, weakref.ref[ReplyStream]]] = []
        self._order = itertools.count()
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
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """Say so when routing stops on an error (fetch_forever rides out Kafka's own): its
        waiters get nothing more, and ``assigned`` turns False."""
        if not task.cancelled() and task.exception() is not None:
            _log.error("reply router %s stopped: %r; its %d waiters get no more replies",
                       self.topic, task.exception(), len(self._streams),
                       exc_info=task.exception())

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

    def open(self, request_id: str, *, expires_at: float | None = None) -> ReplyStream:
        """Start waiting for ``request_id``; call before producing the request.

        ``expires_at`` (``time.monotonic()``): when to close and forget the stream, read to
        its end or not. A waiter abandoned unread (a caller cancelled, or that stopped
        iterating) otherwise kept its stream, and every reply that came for it, for the
        router's life, and its id stayed taken."""
        self.expire(time.monotonic())
        if request_id in self._streams:
            raise DuplicateRequestError(f"request {request_id!r} is already awaited")
        stream = ReplyStream(request_id)
        self._streams[request_id] = stream
        if expires_at is not None:
            heapq.heappush(self._expiry,
                           (expires_at, next(self._order), request_id, weakref.ref(stream)))
        return stream

    def close(self, request_id: str, stream: ReplyStream | None = None) -> None:
        """Stop waiting for ``request_id`` (idempotent); later records of it are skipped.
        With ``stream``, only if that is still the one open for the id: a reader of an old
        stream must not end a newer request that reuses the id (a retry)."""
        if stream is None or self._streams.get(request_id) is stream:
            self._streams.pop(request_id, None)

    def expire(self, now: float) -> None:
        """Close and forget the streams whose ``expires_at`` is ``now`` or earlier."""
        while self._expiry and self._expiry[0][0] <= now:
            _, _, request_id, ref = heapq.heappop(self._expiry)
            stream = ref()
            if stream is not None:
                self.close(request_id, stream)
                stream.close("expired: its reader never took its terminal")

    def close_all(self, reason: str) -> None:
        """Stop waiting for every request and :meth:`ReplyStream.close` their streams, so
        that their readers end (with :class:`StreamClosed`) instead of waiting on."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.close(reason)

    def route(self, msg: Reply) -> bool:
        """Hand a decoded reply to its stream; False when nobody waits or it was a dup."""
        stream = self._streams.get(msg.request_id)
        return stream is not None and stream.offer(msg)

    async def _run(self) -> None:
        async for batches in fetch_forever(
            self._consumer, self._poll_ms, f"reply router {self.topic}"
        ):
            self.expire(time.monotonic())
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
