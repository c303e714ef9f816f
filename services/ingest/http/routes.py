"""The FastAPI app: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/healthz``, ``/readyz``.

A completion call: authenticate (API key → tenant), map the body to an
``InferenceRequest`` (:mod:`.openai`; a ``max_tokens`` the body does not set is the
endpoint's default, lowered to the rest of the model's context when the prompt leaves less,
as vLLM does), submit it through intake like any Kafka client's
(:class:`.gateway.Gateway`), then wait for the first reply *before* answering, so that a
refusal (429, 404, 413, 503 ...) gets its own status and Retry-After even for a stream.
After that, chunks are relayed as they come (SSE) or gathered until ``Done``.

Tracing: each call is one SERVER span (``POST /v1/...``), the root of the request's trace
unless the client sent a W3C ``traceparent`` header (then its child). The intake record
carries the span's context, so admission, queueing and generation hang below it; it ends
when the call does, with the outcome and, for a finished request, its token usage.

Time bound: the request's ``timeout_s`` plus ``reply_grace_s``; past it the client gets
504 and the request is cancelled. A client that goes away (while its call waits for a reply,
a stream's first one included, or mid-stream) also cancels it (``CancelRequest`` on
``llmq.control``). A stream that ends in an error (an ``Error`` reply, or the deadline, after
it started) sends the error event, then ``data: [DONE]`` like any other stream.

Restarts: llmq may run a request again (attempt + 1) after a chunk of the older attempt was
relayed (its worker died before its ``first_token`` event landed). A gathered answer keeps
the newest attempt's text only. A started stream cannot take back what it sent: it ends with
a ``worker_lost`` error event and ``[DONE]``, and the request is cancelled (the client
retries); a restart before any text was sent just carries on.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from schemas.base import ID_PATTERN
from schemas.codec import MAX_RECORD_BYTES
from schemas.replies import Done, Error, TokenChunk
from services.common import tracing
from services.common.metrics import HTTP_RESPONSES
from services.common.replies import AttemptText, Reply, ReplyStream
from services.ingest.cluster import ClusterWatcher
from services.ingest.core import (
    TokenCounter,
    counter_for,
    fitted_max_tokens,
    may_use_model,
    request_prompt_tokens,
)
from services.ingest.http.errors import (
    ApiError,
    from_reply,
    timed_out,
    too_large,
    unauthorized,
)
from services.ingest.http.gateway import Gateway
from services.ingest.http.openai import (
    SSE_DONE,
    ApiDefaults,
    Kind,
    Origin,
    ParsedCall,
    chunk_object,
    completion_object,
    parse_json,
    sse,
    to_inference_request,
    usage_chunk,
)
from services.ingest.tenants import AuthFailure, Tenancy

#: The largest body read. A request becomes one Kafka record of at most MAX_RECORD_BYTES
#: (8 MiB); 4x that leaves room for a body that spells its text in JSON escapes (6 bytes
#: for "\u00e9", 2 in the record). Past it the body is refused before it is all read.
MAX_BODY_BYTES = 4 * MAX_RECORD_BYTES

#: How often a call that waits for a reply checks that its client is still there (a
#: started stream is watched by its response instead).
_DISCONNECT_POLL_S = 1.0
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True, slots=True)
class HttpDeps:
    """Everything the routes use, built once in ``services.ingest.__main__``."""

    gateway: Gateway
    tenancy: Tenancy
    watcher: ClusterWatcher
    defaults: ApiDefaults
    reply_grace_s: float
    clock: Callable[[], float] = time.time
    #: Exact prompt counters by canonical model name (the rest use the byte estimate),
    #: as admission counts: a defaulted max_tokens is fitted to the same count.
    counters: Mapping[str, TokenCounter] = field(default_factory=dict)


class _ClientGone(Exception):
    """The HTTP client disconnected while we waited for its replies."""


class _Waiter:
    """Next reply of one call, bounded by its deadline, noticing a vanished client.

    The client is looked for every ``_DISCONNECT_POLL_S`` whether replies come or not: a
    gathered (non-streaming) answer receives chunks faster than that for as long as the
    model generates, and a client that left meanwhile must still cancel its request.
    """

    def __init__(self, stream: ReplyStream, request: Request | None, deadline: float) -> None:
        self._stream = stream
        self._request = request  # None: do not poll (a streaming response polls itself)
        self._deadline = deadline
        self._poll_at = time.monotonic() + _DISCONNECT_POLL_S

    def without_polling(self) -> _Waiter:
        """The same wait, for a started streaming response: it watches for disconnects
        itself, and a second reader of the ASGI receive channel would compete with it."""
        return _Waiter(self._stream, None, self._deadline)

    async def next(self) -> Reply:
        while True:
            now = time.monotonic()
            remaining = self._deadline - now
            if remaining <= 0:
                raise timed_out("no answer within the request's timeout")
            if self._request is not None and now >= self._poll_at:
                self._poll_at = now + _DISCONNECT_POLL_S
                if await self._request.is_disconnected():
                    raise _ClientGone()
            wait = remaining if self._request is None else min(self._poll_at - now, remaining)
            try:
                return await self._stream.get(timeout=wait)
            except TimeoutError:
                continue  # the deadline or the next look for the client is due


def create_api(deps: HttpDeps) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the gateway."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await deps.gateway.start()
        try:
            yield
        finally:
            await deps.gateway.stop()

    api = FastAPI(title="llmq ingest", lifespan=lifespan, docs_url=None, redoc_url=None)
    api.add_exception_handler(ApiError, _api_error)
    api.add_exception_handler(StarletteHTTPException, _http_error)
    api.add_exception_handler(Exception, _server_error)
    _add_routes(api, deps)
    return api


def _add_routes(api: FastAPI, deps: HttpDeps) -> None:
    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(deps, request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(deps, request, "chat")

    @api.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        served = _visible_models(deps, _tenant(deps, request))
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "llmq"}
                     for m in served],
        }

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    live_seen = False  # a live worker was seen since this process started

    @api.get("/readyz")
    async def readyz() -> JSONResponse:
        nonlocal live_seen
        live_seen = live_seen or bool(deps.watcher.tracker.live_workers(deps.clock()))
        checks, reasons = _readiness(deps, live_seen)
        body = {"ready": not reasons, "checks": checks, "reasons": reasons}
        return JSONResponse(body, status_code=200 if not reasons else 503)


def _visible_models(deps: HttpDeps, tenant: str) -> list[str]:
    """The served models the tenant may use: a model it may not use is hidden, as
    admission answers it like one that does not exist, by admission's own rule
    (:func:`~services.ingest.core.may_use_model`). A tenant without a policy sees none
    (fail closed; admission refuses its every request)."""
    policy = deps.tenancy.policy_for(tenant)
    if policy is None:
        return []
    registry = deps.tenancy.config.admission.registry
    return [m for m in deps.watcher.tracker.served_models(deps.clock())
            if may_use_model(policy, m, registry.get(m))]


def _readiness(deps: HttpDeps, live_seen: bool) -> tuple[dict[str, bool], list[str]]:
    watcher, topics = deps.watcher, deps.gateway.topics
    checks = {
        "kafka_producer": deps.gateway.producer_ready,
        "reply_consumer": deps.gateway.replies_ready,
        "cluster_reader": watcher.running and watcher.caught_up.is_set(),
        # A startup gate: a live worker seen since start, not any heartbeat read (the
        # compacted topic replays the last beat of workers long gone). Not "live now": a
        # fleet drained or lagging later gets 503 overloaded with a Retry-After from every
        # instance, which a load balancer that dropped them all could not give.
        "worker_heartbeat": live_seen,
    }
    why = {
        "kafka_producer": "not connected to Kafka (producer not started)",
        "reply_consumer": f"reply consumer not assigned to {topics.reply}",
        "cluster_reader": f"still reading {topics.heartbeats} and {topics.status}",
        "worker_heartbeat": f"no live worker seen yet (fresh heartbeat on "
        f"{topics.heartbeats}): every request would be refused as overloaded",
    }
    return checks, [why[name] for name, ok in checks.items() if not ok]


def _tenant(deps: HttpDeps, request: Request) -> str:
    found = deps.tenancy.authenticate(request.headers.get("authorization"))
    if isinstance(found, AuthFailure):
        raise unauthorized(found.message)
    return found


def _http_span(request: Request, kind: Kind) -> Span:
    """The call's SERVER span, child of the client's ``traceparent`` if it sent one, but
    sampled at ingest's ratio whatever that says (:func:`tracing.sampled_by_us`: the HTTP
    API is the tenant boundary)."""
    incoming = [(name, value.encode("latin-1")) for name in ("traceparent", "tracestate")
                if (value := request.headers.get(name)) is not None]
    return tracing.tracer(__name__).start_span(
        f"POST {request.url.path}", context=tracing.sampled_by_us(tracing.extract(incoming)),
        kind=SpanKind.SERVER,
        attributes={
            "http.request.method": "POST", "url.path": request.url.path,
            tracing.GEN_AI_OPERATION: "chat" if kind == "chat" else "text_completion",
        },
    )


async def _read_body(request: Request) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed ``MAX_BODY_BYTES``:
    from Content-Length before reading, or while streaming it in, never after holding it
    all (one oversized body would otherwise stall every agent of this event loop)."""
    limit = MAX_BODY_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(f"request body of {int(declared):,} bytes exceeds {limit:,}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(f"request body exceeds {limit:,} bytes")
        parts.append(part)
    return b"".join(parts)


def scoped_request_id(tenant: str, client_id: str) -> str:
    """The request id of a call whose client chose ``client_id`` (``x-request-id``): scoped
    to the tenant, as replies are routed by request id alone. Unscoped, a tenant reusing
    another's id got that request's late replies (after the first caller gave up) as its
    own answer. Too long for an id once scoped: the tenant and a digest of the client's
    id. An id that is not valid is passed on as it is, so validation names it."""
    if re.fullmatch(ID_PATTERN, client_id) is None:
        return client_id
    scoped = f"{tenant}:{client_id}"
    if len(scoped) <= 128:
        return scoped
    return f"{tenant}:{hashlib.sha256(client_id.encode()).hexdigest()[:48]}"


def _fit_to_context(deps: HttpDeps, call: ParsedCall) -> ParsedCall:
    """A call that set no ``max_tokens`` asks for at most the rest of its model's context,
    as vLLM's server does; admission counts the prompt with the same counter."""
    if call.max_tokens_given:
        return call
    req = call.request
    registry = deps.tenancy.config.admission.registry
    prompt = request_prompt_tokens(req, counter_for(req.model, registry, deps.counters))
    fitted = fitted_max_tokens(req.max_tokens, prompt, registry.get(req.model))
    if fitted == req.max_tokens:
        return call
    return replace(call, request=req.model_copy(update={"max_tokens": fitted}))


async def _complete(deps: HttpDeps, request: Request, kind: Kind) -> Response:
    """A completion call, its answer counted by the HTTP status it goes out with (a stream
    is 200 whatever its end; the exception handlers answer an ApiError with its status,
    anything else with 500)."""
    try:
        response = await _answer(deps, request, kind)
    except ApiError as exc:
        HTTP_RESPONSES.labels(status=str(exc.status)).inc()
        raise
    except Exception:
        HTTP_RESPONSES.labels(status="500").inc()
        raise
    HTTP_RESPONSES.labels(status=str(response.status_code)).inc()
    return response


async def _answer(deps: HttpDeps, request: Request, kind: Kind) -> Response:
    span = _http_span(request, kind)
    try:
        tenant = _tenant(deps, request)
        body = parse_json(await _read_body(request))
        client_id = request.headers.get("x-request-id") or None
        origin = Origin(
            request_id=scoped_request_id(tenant, client_id) if client_id
            else f"cmpl-{uuid.uuid4().hex}",
            tenant=tenant,
            reply_to=deps.gateway.topics.reply,
            now=deps.clock(),
            client_id=client_id,
        )
        call = _fit_to_context(deps, to_inference_request(
            body, kind, origin, request.headers, deps.defaults))
        req = call.request
        if client_id is not None:  # what the caller searches its traces by
            span.set_attribute("llmq.client_request_id", client_id)
        span.set_attributes(tracing.request_attributes(**{
            tracing.LLMQ_REQUEST_ID: req.request_id, tracing.LLMQ_TENANT: tenant,
            tracing.GEN_AI_MODEL: req.model, tracing.GEN_AI_MAX_TOKENS: req.max_tokens,
            tracing.LLMQ_PRIORITY: req.priority,
        }))
        stream = await deps.gateway.submit(
            req, tracing.inject(ctx=trace.set_span_in_context(span)),
            client_id=client_id is not None,
        )
    except ClientDisconnect:
        # Gone while its body was read: nothing was queued, nobody to answer (not a 500).
        _end_span(span, 499, "abandoned", "client disconnected during the upload")
        return Response(status_code=499)
    except BaseException as exc:
        # Refused before it was queued (401, 400, 409, 503): the span ends here.
        if isinstance(exc, ApiError):
            _end_span(span, exc.status, exc.code or str(exc.status), exc.message)
        else:
            _end_span(span, 500, type(exc).__name__)
        raise
    answer = _Call(deps, call, stream, request, span)
    try:
        first = answer.seen(await answer.waiter.next())
        if isinstance(first, Error):
            answer.finish(None)
            raise from_reply(first)
        if call.stream:
            return answer.streaming(first)
        return await answer.collect(first)
    except _ClientGone:
        answer.finish("client disconnected")
        return Response(status_code=499)
    except BaseException:
        # The deadline (504), a cancelled handler or a bug: the request must not run on
        # for nobody. A no-op when it already ended.
        answer.finish("the API gave up on the request")
        raise


class _Call:
    """Answering one accepted call: relay or gather its replies; cancel it if abandoned.

    :meth:`finish` runs once (later calls are no-ops): it stops waiting for replies and,
    when a reason is given (the request did not end), sends a ``CancelRequest``.
    """

    def __init__(
        self, deps: HttpDeps, call: ParsedCall, stream: ReplyStream, request: Request,
        span: Span,
    ) -> None:
        self._deps = deps
        self._call = call
        self._span = span
        self._terminal: Done | Error | None = None
        self._chunks = 0
        self._created = int(call.request.created_at)
        self._finished = False
        deadline = time.monotonic() + call.request.timeout_s + deps.reply_grace_s
        # Polls for a vanished client: before the first reply a stream has not started, so
        # nothing else would notice (the relay of a started stream uses without_polling()).
        self.waiter = _Waiter(stream, request, deadline)
        self.headers = {"x-request-id": call.id}

    def finish(self, cancel_reason: str | None) -> None:
        if self._finished:
            return
        self._finished = True
        request = self._call.request
        # An id refused at admission (rate_limited, overloaded) may be sent again at once:
        # nothing holds it (no reservation, the scheduler never saw it), and clients retry
        # these with the same id (the OpenAI SDKs do).
        self._deps.gateway.ended(request.request_id, client_id=bool(self._call.client_id)
                                 and not _refused_at_admission(self._terminal))
        if cancel_reason is not None:
            self._deps.gateway.cancel_soon(request.request_id, request.tenant, cancel_reason,
                                           self._deps.clock())
        terminal = self._terminal
        if isinstance(terminal, Done):
            self._span.set_attributes({
                tracing.GEN_AI_INPUT_TOKENS: terminal.usage.prompt_tokens,
                tracing.GEN_AI_OUTPUT_TOKENS: terminal.usage.completion_tokens,
                tracing.LLMQ_ATTEMPT: terminal.attempt,
            })
            _end_span(self._span, 200, "done")
        elif isinstance(terminal, Error):
            _end_span(self._span, from_reply(terminal).status, terminal.code)
        else:
            _end_span(self._span, 499, "abandoned", cancel_reason)

    def seen(self, msg: Reply) -> Reply:
        """Note what the call received (for its span) and hand it back."""
        if isinstance(msg, TokenChunk):
            if self._chunks == 0:
                self._span.add_event("first_chunk")
            self._chunks += 1
        else:
            self._terminal = msg
        return msg

    async def collect(self, first: Reply) -> JSONResponse:
        text = AttemptText()
        msg = first
        while isinstance(msg, TokenChunk):
            text.add(msg)
            msg = self.seen(await self.waiter.next())
        text.add(msg)  # a newer attempt that sent no chunk voids the older text
        self.finish(None)
        if isinstance(msg, Error):
            raise from_reply(msg)
        body = completion_object(self._call, text.text, msg, self._created)
        return JSONResponse(body, headers=self.headers)

    def streaming(self, first: Reply) -> StreamingResponse:
        # The background task runs once the response is over, however it ended: it cancels
        # the request when the client left before the body's generator could (during a
        # write, or before the body started). Async, so it runs on the event loop: a plain
        # function would run in a worker thread, where no task can be started.
        return StreamingResponse(
            self._events(first), media_type="text/event-stream",
            headers={**_SSE_HEADERS, **self.headers},
            background=BackgroundTask(self._abandoned),
        )

    async def _abandoned(self) -> None:
        self.finish("client disconnected")

    async def _events(self, first: Reply) -> AsyncIterator[bytes]:
        """SSE bytes; a disconnect (cancelled here) or the deadline cancels the request."""
        try:
            async for data in self._relay(first, self.waiter.without_polling()):
                yield data
            self.finish(None)
        except ApiError as exc:  # the deadline passed mid-stream
            self.finish("no answer within the timeout")
            yield sse(exc.body())
            yield SSE_DONE
        finally:
            self.finish("stream ended before the request finished")

    async def _relay(self, first: Reply, waiter: _Waiter) -> AsyncIterator[bytes]:
        call, created = self._call, self._created
        msg, sent_attempt = first, None  # attempt whose text was sent (None: no text yet)
        while isinstance(msg, TokenChunk):
            if sent_attempt is not None and msg.attempt > sent_attempt:
                async for data in self._restarted(msg.attempt):
                    yield data
                return
            yield sse(chunk_object(call, created, msg.text, first=sent_attempt is None))
            sent_attempt = msg.attempt
            msg = self.seen(await waiter.next())
        if isinstance(msg, Done) and sent_attempt is not None and msg.attempt > sent_attempt:
            # The newer attempt finished without a chunk: what was sent is still void.
            async for data in self._restarted(msg.attempt):
                yield data
            return
        opened = sent_attempt is not None
        if isinstance(msg, Error):
            # Headers are sent: an error event, then the end every stream has.
            yield sse(from_reply(msg).body())
            yield SSE_DONE
            return
        if not opened and call.kind == "chat":
            yield sse(chunk_object(call, created, "", first=True))
        yield sse(chunk_object(call, created, None, finish_reason=msg.finish_reason))
        if call.include_usage:
            yield sse(usage_chunk(call, created, msg))
        yield SSE_DONE

    async def _restarted(self, attempt: int) -> AsyncIterator[bytes]:
        """End a stream whose sent text a newer attempt voided: the client must retry, and
        the request, now running for nobody, is cancelled."""
        request = self._call.request
        lost = Error(
            request_id=request.request_id, attempt=attempt, code="worker_lost",
            message=f"the request restarted (attempt {attempt}) after its first tokens were "
            "sent; retry it", ts=self._deps.clock(),
        )
        self.seen(lost)  # the span ends as this error
        self.finish(f"restarted (attempt {attempt}) after its stream had started")
        yield sse(from_reply(lost).body())
        yield SSE_DONE


def _refused_at_admission(terminal: Done | Error | None) -> bool:
    """Ingest's own retryable refusal: attempt 0, and a code only admission gives (a
    worker's ``overloaded`` has an attempt of 1 or more)."""
    return isinstance(terminal, Error) and terminal.attempt == 0 \
        and terminal.code in ("rate_limited", "overloaded")


def _end_span(span: Span, status: int, outcome: str, why: str | None = None) -> None:
    span.set_attributes({"http.response.status_code": status, tracing.LLMQ_OUTCOME: outcome})
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, why or outcome))
    span.end()


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(_: Request, exc: Exception) -> Response:
    # Starlette's own 404/405 in OpenAI's error shape, with its headers (a 405's Allow).
    assert isinstance(exc, StarletteHTTPException)
    return ApiError(exc.status_code, str(exc.detail), None).response(dict(exc.headers or {}))


async def _server_error(_: Request, exc: Exception) -> Response:
    # A bug: the client still gets OpenAI's error shape, not a plain-text 500 (Starlette
    # logs the traceback and re-raises it to the server after this response).
    return ApiError(500, f"internal error in llmq ingest ({type(exc).__name__}); see its "
                         "log", "internal_error").response()

