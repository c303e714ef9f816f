"""Async client for llmq over Kafka: submit, stream the reply, cancel, time out.

A client produces :class:`~schemas.requests.InferenceRequest` records to ``llmq.intake``
and reads the replies of its tenant's reply topic (``{prefix}.replies.{tenant}``), through
one :class:`~services.common.replies.ReplyRouter` per client: chunks are deduplicated by
``(attempt, seq)``, older attempts are dropped, and the stream ends at exactly one terminal
(``Done`` or ``Error``). Usage::

    async with LlmqClient("127.0.0.1:9092", tenant="default") as client:
        handle = await client.submit(prompt="Hello", max_tokens=32, model="llama-3.1-8b")
        async for chunk in handle:
            print(chunk.text, end="")
        print(handle.result)          # Done or Error

A chunk whose ``attempt`` is higher than the previous chunk's means llmq restarted the
request (its worker was lost before llmq knew it had streamed): the text of the older
attempt is void. ``handle.wait()`` keeps only the newest attempt's text.

A request's own timeout ends it in llmq with ``Error(timeout)`` or ``queue_timeout`` at
``created_at + timeout_s``, plus a dispatch cycle and the delivery. The client waits for
that terminal ``reply_grace_s`` longer (like ingest.http); only when that passes too does it
send a cancel and raise ``TimeoutError``. Leaving the ``async for`` early does not cancel —
call ``handle.cancel()`` for that. The wait is measured on this machine's monotonic clock
from the moment of ``submit``, so a step of the wall clock (NTP, a resumed VM) does not end
it; but llmq's deadline runs from ``created_at``, this machine's wall-clock time, so a clock
running ahead of llmq's by more than ``reply_grace_s`` gives up before llmq answers.

A handle nobody reads to its end (a caller cancelled, or that stopped iterating) is
forgotten a minute after it would have given up: its stream is closed and its replies
dropped. ``handle.close()`` (or ``async with handle``) forgets it at once, without
cancelling the request.

Request ids: ``submit()`` makes a new one unless given one. Retry a refused or failed
request with a new id: a second delivery of the first refusal (Kafka delivers at least
once) would otherwise end the retry too, and after a ``submit()`` that failed or was
cancelled mid-send the client asks llmq to cancel the id, as the request may still have
been delivered.

With a tenants file (keyed mode), a tenant the file does not list gets no reply at all:
ingest dead-letters its requests (a reply topic per unknown name would let any client make
topics), so its handles end with ``TimeoutError`` after ``timeout_s`` + ``reply_grace_s``.
Check the tenant's name when every request of a client times out.

``stop()`` ends the streams of open handles: once the replies already received are read,
iterating raises :class:`~services.common.replies.StreamClosed` (a ``RuntimeError``) at
once; ``cancel()`` and ``submit()`` on a stopped client raise ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.codec import encode
from schemas.common import Lane, Priority
from schemas.control import CancelRequest
from schemas.replies import Done, Error, TokenChunk
from schemas.requests import ChatMessage, InferenceRequest, Role
from schemas.topics import INSTANCE_REPLIES, catalog, message_key, reply_spec
from services.common.kafka import TopicRequest, ensure_topics, make_producer, topic_exists
from services.common.replies import AttemptText, ReplyRouter, ReplyStream

_log = logging.getLogger(__name__)

#: How much longer than ``timeout_s`` a client waits for llmq's own terminal by default:
#: the same as ingest.http's ``reply_grace_s`` (services/ingest/settings.py), and longer
#: than a worker goes on sending a terminal past the deadline (``give_up_after_s``, 12 s):
#: at 10 s a Done sent again after a broker blip could land after the client gave up, its
#: tokens charged and its caller told TimeoutError (found by an audit).
DEFAULT_REPLY_GRACE_S = 15.0
#: A handle still unread this long after it would have given up is forgotten (its reader
#: would have given up first: only abandoned handles reach it).
ABANDONED_AFTER_S = 60.0
#: How long a cancel or a request send may take.
SEND_TIMEOUT_S = 30.0


class TopicMissing(RuntimeError):
    """llmq's intake topic is not on the broker: llmq was never started there, or it
    runs with another topic prefix. Raised by :meth:`LlmqClient.start` at once (a send
    would wait for the topic's metadata until the producer's timeout, then fail)."""


@dataclass
class RequestHandle:
    """One submitted request: iterate its chunks; ``result`` holds the terminal."""

    request: InferenceRequest
    stream: ReplyStream
    client: LlmqClient
    timeout_s: float
    #: Waited past ``timeout_s`` for llmq's own terminal (its timeout error) to arrive.
    reply_grace_s: float
    submitted_at: float = field(default_factory=time.time)
    result: Done | Error | None = None
    first_token_at: float | None = None
    #: When to give up, on ``time.monotonic()`` (module docstring); None: worked out from
    #: the request's ``created_at`` now (``submit`` gives it, from before its send).
    give_up_at: float | None = None
    #: True once it gave up (TimeoutError): later reads raise at once, and send nothing.
    given_up: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.give_up_at is None:
            self.give_up_at = give_up_time(self.request, self.timeout_s, self.reply_grace_s)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._chunks()

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop waiting for the request here (its replies are dropped from now on); does
        not cancel it in llmq (:meth:`cancel` does). Idempotent."""
        self.client._router_close(self.request_id, self.stream)
        self.stream.close("closed by its caller")

    async def _chunks(self) -> AsyncIterator[TokenChunk]:
        try:
            if self.given_up:
                raise TimeoutError
            assert self.give_up_at is not None  # __post_init__
            while self.result is None:
                remaining = self.give_up_at - time.monotonic()
                if remaining > 0:
                    msg = await self.stream.get(timeout=remaining)
                else:  # what already came is still this request's, read late or not
                    waiting = self.stream.get_nowait()
                    if waiting is None:
                        raise TimeoutError
                    msg = waiting
                if isinstance(msg, TokenChunk):
                    if self.first_token_at is None:
                        self.first_token_at = time.time()
                    yield msg
                else:
                    self.result = msg
        except TimeoutError:
            # Given up, once: stop routing its replies here (a retry may reuse the id), and
            # ask llmq to drop it. (Leaving the loop early keeps the stream: iterate again.)
            if not self.given_up:
                self.given_up = True
                self.client._router_close(self.request_id, self.stream)
                if self.stream.closed is None:  # a stopped client has nothing to cancel with
                    self.stream.close("gave up waiting")
                    try:
                        await self.client.cancel(self.request_id, "client timeout")
                    except Exception as exc:  # the timeout is the news, not the cancel's
                        _log.warning("request %s: its cancel after the timeout failed: %r",
                                     self.request_id, exc)
            raise TimeoutError(
                f"no terminal reply for {self.request_id} within its timeout of "
                f"{_seconds(self.timeout_s)} (and {_seconds(self.reply_grace_s)} of grace)"
            ) from None
        finally:
            if self.result is not None:
                self.client._router_close(self.request_id, self.stream)

    async def wait(self) -> tuple[str, Done | Error]:
        """Collect the text of the newest attempt and the terminal message."""
        text = AttemptText()
        async for chunk in self:
            text.add(chunk)
        assert self.result is not None
        text.add(self.result)  # a newer attempt that sent no chunk voids the older text
        return text.text, self.result

    async def cancel(self, reason: str = "cancelled by client") -> None:
        """Ask llmq to drop or abort the request (idempotent); its terminal is `cancelled`.
        Sends nothing once the handle has its terminal or gave up (a cancel by id would
        hit a retry that reuses the id)."""
        if self.result is None and not self.given_up:
            await self.client.cancel(self.request_id, reason)


