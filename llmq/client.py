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

``timeout_s`` bounds the wait for the terminal; when it passes, the client sends a cancel
and raises ``TimeoutError``. Leaving the ``async for`` early does not cancel — call
``handle.cancel()`` for that.
"""

from __future__ import annotations

import asyncio
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
from schemas.topics import catalog, message_key, reply_spec
from services.common.kafka import TopicRequest, ensure_topics, make_producer
from services.common.replies import ReplyRouter, ReplyStream


@dataclass
class RequestHandle:
    """One submitted request: iterate its chunks; ``result`` holds the terminal."""

    request: InferenceRequest
    stream: ReplyStream
    client: LlmqClient
    timeout_s: float
    submitted_at: float = field(default_factory=time.time)
    result: Done | Error | None = None
    first_token_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[TokenChunk]:
        deadline = self.submitted_at + self.timeout_s
        try:
            while self.result is None:
                remaining = deadline - time.time()
                if remaining <= 0:
                    raise TimeoutError
                msg = await self.stream.get(timeout=remaining)
                if isinstance(msg, TokenChunk):
                    if self.first_token_at is None:
                        self.first_token_at = time.time()
                    yield msg
                else:
                    self.result = msg
        except TimeoutError:
            # Given up: stop routing its replies here (a retry may reuse the id), and ask
            # llmq to drop it. (Leaving the loop early keeps the stream: iterate again.)
            self.client._router_close(self.request_id)
            await self.cancel("client timeout")
            raise TimeoutError(
                f"no terminal reply for {self.request_id} within {self.timeout_s:.0f} s"
            ) from None
        finally:
            if self.result is not None:
                self.client._router_close(self.request_id)

    async def wait(self) -> tuple[str, Done | Error]:
        """Collect the whole text and the terminal message."""
        parts = [chunk.text async for chunk in self]
        assert self.result is not None
        return "".join(parts), self.result

    async def cancel(self, reason: str = "cancelled by client") -> None:
        """Ask llmq to drop or abort the request (idempotent); its terminal is `cancelled`."""
        await self.client.cancel(self.request_id, reason)


class LlmqClient:
    """Submits requests for one tenant and routes the tenant's replies to their handles."""

    def __init__(
        self,
        bootstrap: str,
        *,
        tenant: str = "default",
        prefix: str = "llmq",
        default_model: str = "llama-3.1-8b",
    ) -> None:
        self.bootstrap = bootstrap
        self.tenant = tenant
        self.prefix = prefix
        self.default_model = default_model
        self._spec = reply_spec(prefix, tenant)
        self._intake = next(s.name for s in catalog(prefix) if s.name.endswith(".intake"))
        self._control = next(s.name for s in catalog(prefix) if s.name.endswith(".control"))
        self._router = ReplyRouter(bootstrap, self._spec.name)
        self._producer: Any = None

    async def start(self) -> None:
        await ensure_topics(
            self.bootstrap,
            [TopicRequest(self._spec.name, self._spec.partitions, self._spec.config)],
        )
        self._producer = make_producer(self.bootstrap)
        await self._producer.start()
        try:
            await self._router.start()
        except BaseException:
            await self._producer.stop()
            raise

    async def stop(self) -> None:
        await self._router.stop()
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def __aenter__(self) -> LlmqClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

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
        """Produce one request to ``llmq.intake``; returns its handle (not yet finished)."""
        if self._producer is None:
            raise RuntimeError("LlmqClient.start() was not called")
        request = InferenceRequest(
            request_id=request_id or f"req-{uuid.uuid4().hex}",
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
        stream = self._router.open(request.request_id)
        try:
            await asyncio.wait_for(
                self._producer.send_and_wait(
                    self._intake, encode(request), key=message_key(request)
                ),
                30.0,
            )
        except BaseException:
            self._router.close(request.request_id)
            raise
        return RequestHandle(request, stream, self, timeout_s)

    async def cancel(self, request_id: str, reason: str = "cancelled by client") -> None:
        cancel = CancelRequest(
            request_id=request_id,
            tenant=self.tenant,
            reason=reason,
            issued_by="client",
            issued_at=time.time(),
        )
        await asyncio.wait_for(
            self._producer.send_and_wait(self._control, encode(cancel), key=message_key(cancel)),
            30.0,
        )

    def _router_close(self, request_id: str) -> None:
        self._router.close(request_id)
