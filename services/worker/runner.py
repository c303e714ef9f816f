"""One assignment on the engine, from ``event.started`` to its one terminal reply.

:class:`RequestRun` owns the life of one ``(request_id, attempt)`` on this worker:

1. deadline already passed → ``Error(timeout)`` + ``event.aborted(timeout)``, nothing run;
2. ``event.started``; a pump task feeds the engine's deltas into the run's inbox;
3. first token → ``event.first_token``; deltas are batched into ``TokenChunk`` messages
   (``core.batching``) on the request's reply topic, without waiting for acks;
4. exactly one ending, whichever comes first: the engine finishes (``Done`` +
   ``event.done``), the deadline passes (abort, ``Error(timeout)`` + ``event.aborted``),
   :meth:`stop` is called for a cancel (abort, ``Error(cancelled)`` + ``event.aborted``)
   or a newer attempt (abort, nothing sent: clients keep the newest attempt), or the engine
   fails (``Error(code)`` + ``event.failed``). Buffered text is flushed before the terminal.

Fencing: every record but the terminal event is sent only once ``await may_send()`` allows
it (the worker's lease, ``services.worker.core.lease``: while a lapsed lease is being asked
about, it waits for the scheduler's answer). Once it does not, the run stops
there, as a superseded one does: nothing more is sent, and the scheduler requeues or ends
the request. The terminal event after a durable reply goes out without asking (it is the
news that the reply is there); only sending it again asks.

The terminal reply is sent once every chunk was acknowledged, and the terminal event once
the reply was: ``event.done`` means "the done reply is durable". Neither is given up on a
failed send or a missing ack: without them the client has no answer, the scheduler's KV
reservation here never ends and the offset is never committed (and a restarted process
would not run the assignment again: it drops what was placed on an earlier one). So the
run sends again, from the first record not acknowledged on (the chunks, every one
acknowledged before the reply goes: clients stop at the first terminal; then the reply;
clients drop duplicates), with a growing wait between tries, until the broker
acknowledges, the run may no longer send (fenced), a newer attempt or slot holder took the
request over, or the worker stops hard (the run is cancelled). It gives up only on an
error no retry mends (a topic the broker refuses, a record too large) or
``give_up_after_s`` past the request's deadline; then it sends ``event.failed(worker_lost)``
(its own time to go out) and the assignment is over:
its offset may be committed (a restarted process would not run it again, and an offset
held open would stop the slot's commit point for the rest of the process).
:meth:`run` returns an :class:`Outcome` whose ``acked`` tells the app whether the
assignment's offset may be committed. Any unexpected error, a final delta the wire refuses
included, still ends the request with ``Error(worker_lost)`` + ``event.failed`` (the event
alone when a reply is acknowledged or on its way; nothing once the lease is refused: the
scheduler then ends or requeues the request itself).

Prefill and decode apart (``Assignment.phase``): a **prefill** stage (its engine request
has ``max_tokens`` 1 and the phase's engine priority, ``schemas.common.engine_rank``) sends
``event.started`` as usual and then nothing to the client: no ``event.first_token``, no
chunk, no reply (its one token is discarded). When the engine's stream ends normally, its
final delta must carry ``kv_transfer`` (without it: an engine failure, ``Error(worker_lost)``
+ ``event.failed``), and the run sends ``event.prefilled`` (those parameters, the prompt
tokens) on the events topic in the terminal reply's place: once every earlier record was
acknowledged, sent again until acknowledged, fenced and given up by the same rules. Given
up past the deadline, it is followed by the same ``event.failed(worker_lost)`` (the worker
does not answer the client then, as after a given-up reply: ingest's HTTP side answers 504
past the timeout; the record may yet have been written). Refused for good (an error no
retry mends), it certainly was not written, so the client gets its one terminal: the run
fails ``worker_lost`` (``Error`` + ``event.failed``, sent as any run's terminal). Parameters
whose event would encode to more than :data:`MAX_PREFILLED_BYTES` (under Kafka's default
1 MiB record limit) fail the run the same way, before anything is sent. A run whose
``event.prefilled`` was sent ends with the :class:`Outcome` ``prefilled``, with no
``terminal``: the request is not over, the scheduler places its decode stage on a decode
worker next. Every other ending
of a prefill stage is a whole run's: a deadline, a cancel or an engine failure sends the
client its one terminal ``Error`` and the matching event (the request is over: no decode
stage follows); a newer attempt or fencing ends it unanswered. A **decode** stage is a run
like a whole one (chunks, ``event.first_token``, ``Done`` + ``event.done``) whose engine
request carries the prefill's ``kv_transfer``.

Everything the run waits on comes through one inbox (deltas, the end of the stream, a
failure, a stop), so timeouts, cancels and tokens are handled in one loop without
cancelling the engine's iterator mid-step.

Terminal events: the event that follows a terminal reply (or a given-up or refused one:
``event.failed(worker_lost)``) is what tells the scheduler the attempt is over and frees its
KV booking; one never sent leaves that booking held until this worker restarts. So it is
sent again much longer than a reply: until ``event_give_up_after_s`` (default 300 s, and
never less than ``give_up_after_s``) after the reply was settled, and never before twice
``give_up_after_s`` past the request's deadline, whichever is later. A broker stall of a
few minutes is outlived; past that the event is given up and the offset counts as finished
as before (a process stalled that long has bigger troubles: its heartbeats, on the same
broker, stop too, and the scheduler declares it lost). Only fencing or a newer attempt stops
it sooner. The run holds its offset open meanwhile.

Tracing: the run is one span (GenAI naming: ``"<operation> <model>"``), the child of the
context the assignment record carried (the scheduler's placement), with a
``gen_ai.first_token`` event and, at the end, the outcome and token usage. Every record the
run produces (events, chunks, the terminal) carries the span's context, computed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeGuard, get_args

from aiokafka.errors import KafkaError, KafkaTimeoutError
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from pydantic import ValidationError

from schemas.codec import encode
from schemas.common import MAX_TOKENS, ErrorCode, engine_rank, priority_rank
from schemas.replies import Done, Error, FinishReason, Timings, TokenChunk, Usage
from schemas.requests import Assignment
from schemas.workers import (
    EventAborted,
    EventDone,
    EventFailed,
    EventFirstToken,
    EventPrefilled,
    EventStarted,
)
from services.common import tracing
from services.worker.core.batching import Chunk, ChunkBatcher
from services.worker.core.deadline import deadline_of, timing
from services.worker.engines.base import (
    ChatTurn,
    Engine,
    EngineAborted,
    EngineError,
    GenerateRequest,
    TokenDelta,
)
from services.worker.kafka_io import Publisher

_log = logging.getLogger(__name__)

StopReason = Literal["cancelled", "timeout", "superseded"]
#: The largest ``event.prefilled`` a run sends, encoded: under Kafka's default record limit
#: (1 MiB; the events topic keeps it), with room for the record's key, headers and batch.
MAX_PREFILLED_BYTES: Final = 900 << 10
#: ``prefilled``: a prefill stage handed its KV on (not a terminal: the request goes on).
OutcomeKind = Literal["done", "prefilled", "timeout", "cancelled", "superseded", "failed"]


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What every run of one worker shares."""

    worker_id: str
    model: str
    events_topic: str
    chunk_tokens: int = 16
    chunk_delay_s: float = 0.05
    #: Wait before sending a terminal record again; doubles per try up to ``retry_max_s``.
    retry_first_s: float = 0.1
    retry_max_s: float = 5.0
    #: Stop sending a terminal reply again this long past the request's deadline (and the
    #: event that follows a given-up reply twice as long): under ingest's reservation grace
    #: (30 s), so the tenant's slot is not settled by expiry while it still may go.
    give_up_after_s: float = 12.0
    #: A terminal *event* is sent again far longer: at least this long after the reply was
    #: settled (acked, given up or refused), and never before the old bound of twice
    #: ``give_up_after_s`` past the deadline. Events are small and the scheduler needs
    #: them: without one its log keeps the attempt active and its KV booking here leaks
    #: until this worker restarts (module docstring, "Terminal events").
    event_give_up_after_s: float = 300.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a run ended, tokens streamed, and whether its offset may be committed
    (``acked``: everything it sent was acknowledged, or it was given up for good and its
    ``event.failed`` sent as far as it could be).

    ``terminal`` is the terminal reply it sent, as ``llmq_requests_total`` labels it
    (``done`` or the error code; None when it sent none: superseded, a prefill stage's
    ``prefilled``, or sending failed); ``e2e_s`` the time from the request's submission to
    that terminal.
    """

    kind: OutcomeKind
    tokens: int
    acked: bool
    terminal: str | None = None
    e2e_s: float | None = None


@dataclass(frozen=True, slots=True)
class _Stop:
    reason: StopReason
    message: str


class Fenced(Exception):
    """This process may no longer answer the run (its lease lapsed, ``may_send``)."""


@dataclass(slots=True)
class _Sent:
    """A record the run sent (or is about to send), kept until the broker acknowledged it."""

    topic: str
    msg: Any
    future: asyncio.Future[Any] | None = None

    @property
    def acked(self) -> bool:
        f = self.future
        return f is not None and f.done() and not f.cancelled() and f.exception() is None

    @property
    def lost(self) -> bool:
        """Not sent, or the broker refused it (a pending one may still be acknowledged)."""
        f = self.future
        return f is None or (f.done() and not self.acked)


#: How sending a terminal ended (:meth:`RequestRun._until_acked`): ``given_up`` past its
#: time (the record may yet have been written), ``refused`` on an error no retry mends (it
#: certainly was not).
_Sending = Literal["acked", "given_up", "refused", "superseded"]


class _GiveUp(Exception):
    """A record cannot be sent, ever (its cause says why)."""


def _permanent(exc: BaseException | None) -> bool:
    """A Kafka error no retry mends (aiokafka marks the others ``retriable``; a client-side
    timeout, which it does not, is transient too)."""
    return isinstance(exc, KafkaError) and not exc.retriable \
        and not isinstance(exc, KafkaTimeoutError)


#: Why an assignment is answered without running it: the terminal's code and message.
Refusal = tuple[ErrorCode, str]

#: The finish reasons a ``Done`` may carry (``schemas.replies.FinishReason``).
_FINISH_REASONS: Final = frozenset(get_args(FinishReason))


def _token_count(value: object) -> TypeGuard[int]:
    """Is ``value`` a token count the wire takes (an int in ``[0, MAX_TOKENS]``)?"""
    return type(value) is int and 0 <= value <= MAX_TOKENS


def _bad_delta(delta: object) -> str | None:
    """What is wrong with an engine's output item (None: a delta the run can stream): not a
    :class:`TokenDelta`, text that is not a string, or a token count that is not an int
    >= 0 (added to the run's count, a negative one made its usage unsendable too)."""
    if not isinstance(delta, TokenDelta):
        return f"{type(delta).__name__}, not a delta"
    if not isinstance(delta.text, str):
        return f"a delta whose text is a {type(delta.text).__name__}"
    if not _token_count(delta.tokens):
        return f"a delta of {delta.tokens!r} tokens"
    return None


def _wire_text(text: str) -> str:
    """``text`` with surrogate pairs joined and lone surrogates (a server that splits a
    character between two events) as U+FFFD: the wire takes only valid Unicode."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


@dataclass(frozen=True, slots=True)
class _Failed:
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class _Ended:
    """The stream ended; ``last`` is its final delta (None: it ended without one)."""

    last: TokenDelta | None


_Item = TokenDelta | _Stop | _Failed | _Ended


@dataclass(frozen=True, slots=True)
class _Answer:
    """What a run sends at its end: ``first`` (the client's terminal reply, or a prefill
    stage's ``event.prefilled``), then ``event`` (the terminal event after a reply; None
    after ``event.prefilled``, which is its own news). ``label``: the terminal as
    ``llmq_requests_total`` counts it, None for ``prefilled``."""

    first: _Sent
    event: Any | None
    kind: OutcomeKind
    label: str | None
    usage: Usage

    @property
    def outcome(self) -> str:
        return self.label or self.kind


def engine_request(a: Assignment, engine_id: str) -> GenerateRequest:
    """The engine's view of an assignment (a prefill stage samples one token)."""
    req, s = a.request, a.request.sampling
    return GenerateRequest(
        request_id=engine_id,
        model=req.model,
        max_tokens=1 if a.phase == "prefill" else req.max_tokens,
        prompt_tokens=a.admitted.prompt_tokens,
        prompt=req.prompt,
        messages=None if req.messages is None
        else tuple(ChatTurn(m.role, m.content) for m in req.messages),
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        stop=tuple(s.stop), seed=s.seed,
        priority=engine_rank(
            priority_rank(a.admitted.priority) if a.engine_priority is None
            else a.engine_priority,
            a.admitted.lane, a.phase,
        ),
        phase=a.phase,
        kv_transfer=a.kv_transfer,
    )


class RequestRun:
    """One attempt of one request on this worker (see the module docstring)."""

    def __init__(self, assignment: Assignment, engine: Engine, publisher: Publisher,
                 cfg: RunConfig, *, clock: Callable[[], float] = time.time,
                 on_tokens: Callable[[int], None] | None = None,
                 on_first_token: Callable[[float], None] | None = None,
                 trace_parent: tracing.Context | None = None,
                 may_send: Callable[[], Awaitable[bool]] | None = None,
                 cancelled: str | None = None, refused: Refusal | None = None) -> None:
        self.assignment = assignment
        self.engine = engine
        self.publisher = publisher
        self.cfg = cfg
        self._clock = clock
        self._on_tokens = on_tokens
        self._on_first_token = on_first_token
        self._trace_parent = trace_parent
        self._may_send = may_send
        # Cancelled before its assignment came (the worker remembered the cancel): it ends
        # at once, through the same terminal path as any run (resent until acknowledged).
        self._cancelled_before = cancelled
        # An assignment this worker cannot run (another model or version: worker_lost, the
        # fleet's fault; an id reused: invalid): it ends at once, through the same path.
        self._refused = refused
        self._span: Span = trace.INVALID_SPAN
        self._headers: tracing.Headers = []
        self._inbox: asyncio.Queue[_Item] = asyncio.Queue()
        self._batcher = ChunkBatcher(cfg.chunk_tokens, cfg.chunk_delay_s)
        self._sent: list[_Sent] = []  # what may still need sending again
        self._superseded = False
        self._started_at: float | None = None
        self._first_token_at: float | None = None
        self._tokens = 0
        self._prefill = assignment.phase == "prefill"  # streams nothing (module docstring)
        #: This prefill stage's event.prefilled once its sending is due, and whether the
        #: broker refused it for good (see :attr:`handed_off`).
        self._handoff: _Sent | None = None
        self._handoff_refused = False
        #: The run's terminal reply (or event.prefilled) once its sending began: after the
        #: producer took it (its ``future`` set), a failure must not answer the client again.
        self._reply: _Sent | None = None
        req = assignment.request
        self.deadline = deadline_of(req.created_at, req.timeout_s, assignment.deadline)

    @property
    def request_id(self) -> str:
        return self.assignment.request_id

    @property
    def attempt(self) -> int:
        return self.assignment.attempt

    @property
    def engine_id(self) -> str:
        """Id of the attempt inside the engine (unique even if attempts overlap)."""
        return f"{self.request_id}#{self.attempt}"

    @property
    def handed_off(self) -> bool:
        """True once this prefill stage's event.prefilled may be in the log (the producer
        took it and the broker did not refuse it): a decode stage may then pull the
        prompt's KV from this engine, acknowledged or not (a fence may cut the wait). Not
        when its sending never began (superseded or fenced first): nothing was offered."""
        h = self._handoff
        return h is not None and h.future is not None and not self._handoff_refused

    def stop(self, reason: StopReason, message: str) -> None:
        """End the run early (cancel, supersede); the first ending wins."""
        if reason == "superseded":
            self._superseded = True  # also ends a terminal's resending (_until_acked)
        self._inbox.put_nowait(_Stop(reason, message))

    # ---- the run -----------------------------------------------------------------------
    async def run(self) -> Outcome:
        self._span = self._start_span()
        self._headers = tracing.inject(ctx=trace.set_span_in_context(self._span))
        try:
            outcome = await self._run()
        except BaseException as exc:
            self._span.record_exception(exc)
            self._span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            self._span.end()
        return outcome

    def _start_span(self) -> Span:
        a, req = self.assignment, self.assignment.request
        operation = "chat" if req.messages is not None else "text_completion"
        return tracing.tracer(__name__).start_span(
            f"{operation} {req.model}", context=self._trace_parent, kind=SpanKind.CONSUMER,
            attributes=tracing.request_attributes(**{
                tracing.GEN_AI_OPERATION: operation, tracing.GEN_AI_MODEL: req.model,
                tracing.GEN_AI_MAX_TOKENS: req.max_tokens, tracing.LLMQ_REQUEST_ID: a.request_id,
                tracing.LLMQ_TENANT: req.tenant, tracing.LLMQ_PRIORITY: a.admitted.priority,
                tracing.LLMQ_LANE: a.admitted.lane, tracing.LLMQ_WORKER: self.cfg.worker_id,
                tracing.LLMQ_ATTEMPT: a.attempt,
            }),
        )

    async def _run(self) -> Outcome:
        if self._cancelled_before is not None:
            return await self._terminal(_Stop("cancelled", self._cancelled_before))
        if self._refused is not None:
            return await self._terminal(_Failed(*self._refused))
        if self._clock() >= self.deadline:
            return await self._terminal(_Stop("timeout", "deadline passed before it started"))
        self._started_at = self._clock()
        pump: asyncio.Task[None] | None = None
        try:
            await self._send(self.cfg.events_topic, self._event(EventStarted))
            pump = asyncio.create_task(self._pump(), name=f"pump:{self.engine_id}")
            ending = await self._stream()
        except Fenced:
            ending = _Stop("superseded", "this process was fenced")
        except Exception as exc:
            _log.exception("request %s: run failed", self.engine_id)
            ending = _Failed("worker_lost", f"worker error: {type(exc).__name__}")
        finally:
            if pump is not None and not pump.done():
                pump.cancel()  # closes the engine's iterator, which aborts the request
            if pump is not None:
                await asyncio.gather(pump, return_exceptions=True)
        if not isinstance(ending, _Ended):
            try:
                await self.engine.abort(self.engine_id)
            except Exception:  # best effort: the run still ends with its one terminal
                _log.exception("request %s: the engine's abort failed", self.engine_id)
        return await self._terminal(ending)

    async def _pump(self) -> None:
        last: TokenDelta | None = None
        try:
            async for delta in self.engine.generate(engine_request(self.assignment,
                                                                   self.engine_id)):
                problem = _bad_delta(delta)
                if problem is not None:  # an engine bug: fail, answered
                    self._inbox.put_nowait(_Failed("worker_lost", f"engine yielded {problem}"))
                    return
                if not delta.text.isascii():  # lone surrogates cannot go on the wire
                    delta = dataclasses.replace(delta, text=_wire_text(delta.text))
                last = delta
                self._inbox.put_nowait(delta)
        except EngineError as exc:
            self._inbox.put_nowait(_Failed(exc.code, exc.message))
            return
        except EngineAborted as exc:
            # Aborts we start end the run before this is read; this one came from elsewhere
            # (the engine shutting down).
            self._inbox.put_nowait(_Failed("worker_lost", f"engine aborted it: {exc}"))
            return
        except Exception as exc:  # an engine bug: the request still gets its one terminal
            _log.exception("request %s: the engine failed", self.engine_id)
            self._inbox.put_nowait(
                _Failed("worker_lost", f"engine error: {type(exc).__name__}: {exc}")
            )
            return
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the run cancelled the pump: it has its ending already
            # Raised by the engine itself, not a cancel of this run: an engine failure,
            # answered now rather than at the deadline.
            _log.error("request %s: the engine raised CancelledError", self.engine_id)
            self._inbox.put_nowait(_Failed("worker_lost", "engine error: CancelledError"))
            return
        self._inbox.put_nowait(_Ended(last))

    async def _stream(self) -> _Stop | _Failed | _Ended:
        while True:
            # The deadline and a due batch are checked before each wait, not only when one
            # times out: a wait on an inbox that already holds a delta returns without
            # ever timing out, so a run behind its engine streamed past its deadline
            # (found by a review of the move from wait_for to asyncio.timeout).
            now = self._clock()
            if now >= self.deadline:
                return _Stop("timeout", f"deadline passed after {self._tokens} tokens")
            due = self._batcher.due_at()
            if due is not None and now >= due:
                await self._send_chunk(self._batcher.flush(now))
                continue
            wake = self.deadline if due is None else min(self.deadline, due)
            try:
                async with asyncio.timeout(wake - now):
                    item = await self._inbox.get()  # not wait_for: it can drop a cancel
            except TimeoutError:
                continue
            if not isinstance(item, TokenDelta):
                return item
            await self._on_delta(item)

    async def _on_delta(self, delta: TokenDelta) -> None:
        if self._prefill:
            return  # its one token is discarded; the final delta comes with _Ended
        now = self._clock()
        if delta.tokens > 0 and self._first_token_at is None:
            self._first_token_at = now
            ttft = max(0.0, now - self.assignment.request.created_at)
            self._span.add_event(tracing.FIRST_TOKEN_EVENT, {"llmq.ttft_s": ttft})
            await self._send(self.cfg.events_topic, self._event(EventFirstToken, ttft_s=ttft))
            # Counted once sent: a fenced run sends nothing, and its request is requeued,
            # whose next attempt's first token is the one the client sees.
            if self._on_first_token is not None:
                self._on_first_token(ttft)
        self._tokens += delta.tokens
        if self._on_tokens is not None and delta.tokens:
            self._on_tokens(delta.tokens)
        for chunk in self._batcher.add_all(delta.text, delta.tokens, now):
            await self._send_chunk(chunk)

    # ---- sending -----------------------------------------------------------------------
    async def _check_fence(self) -> None:
        if self._may_send is not None and not await self._may_send():
            raise Fenced(self.engine_id)

    async def _send(self, topic: str, msg: Any) -> None:
        await self._check_fence()
        self._sent.append(_Sent(topic, msg, await self.publisher.send(topic, msg, self._headers)))
        if len(self._sent) > 64:
            # Keep only what is still in flight; failures stay so the terminal resends them.
            self._sent = [s for s in self._sent if not s.acked]

    async def _send_chunk(self, chunk: Chunk | None) -> None:
        if chunk is not None:
            topic = self.assignment.admitted.reply_topic
            await self._resend_lost_chunks(topic)
            await self._send(topic, self._chunk(chunk))

    async def _resend_lost_chunks(self, topic: str) -> None:
        """Send again, ahead of the next chunk, the chunks whose delivery is known to have
        failed. Clients release chunks in ``seq`` order (``ReplyStream``): left for the
        terminal, one lost chunk held everything after it back until the request ended (a
        stream silent that long, cut by an idle proxy; found by a review). A send that
        raises here is left to the terminal, which sends every unacknowledged record."""
        for sent in self._sent:
            f = sent.future
            if sent.topic != topic or f is None or not f.done() or sent.acked:
                continue
            try:
                await self._check_fence()
                sent.future = await self.publisher.send(topic, sent.msg, self._headers)
            except (KafkaError, TimeoutError, OSError):
                return

    def _chunk(self, chunk: Chunk) -> TokenChunk:
        return TokenChunk(request_id=self.request_id, attempt=self.attempt, seq=chunk.seq,
                          text=chunk.text, tokens=chunk.tokens, ts=self._clock())

    async def _terminal(self, ending: _Stop | _Failed | _Ended) -> Outcome:
        try:
            return await self._send_terminal(ending)
        except Fenced:
            # The scheduler requeues or ends it: this process's part is over, unanswered.
            _log.warning("request %s: this process was fenced; ended unanswered",
                         self.engine_id)
            self._span.set_attribute(tracing.LLMQ_OUTCOME, "fenced")
            return Outcome("superseded", self._tokens, acked=True)
        except Exception as exc:  # a bug: still tell the scheduler the attempt is over
            _log.exception("request %s: could not send its terminal", self.engine_id)
            self._span.set_attribute(tracing.LLMQ_OUTCOME, "unsent")
            replied = False  # the worker_lost reply below went (and is counted)
            with contextlib.suppress(Exception):
                if self._may_send is not None and not await self._may_send():
                    # Fenced after all: the scheduler holds its own ending or requeue of
                    # the attempt, which an event signed by this worker would cancel.
                    return Outcome("superseded", self._tokens, acked=True)
                why = f"its terminal could not be sent: {type(exc).__name__}"
                records = [_Sent(self.cfg.events_topic, self._event(
                    EventFailed, code="worker_lost", message=why))]
                # The client's one terminal, unless a reply is acknowledged or on its way.
                replying = self._reply is None or self._reply.lost
                if replying:
                    records.insert(0, _Sent(self.assignment.admitted.reply_topic,
                                            self._error("worker_lost", why, self._clock())))
                replied = replying and await self._until_acked(
                    records, ask_first=False, give_up_at=self._event_give_up_at()) == "acked"
            # As after a given-up reply: an offset held open would stop the commit point.
            return Outcome("failed", self._tokens, acked=True,
                           terminal="worker_lost" if replied else None)

    async def _send_terminal(self, ending: _Stop | _Failed | _Ended) -> Outcome:
        await self._check_fence()
        last = self._batcher.flush(self._clock(), force=True)
        if isinstance(ending, _Stop) and ending.reason == "superseded":
            # A newer attempt runs; the client keeps that one, so this one says nothing more
            # and nothing it sent is needed any more: its offset may be committed.
            self._span.set_attribute(tracing.LLMQ_OUTCOME, "superseded")
            return Outcome("superseded", self._tokens, acked=True)
        end = self._answer(ending)
        self._annotate(end.outcome, end.usage)
        if isinstance(end.first.msg, Done):
            self._span.set_attribute(tracing.GEN_AI_RESPONSE_FINISH,
                                     [end.first.msg.finish_reason])
        # Only a terminal reply ends the request for its client (not event.prefilled).
        e2e = max(0.0, self._clock() - self.assignment.request.created_at) \
            if end.label is not None else None
        if last is not None:  # buffered text goes ahead of the reply, and as surely
            self._sent.append(_Sent(self.assignment.admitted.reply_topic, self._chunk(last)))
        # Every chunk acknowledged before the reply goes: clients stop at the first
        # terminal, so a chunk sent again after it would be lost to them.
        unacked = [s for s in self._sent if not s.acked]
        sent = await self._until_acked(unacked, ask_first=True) if unacked else "acked"
        if sent == "acked":
            if end.kind == "prefilled":
                self._handoff = end.first
            self._reply = end.first
            sent = await self._until_acked([end.first], ask_first=True)
            if sent == "refused" and end.kind == "prefilled":
                self._handoff_refused = True
                # event.prefilled is certainly not durable, so no decode stage follows: the
                # client gets its one terminal, as for any failed run.
                end = self._ending(_Failed("worker_lost", "the worker could not hand the "
                                           "prefill's KV on: the broker refuses its "
                                           "event.prefilled"), end.usage)
                self._annotate(end.outcome, end.usage)
                e2e = max(0.0, self._clock() - self.assignment.request.created_at)
                self._reply = end.first
                sent = await self._until_acked([end.first], ask_first=True)
        if sent == "superseded":
            return Outcome("superseded", self._tokens, acked=True)
        if sent in ("given_up", "refused"):
            # The client cannot be answered (nor, for event.prefilled, the decode stage
            # placed); the scheduler and ingest still must learn the attempt is over, or
            # its KV booking and the tenant's slot stay taken for as long as this worker
            # lives. An event only (it says no reply was sent).
            what = f"its {end.label} reply" if end.label is not None \
                else f"its {end.first.msg.kind}"
            unsent = self._event(EventFailed, code="worker_lost", usage=end.usage,
                                 message=f"{what} could not be sent")
            with contextlib.suppress(Fenced):  # fenced: the scheduler ends it on its own
                # Its own time to go out (the reply's was spent already): the terminal
                # events' long bound (module docstring, "Terminal events").
                # The lease asked first: a fenced worker's event would cancel the
                # scheduler's own ending of the attempt (its reply check pending).
                await self._until_acked(
                    [_Sent(self.cfg.events_topic, unsent)], ask_first=True,
                    give_up_at=self._event_give_up_at())
            # Nothing is left to do for this assignment: a restarted process would not run
            # it again (it drops work placed on an earlier process), and holding its offset
            # open would stop the slot's commit point for good. So it counts as finished.
            return Outcome(end.kind, self._tokens, acked=True, terminal=None, e2e_s=e2e)
        if end.event is not None:
            try:
                await self._until_acked([_Sent(self.cfg.events_topic, end.event)],
                                        ask_first=False, give_up_at=self._event_give_up_at())
            except Fenced:
                # The reply is durable; the scheduler ends or requeues the request itself.
                _log.warning("request %s: fenced before its terminal event was "
                             "acknowledged", self.engine_id)
        return Outcome(end.kind, self._tokens, acked=True, terminal=end.label, e2e_s=e2e)

    def _event_give_up_at(self) -> float:
        """When to stop sending a terminal event again, decided as its reply is settled
        (module docstring, "Terminal events")."""
        return max(self.assignment.deadline + 2 * self.cfg.give_up_after_s,
                   self._clock() + max(self.cfg.give_up_after_s,
                                       self.cfg.event_give_up_after_s))

    async def _until_acked(self, records: list[_Sent], *, ask_first: bool,
                           give_up_at: float | None = None) -> _Sending:
        """Send ``records`` (in order, from the first lost one on) again and again until the
        broker acknowledged them all (module docstring), with a doubling wait. Each try
        waits at most the publisher's timeout. Every try but a first one with ``ask_first``
        False asks ``may_send`` first and raises :class:`Fenced` once it says no: the
        terminal event after a durable reply goes out at once, as that reply's news.

        It stops short as ``refused`` on an error no retry mends (a refused topic, a
        record too large: :func:`_permanent`), as ``given_up`` ``give_up_after_s`` past the
        request's deadline (the client has gone by then), and as ``superseded`` once a newer
        attempt or a new holder of the slot took the request over."""
        wait = self.cfg.retry_first_s
        if give_up_at is None:
            give_up_at = self.assignment.deadline + self.cfg.give_up_after_s
        for tries in itertools.count(1):
            if self._superseded:
                return "superseded"
            if ask_first or tries > 1:
                await self._check_fence()
            try:
                if await self._try_send(records):
                    done = {id(r) for r in records}
                    self._sent = [s for s in self._sent if id(s) not in done]
                    return "acked"
            except _GiveUp as exc:
                _log.error("request %s: %s cannot be sent (%r); given up", self.engine_id,
                           records[-1].msg.kind, exc.__cause__)
                return "refused"
            if self._clock() >= give_up_at:
                _log.error("request %s: %s still not acknowledged %.0f s past its deadline; "
                           "given up", self.engine_id, records[-1].msg.kind,
                           self._clock() - self.assignment.deadline)
                return "given_up"
            _log.warning("request %s: %s not acknowledged (try %d); sending again in %.2f s",
                         self.engine_id, records[-1].msg.kind, tries, wait)
            await asyncio.sleep(wait)
            wait = min(2 * wait, self.cfg.retry_max_s)
        raise AssertionError("unreachable")

    async def _try_send(self, records: list[_Sent]) -> bool:
        """(Re)send ``records`` from the first lost one on, in order; True once all are acked.
        Raises :class:`_GiveUp` when a send failed for good."""
        first_lost = next((i for i, s in enumerate(records) if s.lost), len(records))
        try:
            for s in records[first_lost:]:
                s.future = await self.publisher.send(s.topic, s.msg, self._headers)
        except (KafkaError, TimeoutError, OSError) as exc:
            if _permanent(exc):
                raise _GiveUp from exc
            _log.error("request %s: could not send %s: %r", self.engine_id, s.msg.kind, exc)
            return False
        if await self.publisher.acked(s.future for s in records if s.future):
            return True
        for s in records:
            f = s.future
            if f is not None and f.done() and not f.cancelled() and f.exception() is not None \
                    and _permanent(f.exception()):
                raise _GiveUp from f.exception()
        return False

    def _annotate(self, outcome: str, usage: Usage | None) -> None:
        span = self._span
        span.set_attribute(tracing.LLMQ_OUTCOME, outcome)
        if usage is not None:
            span.set_attributes({tracing.GEN_AI_INPUT_TOKENS: usage.prompt_tokens,
                                 tracing.GEN_AI_OUTPUT_TOKENS: usage.completion_tokens})
        if outcome not in ("done", "prefilled", "cancelled"):
            span.set_status(Status(StatusCode.ERROR, outcome))

    def _answer(self, ending: _Stop | _Failed | _Ended) -> _Answer:
        """:meth:`_ending`, or ``worker_lost`` when the engine's final output cannot go on
        the wire (a finish reason or count the schemas refuse): the client still gets its
        one terminal reply and the scheduler its event (module docstring)."""
        try:
            return self._ending(ending)
        except Exception as exc:  # ValidationError, or an engine's value of a wrong type
            _log.exception("request %s: its ending cannot go on the wire", self.engine_id)
            usage = Usage(prompt_tokens=self.assignment.admitted.prompt_tokens,
                          completion_tokens=max(0, min(self._tokens, MAX_TOKENS)))
            return self._ending(_Failed("worker_lost", "the engine's final output cannot go "
                                        f"on the wire: {type(exc).__name__}"), usage)

    def _ending(self, ending: _Stop | _Failed | _Ended, usage: Usage | None = None) -> _Answer:
        """What the run sends for how it ended (``usage``: as counted already, if it was)."""
        now = self._clock()
        reply_topic = self.assignment.admitted.reply_topic
        if usage is None:
            usage = self._usage(ending.last if isinstance(ending, _Ended) else None)
        if isinstance(ending, _Ended):
            last = ending.last
            if last is None or last.finish_reason is None:
                ending = _Failed("worker_lost", "engine stream ended without finishing")
            elif last.finish_reason not in _FINISH_REASONS:
                ending = _Failed("worker_lost", "engine ended with finish reason "
                                 f"{str(last.finish_reason)[:64]!r}, not one of "
                                 f"{sorted(_FINISH_REASONS)}")
            elif self._prefill:
                prefilled = self._prefilled(last, usage)
                if isinstance(prefilled, _Failed):
                    ending = prefilled
                else:
                    return _Answer(_Sent(self.cfg.events_topic, prefilled), None,
                                   "prefilled", None, usage)
            else:
                return _Answer(_Sent(reply_topic, self._done(last, usage, now)),
                               self._event(EventDone, finish_reason=last.finish_reason,
                                           usage=usage), "done", "done", usage)
        if isinstance(ending, _Stop):
            if ending.reason == "timeout":
                return _Answer(_Sent(reply_topic, self._error("timeout", ending.message, now)),
                               self._event(EventAborted, code="timeout", usage=usage),
                               "timeout", "timeout", usage)
            return _Answer(_Sent(reply_topic, self._error("cancelled", ending.message, now)),
                           self._event(EventAborted, code="cancelled", usage=usage),
                           "cancelled", "cancelled", usage)
        return _Answer(_Sent(reply_topic, self._error(ending.code, ending.message, now)),
                       self._event(EventFailed, code=ending.code,
                                   message=ending.message[:4096], usage=usage),
                       "failed", ending.code, usage)

    def _prefilled(self, last: TokenDelta, usage: Usage) -> EventPrefilled | _Failed:
        """A prefill stage's news; a failure when the engine gave no usable parameters
        (none, not wire values, or more than :data:`MAX_PREFILLED_BYTES` encoded)."""
        if last.kv_transfer is None:
            return _Failed("worker_lost", "engine ended the prefill without KV-transfer "
                                          "parameters")
        try:
            event: EventPrefilled = self._event(EventPrefilled,
                                                kv_transfer=dict(last.kv_transfer),
                                                prompt_tokens=usage.prompt_tokens)
        except ValidationError as exc:
            return _Failed("worker_lost", "engine's KV-transfer parameters cannot go on the "
                                          f"wire: {exc.errors()[0]['msg']}")
        size = len(encode(event))
        if size > MAX_PREFILLED_BYTES:
            return _Failed("worker_lost", f"engine's KV-transfer parameters are too large: "
                                          f"their event.prefilled is {size} bytes, over "
                                          f"{MAX_PREFILLED_BYTES}")
        return event

    def _usage(self, last: TokenDelta | None) -> Usage:
        """The engine's counts where they are wire values, else the run's own (admitted
        prompt, tokens streamed)."""
        prompt = self.assignment.admitted.prompt_tokens
        completion = min(self._tokens, MAX_TOKENS)
        if last is not None:
            if _token_count(last.prompt_tokens):
                prompt = last.prompt_tokens
            if _token_count(last.completion_tokens):
                completion = last.completion_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion)

    def _done(self, last: TokenDelta, usage: Usage, now: float) -> Done:
        assert last.finish_reason is not None
        created = self.assignment.request.created_at
        t = timing(created, self._started_at or now, self._first_token_at, now)
        return Done(request_id=self.request_id, attempt=self.attempt, model=self.cfg.model,
                    finish_reason=last.finish_reason, usage=usage,
                    timings=Timings(queued_s=t.queued_s, ttft_s=t.ttft_s, e2e_s=t.e2e_s),
                    ts=now)

    def _error(self, code: ErrorCode, message: str, now: float) -> Error:
        return Error(request_id=self.request_id, attempt=self.attempt, code=code,
                     message=message[:4096], ts=now)

    def _event(self, cls: Any, **fields: Any) -> Any:
        return cls(request_id=self.request_id, tenant=self.assignment.request.tenant,
                   attempt=self.attempt, worker_id=self.cfg.worker_id, ts=self._clock(),
                   **fields)