def give_up_time(request: InferenceRequest, timeout_s: float, grace_s: float) -> float:
    """When a handle gives up, on ``time.monotonic()``: llmq's deadline runs from the
    request's ``created_at`` (wall clock), and its terminal for it comes a little later."""
    return time.monotonic() + request.created_at + timeout_s - time.time() + grace_s


def _seconds(value: float) -> str:
    """A duration for a message: 0.25 s, 2.5 s, 120 s."""
    return f"{round(value, 3):g} s"


class LlmqClient:
    """Submits requests for one tenant and routes the tenant's replies to their handles.

    ``reply_grace_s`` (≥ 0, default :data:`DEFAULT_REPLY_GRACE_S`): how long past a
    request's ``timeout_s`` its handle still waits for llmq's own terminal before it gives
    up, cancels and raises ``TimeoutError``. ``replication_factor``: replicas of the reply
    topic if :meth:`start` has to create it (``LLMQ_REPLICATION_FACTOR`` of the services).
    """

    def __init__(
        self,
        bootstrap: str,
        *,
        tenant: str = "default",
        prefix: str = "llmq",
        default_model: str = "llama-3.1-8b",
        reply_grace_s: float = DEFAULT_REPLY_GRACE_S,
        replication_factor: int = 1,
    ) -> None:
        if not reply_grace_s >= 0:
            raise ValueError(f"reply_grace_s must be >= 0, not {reply_grace_s}")
        if tenant.startswith(INSTANCE_REPLIES):
            # Its reply topic would be an ingest instance's; ingest dead-letters such
            # requests unanswered, and every handle would wait out its whole timeout.
            raise ValueError(f"tenant names starting {INSTANCE_REPLIES!r} are reserved for "
                             f"ingest's own reply topics: {tenant!r}")
        self.bootstrap = bootstrap
        self.replication_factor = replication_factor
        self.reply_grace_s = reply_grace_s
        self.tenant = tenant
        self.prefix = prefix
        self.default_model = default_model
        self._spec = reply_spec(prefix, tenant)
        self._intake = next(s.name for s in catalog(prefix) if s.name.endswith(".intake"))
        self._control = next(s.name for s in catalog(prefix) if s.name.endswith(".control"))
        self._router = ReplyRouter(bootstrap, self._spec.name)
        self._producer: Any = None
        self._starting = False
        #: Cancels sent after a failed submit, awaited by stop().
        self._cancels: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Make the tenant's reply topic if need be and start reading it; raises
        :class:`TopicMissing` when llmq's intake topic is not on the broker, and
        ``RuntimeError`` when already started (``start()`` and then ``async with``)."""
        if self._producer is not None or self._starting:
            raise RuntimeError("LlmqClient is already started")
        self._starting = True
        try:
            await self._start()
        finally:
            self._starting = False

    async def _start(self) -> None:
        if not await topic_exists(self.bootstrap, self._intake):  # before making anything
            raise TopicMissing(
                f"Kafka at {self.bootstrap} has no topic {self._intake}: start llmq there "
                f"(`llmq up`), or use the topic prefix it runs with (not {self.prefix!r}?)")
        await ensure_topics(
            self.bootstrap,
            [TopicRequest(self._spec.name, self._spec.partitions, self._spec.config)],
            replication_factor=self.replication_factor,
        )
        producer = make_producer(self.bootstrap)
        await producer.start()
        try:
            await self._router.start()
        except BaseException:
            await producer.stop()
            raise
        self._producer = producer  # only now: submit() says "not running" until here

    async def stop(self) -> None:
        """Stop reading replies and producing; open handles end with ``StreamClosed``
        (all of it even when one part fails to stop: that error is raised after)."""
        try:
            if self._cancels:  # each bounded by SEND_TIMEOUT_S
                await asyncio.gather(*self._cancels, return_exceptions=True)
            await self._router.stop()
        finally:
            self._router.close_all("LlmqClient was stopped: no more replies will come")
            producer, self._producer = self._producer, None
            if producer is not None:
                await producer.stop()

    async def __aenter__(self) -> LlmqClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def new_request(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[tuple[Role, str]] | None = None,
        max_tokens: int = 128,
        model: str | None = None,
        priority: Priority = "normal",
        lane: Lane | None = None,
        timeout_s: float = 600.0,
        request_id: str | None = None,
    ) -> InferenceRequest:
        """The request :meth:`submit` would send (a new id unless given), validated:
        ``ValidationError`` naming the field the wire refuses. Needs no running client.
        A ``request_id`` of your own must be unique; one with ``:`` must begin with
        ``<tenant>:`` (ingest refuses ids scoped to another tenant)."""
        return InferenceRequest(
            request_id=f"req-{uuid.uuid4().hex}" if request_id is None else request_id,
            tenant=self.tenant,
            model=model or self.default_model,
            prompt=prompt,
            messages=(
                tuple(ChatMessage(role=r, content=c) for r, c in messages)
                if messages is not None
                else None
            ),
            max_tokens=max_tokens,
            priority=priority,
            lane=lane,
            timeout_s=timeout_s,
            reply_to=self._spec.name,
            created_at=time.time(),
        )

    async def submit(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[tuple[Role, str]] | None = None,
        max_tokens: int = 128,
        model: str | None = None,
        priority: Priority = "normal",
        lane: Lane | None = None,
        timeout_s: float = 600.0,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Produce one request to ``llmq.intake``; returns its handle (not yet finished).
        ``ValidationError`` for arguments the wire refuses, before anything is sent."""
        if self._producer is None:
            raise RuntimeError("LlmqClient is not running (start() not called, or stopped)")
        request = self.new_request(prompt=prompt, messages=messages, max_tokens=max_tokens,
                                   model=model, priority=priority, lane=lane,
                                   timeout_s=timeout_s, request_id=request_id)
        give_up_at = give_up_time(request, timeout_s, self.reply_grace_s)
        stream = self._router.open(request.request_id,
                                   expires_at=give_up_at + ABANDONED_AFTER_S)
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await self._producer.send_and_wait(
                    self._intake, encode(request), key=message_key(request))
        except BaseException:
            self._router.close(request.request_id, stream)
            stream.close("its submit failed")
            # The record may be in a batch the producer still delivers (a cancelled or
            # timed-out wait does not take it back): ask llmq to drop it, in the background.
            self._cancel_soon(request.request_id, "client: submit failed or cancelled")
            raise
        return RequestHandle(request, stream, self, timeout_s, self.reply_grace_s,
                             give_up_at=give_up_at)

    def _cancel_soon(self, request_id: str, reason: str) -> None:
        async def cancel() -> None:
            try:
                await self.cancel(request_id, reason)
            except Exception as exc:  # best effort: the submit's own error is the news
                _log.warning("request %s: its cancel after a failed submit failed: %r",
                             request_id, exc)

        task = asyncio.get_running_loop().create_task(cancel())
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def cancel(self, request_id: str, reason: str = "cancelled by client") -> None:
        """Ask llmq to drop or abort ``request_id``; ``RuntimeError`` when not running."""
        if self._producer is None:
            raise RuntimeError(
                f"LlmqClient is not running: cannot cancel {request_id} (stopped?)"
            )
        cancel = CancelRequest(
            request_id=request_id,
            tenant=self.tenant,
            reason=reason,
            issued_by="client",
            issued_at=time.time(),
        )
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await self._producer.send_and_wait(self._control, encode(cancel),
                                               key=message_key(cancel))

    def _router_close(self, request_id: str, stream: ReplyStream) -> None:
        self._router.close(request_id, stream)
