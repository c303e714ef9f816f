"""The HTTP side's Kafka edge: produce requests to intake, read this instance's replies,
send cancels.

One producer (idempotent, acks=all) and one :class:`~services.common.replies.ReplyRouter`
on the instance's own reply topic. :meth:`Gateway.submit` opens the reply stream *before*
producing, so no reply can be missed; a request counts as queued only once the broker
acknowledged it (else 503). Cancels for disconnected clients are fire-and-forget tasks:
they are sent from places where the caller is itself being cancelled.

A client-chosen id (``x-request-id``) whose call ended, answered or abandoned, is refused
to a new call for :data:`REUSE_GUARD_S` (409). Downstream, the id is still taken: until
its reservation is settled, intake would drop the new call's record as a redelivery of the
old one (the call would wait for replies that came already, or get the old one's
``cancelled``), and later the scheduler refuses it as a reuse. Only this instance's own
calls are known here.

A producer that can no longer send (:class:`services.common.kafka.Producer`) makes the
gateway not ready and calls ``on_failure``; ``python -m services.ingest`` exits with it at
once (:func:`services.common.kafka.exit_now`), so a supervisor restarts the instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiokafka.errors import KafkaError

from schemas.codec import SchemaError, encode
from schemas.control import CancelRequest
from schemas.requests import InferenceRequest
from services.common.guard import Guard, Headers, aiokafka_dead_letter
from services.common.kafka import ProducerFailed, make_producer
from services.common.replies import DuplicateRequestError, ReplyRouter, ReplyStream
from services.ingest.http.errors import ApiError, unavailable
from services.ingest.topics import IngestTopics

_log = logging.getLogger(__name__)
_SEND_TIMEOUT_S = 10.0
#: How long a client-chosen id whose call ended stays refused to new calls, in seconds.
REUSE_GUARD_S = 60.0


class Gateway:
    """Submit requests and read their replies; started and stopped with the HTTP app."""

    def __init__(self, bootstrap: str, topics: IngestTopics, *, instance_id: str,
                 on_failure: Callable[[ProducerFailed], None] | None = None) -> None:
        self.topics = topics
        self._on_failure = on_failure
        self.instance_id = instance_id
        self._bootstrap = bootstrap
        self._producer: Any = None
        self._router: ReplyRouter | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Client-chosen ids whose call ended -> when (monotonic), oldest first.
        self._ended: dict[str, float] = {}

    @property
    def producer_ready(self) -> bool:
        return self._producer is not None and self._producer.failure is None

    @property
    def replies_ready(self) -> bool:
        return self._router is not None and self._router.assigned

    @property
    def ready(self) -> bool:
        return self.producer_ready and self.replies_ready

    async def start(self) -> None:
        producer = make_producer(self._bootstrap, on_failure=self._on_failure)
        await producer.start()
        guard = Guard(aiokafka_dead_letter(producer, self.topics.deadletter),
                      name="ingest.replies", logger=_log)

        async def dead_letter(record: Any, exc: SchemaError) -> None:
            await guard.dead_letter(record, exc)

        router = ReplyRouter(self._bootstrap, self.topics.reply, on_bad_record=dead_letter)
        try:
            await router.start()
        except BaseException:
            await producer.stop()
            raise
        self._producer, self._router = producer, router

    async def stop(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=_SEND_TIMEOUT_S)
        if self._router is not None:
            await self._router.stop()
            self._router = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def submit(
        self, request: InferenceRequest, headers: Headers | None = None, *,
        client_id: bool = False,
    ) -> ReplyStream:
        """Queue ``request`` on intake (with ``headers``: its trace context); its replies
        arrive on the returned stream. ``client_id``: the client chose the request id, so
        its retry after a failed send reuses it (see :meth:`_unsure`)."""
        if client_id and self._ended_recently(request.request_id, time.monotonic()):
            shown = request.request_id.split(":", 1)[-1]
            raise ApiError(409, f"request id {shown!r} was used by a call that ended less "
                           f"than {REUSE_GUARD_S:g} s ago; request ids must be unique: send "
                           "it with a new one", "duplicate_request", "x-request-id")
        if self._router is None or self._producer is None:
            raise unavailable("ingest is not connected to Kafka yet")
        try:
            stream = self._router.open(request.request_id)
        except DuplicateRequestError:
            shown = request.request_id.split(":", 1)[-1]  # the caller's own id (scoped)
            raise ApiError(409, f"request {shown!r} is already in progress",
                           "duplicate_request", "x-request-id") from None
        try:
            await asyncio.wait_for(
                self._producer.send_and_wait(
                    self.topics.intake, encode(request), key=request.tenant.encode(),
                    headers=headers or None,
                ),
                _SEND_TIMEOUT_S,
            )
        except (KafkaError, TimeoutError) as exc:
            _log.warning("could not queue %s: %r", request.request_id, exc)
            if client_id:
                # The retry reuses the id: a cancel would hit it. If this copy landed, intake
                # takes the retry for a redelivery (not admitted twice) and its replies reach
                # the retry's stream.
                self.close(request.request_id)
            else:
                self._unsure(request, "ingest could not confirm it was queued; retried")
            raise unavailable("could not queue the request on Kafka; retry") from None
        except BaseException:
            self._unsure(request, "the client left while it was being queued")
            if client_id:
                # Cancelled, and the copy has likely landed: a retry with the same id
                # would get that copy's `cancelled` (replies go by id). Refused (409) for
                # a while, as after any call that ended (found by an audit).
                self.ended(request.request_id, client_id=True)
            raise
        return stream

    def _unsure(self, request: InferenceRequest, reason: str) -> None:
        """Stop waiting for a request whose send failed or was abandoned midway. The
        record may be on Kafka all the same (a timed-out send can still land): cancel it,
        so it does not run for nobody, or twice when the client retries (with a new id:
        ingest chose this one)."""
        self.close(request.request_id)
        self.cancel_soon(request.request_id, request.tenant, reason, time.time())

    def close(self, request_id: str) -> None:
        """Stop waiting for ``request_id``'s replies."""
        if self._router is not None:
            self._router.close(request_id)

    def ended(self, request_id: str, *, client_id: bool) -> None:
        """The call of ``request_id`` ended, answered or abandoned: stop waiting for its
        replies and, for a client-chosen id, refuse it to new calls for a while."""
        self.close(request_id)
        if client_id:
            self._ended.pop(request_id, None)  # re-inserted last: the dict stays in time order
            self._ended[request_id] = time.monotonic()

    def _ended_recently(self, request_id: str, now: float) -> bool:
        while self._ended:
            oldest = next(iter(self._ended))
            if now - self._ended[oldest] <= REUSE_GUARD_S:
                break
            del self._ended[oldest]
        return request_id in self._ended

    def cancel_soon(self, request_id: str, tenant: str, reason: str, now: float) -> None:
        """Send a ``CancelRequest`` in the background (the caller may be cancelled itself)."""
        cancel = CancelRequest(request_id=request_id, tenant=tenant, reason=reason[:4096],
                               issued_by="ingest", issued_at=now)
        task = asyncio.create_task(self._send_cancel(cancel), name=f"cancel:{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_cancel(self, cancel: CancelRequest) -> None:
        if self._producer is None:
            return
        try:
            await asyncio.wait_for(
                self._producer.send_and_wait(
                    self.topics.control, encode(cancel), key=cancel.request_id.encode()
                ),
                _SEND_TIMEOUT_S,
            )
        except (KafkaError, TimeoutError):
            _log.warning("could not send cancel for %s", cancel.request_id, exc_info=True)
