"""How a run ends when something breaks: every accepted request still gets exactly one
terminal reply, at once, not at its deadline.

The engines are stand-ins (our own interface) and so is the producer under the
``Publisher``: a real broker cannot be made to fail one send on cue. The normal paths run
against a real broker in tests/integration/test_worker_kafka.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, TopicAuthorizationFailedError

from schemas.requests import Assignment
from services.worker.engines.base import EngineCapacity, GenerateRequest, TokenDelta
from services.worker.kafka_io import Publisher
from services.worker.runner import Outcome, RequestRun, RunConfig
from tests.builders_schemas import make_admitted, make_assignment, make_request

REPLIES, EVENTS = "p.replies.acme", "p.events"


class _Producer:
    """Stand-in for the aiokafka producer: records what is sent; the sends numbered in
    ``fail`` (0-based) raise as a broker that does not answer in time makes them, those in
    ``nack`` are taken but their delivery fails (the record is lost), and from send
    ``fail_from`` on every send raises."""

    def __init__(self, fail: frozenset[int] = frozenset(), nack: frozenset[int] = frozenset(),
                 fail_from: int | None = None,
                 error: type[Exception] = KafkaTimeoutError) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []
        self.fail = fail
        self.nack = nack
        self.fail_from = fail_from
        self.error = error  # what a failing send raises (default: transient)
        self.sends = 0

    async def send(self, topic: str, value: bytes, *, key: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[None]:
        n, self.sends = self.sends, self.sends + 1
        if n in self.fail or (self.fail_from is not None and n >= self.fail_from):
            raise self.error()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if n in self.nack:
            done.set_exception(self.error())
            return done
        self.records.append((topic, json.loads(value)))
        done.set_result(None)
        return done

    def terminals(self) -> list[tuple[str, str | None]]:
        """(kind, code) of every reply that ends the request, and of every end event."""
        return [(r["kind"], r.get("code")) for topic, r in self.records
                if r["kind"] in ("done", "error", "event.done", "event.failed",
                                 "event.aborted")]


class _BrokenEngine:
    """Stand-in engine: yields ``tokens`` deltas, then fails with a non-engine error (a
    bug in an adapter, or a library raising something the adapter does not map)."""

    name = "broken"

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.aborted: list[str] = []

    async def start(self) -> None: ...
    async def close(self) -> None: ...

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        for _ in range(self.tokens):
            await asyncio.sleep(0)
            yield TokenDelta("ab", 1)
        raise RuntimeError("adapter bug")

    def capacity(self) -> EngineCapacity:
        return EngineCapacity(100, 100, 0, 0, 16, 0, 0, 4)


class _FineEngine(_BrokenEngine):
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        yield TokenDelta("ab", 2, finish_reason="stop", prompt_tokens=7, completion_tokens=2)


def _assignment(timeout_s: float = 600.0) -> Assignment:
    now = time.time()
    request = make_request(request_id="r1", tenant="acme", model="m", max_tokens=8,
                           timeout_s=timeout_s, created_at=now)
    admitted = make_admitted(request=request, priority="low", lane="short", prompt_tokens=7,
                             reply_topic=REPLIES, admitted_at=now)
    return make_assignment(admitted=admitted, worker_id="w", partition=0, attempt=1,
                           kv_tokens=16, deadline=now + timeout_s, assigned_at=now)


#: Terminal records are sent again after 1 ms, 2 ms, ... (production: 0.1 s, 0.2 s, ...).
_CFG = RunConfig(worker_id="w", model="m", events_topic=EVENTS, chunk_tokens=1,
                 retry_first_s=0.001, retry_max_s=0.01)


async def _run(engine: Any, producer: _Producer, cfg: RunConfig = _CFG) -> Outcome:
    run = RequestRun(_assignment(), engine, Publisher(producer, 5.0), cfg)
    # The deadline is 600 s away: a run that waits for it fails this bound instead.
    return await asyncio.wait_for(run.run(), 10.0)


async def test_an_engine_failing_mid_stream_ends_the_request_at_once() -> None:
    producer, engine = _Producer(), _BrokenEngine(tokens=2)
    outcome = await _run(engine, producer)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("failed", "worker_lost", True)
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]
    [error] = [r for _, r in producer.records if r["kind"] == "error"]
    assert "RuntimeError: adapter bug" in error["message"]
    chunks = [r for _, r in producer.records if r["kind"] == "chunk"]
    assert sum(c["tokens"] for c in chunks) == 2  # what streamed before the failure stays
    assert engine.aborted == ["r1#1"]  # the engine is told to free the request's KV


async def test_an_engine_failing_before_any_token_ends_the_request_at_once() -> None:
    producer = _Producer()
    outcome = await _run(_BrokenEngine(tokens=0), producer)
    assert outcome.terminal == "worker_lost"
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]


async def test_a_failed_started_event_still_ends_the_request_with_one_reply() -> None:
    producer = _Producer(fail=frozenset({0}))  # send 0 is event.started
    outcome = await _run(_FineEngine(tokens=0), producer)
    assert (outcome.kind, outcome.terminal) == ("failed", "worker_lost")
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]
    assert outcome.acked  # its answer reached the broker: the offset may be committed


async def test_the_normal_path_for_comparison() -> None:
    producer = _Producer()
    outcome = await _run(_FineEngine(tokens=0), producer)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("done", "done", True)
    assert producer.terminals() == [("done", None), ("event.done", None)]


class _Gate:
    """The worker's lease check as a run sees it: open for the first ``opens`` sends."""

    def __init__(self, opens: int) -> None:
        self.opens = opens
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        return self.calls <= self.opens


class _HoldingGate(_Gate):
    """A lapsed lease being asked about: the send numbered ``hold_at`` (1-based) waits until
    ``answer`` is set, then every send is allowed (granted) or refused (revoked)."""

    def __init__(self, hold_at: int) -> None:
        super().__init__(opens=hold_at - 1)
        self.answer = asyncio.Event()
        self.granted = True
        self.held = asyncio.Event()

    async def __call__(self) -> bool:
        self.calls += 1
        if self.calls < self.opens + 1:
            return True
        self.held.set()
        await self.answer.wait()
        return self.granted


async def _gated_run(engine: Any, producer: _Producer, gate: _Gate) -> Outcome:
    run = RequestRun(_assignment(), engine, Publisher(producer, 5.0), _CFG, may_send=gate)
    return await asyncio.wait_for(run.run(), 10.0)


@pytest.mark.parametrize("opens", [0, 1, 2, 3])
async def test_a_fenced_run_sends_nothing_more_and_no_terminal(opens: int) -> None:
    """Fenced before event.started (0), after it (1), after the first token's event and
    chunk (3): whatever went out stays, nothing follows, and the offset may be committed
    (the scheduler requeues or ends the request)."""
    producer, engine = _Producer(), _BrokenEngine(tokens=5)
    outcome = await _gated_run(engine, producer, _Gate(opens))
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("superseded", None, True)
    assert producer.terminals() == []
    assert len(producer.records) == opens
    assert engine.aborted == ["r1#1"]  # its KV is freed (a no-op when it never started)


async def test_a_run_fenced_at_its_terminal_sends_no_reply() -> None:
    producer = _Producer()
    # started, first_token, chunk: then the engine has finished, and the gate closes.
    outcome = await _gated_run(_FineEngine(tokens=0), producer, _Gate(opens=3))
    assert (outcome.kind, outcome.terminal) == ("superseded", None)
    assert [r["kind"] for _, r in producer.records] == [
        "event.started", "event.first_token", "chunk"]


async def test_the_terminal_event_follows_a_sent_reply_even_if_fenced_meanwhile() -> None:
    """Only a durable reply is followed by its event; the gate is not asked again then:
    the event is the scheduler's news that the reply is there."""
    gate = _Gate(opens=5)  # started, first_token, chunk, the terminal's two checks
    producer = _Producer()
    outcome = await _gated_run(_FineEngine(tokens=0), producer, gate)
    assert (outcome.kind, outcome.terminal) == ("done", "done")
    assert producer.terminals() == [("done", None), ("event.done", None)]
    assert gate.calls == 5  # a sixth, for the event, would have closed it


@pytest.mark.parametrize("hold_at", [1, 3, 4])
async def test_a_run_holds_its_records_while_the_lease_is_asked_about_then_goes_on(
    hold_at: int,
) -> None:
    """The lease lapsed before event.started (1), before the chunk (3) or at the terminal
    (4): nothing more goes out while the scheduler's answer is awaited; once it grants the
    renewal, the run sends what it held and ends with its one terminal as usual."""
    producer, gate = _Producer(), _HoldingGate(hold_at)
    task = asyncio.create_task(_gated_run(_FineEngine(tokens=0), producer, gate))
    await asyncio.wait_for(gate.held.wait(), 5.0)
    await asyncio.sleep(0.2)  # the engine has long finished: nothing may go out meanwhile
    assert len(producer.records) == hold_at - 1
    gate.answer.set()
    outcome = await task
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("done", "done", True)
    assert [r["kind"] for _, r in producer.records] == [
        "event.started", "event.first_token", "chunk", "done", "event.done"]


async def test_a_run_held_for_the_lease_ends_unanswered_when_it_is_refused() -> None:
    producer, gate = _Producer(), _HoldingGate(hold_at=3)
    gate.granted = False
    task = asyncio.create_task(_gated_run(_FineEngine(tokens=0), producer, gate))
    await asyncio.wait_for(gate.held.wait(), 5.0)
    gate.answer.set()
    outcome = await task
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("superseded", None, True)
    assert producer.terminals() == []
    assert [r["kind"] for _, r in producer.records] == ["event.started", "event.first_token"]


async def test_a_run_fenced_before_its_first_token_went_out_counts_no_ttft() -> None:
    """Found by an audit of the metrics: the time to first token was observed when the
    token was generated, before its event went; a run fenced then sent nothing, its request
    was requeued, and the next attempt observed it again (two samples, one bogus)."""
    producer, gate = _Producer(), _HoldingGate(hold_at=2)
    gate.granted = False
    ttft: list[float] = []
    run = RequestRun(_assignment(), _FineEngine(tokens=0), Publisher(producer, 5.0), _CFG,
                     may_send=gate, on_first_token=ttft.append)
    task = asyncio.create_task(run.run())
    await asyncio.wait_for(gate.held.wait(), 5.0)
    gate.answer.set()
    outcome = await asyncio.wait_for(task, 10.0)
    assert (outcome.kind, ttft) == ("superseded", [])
    ran = RequestRun(_assignment(), _FineEngine(tokens=0), Publisher(_Producer(), 5.0), _CFG,
                     on_first_token=ttft.append)
    await asyncio.wait_for(ran.run(), 10.0)
    assert len(ttft) == 1


async def test_the_worker_lost_reply_of_a_terminal_that_failed_is_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug while sending the terminal: the run still answers worker_lost; that reply is
    its terminal and was missing from llmq_requests_total (Outcome.terminal None)."""
    async def broken(self: RequestRun, ending: Any) -> Outcome:
        raise RuntimeError("a bug")

    monkeypatch.setattr(RequestRun, "_send_terminal", broken)
    producer = _Producer()
    run = RequestRun(_assignment(), _FineEngine(tokens=0), Publisher(producer, 5.0), _CFG)
    outcome = await asyncio.wait_for(run.run(), 10.0)
    assert (outcome.kind, outcome.terminal) == ("failed", "worker_lost")
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]


# Sends of the normal path: 0 event.started, 1 event.first_token, 2 chunk, 3 the done
# reply, 4 event.done (then more for every try again).
@pytest.mark.parametrize(("fail", "nack"), [
    (frozenset({3}), frozenset()),  # the reply's send raises once
    (frozenset({3, 4, 5}), frozenset()),  # ... three times
    (frozenset(), frozenset({3, 4})),  # the reply is lost twice (no ack)
    (frozenset({4, 5}), frozenset()),  # the event's send raises twice
    (frozenset(), frozenset({4})),  # the event is lost once
    (frozenset({3}), frozenset({5})),  # the reply raises once, then the event is lost
])
async def test_a_terminal_that_fails_to_go_out_is_sent_again_until_acknowledged(
    fail: frozenset[int], nack: frozenset[int],
) -> None:
    producer = _Producer(fail=fail, nack=nack)
    outcome = await _run(_FineEngine(tokens=0), producer)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("done", "done", True)
    assert producer.terminals() == [("done", None), ("event.done", None)]
    assert [r["kind"] for _, r in producer.records] == [
        "event.started", "event.first_token", "chunk", "done", "event.done"]


async def test_a_lost_chunk_goes_again_ahead_of_the_reply() -> None:
    producer = _Producer(nack=frozenset({2}))  # the one chunk is lost
    outcome = await _run(_FineEngine(tokens=0), producer)
    assert (outcome.terminal, outcome.acked) == ("done", True)
    assert [r["kind"] for _, r in producer.records] == [
        "event.started", "event.first_token", "chunk", "done", "event.done"]
    assert producer.sends == 6  # the chunk twice


class _ManyChunks(_BrokenEngine):
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        for i in range(5):
            yield TokenDelta(f"t{i} ", 1)
        yield TokenDelta("", 0, finish_reason="stop", prompt_tokens=7, completion_tokens=5)


async def test_a_lost_chunk_goes_again_ahead_of_the_next_one_not_of_the_reply() -> None:
    """Found by a review: a chunk whose delivery failed went again only ahead of the
    reply; clients release chunks in seq order, so everything after it was held back
    until the request ended."""
    producer = _Producer(nack=frozenset({3}))  # started, first_token, chunk 0, chunk 1 lost
    outcome = await _run(_ManyChunks(tokens=0), producer)
    assert (outcome.terminal, outcome.acked) == ("done", True)
    seqs = [r["seq"] for _, r in producer.records if r["kind"] == "chunk"]
    assert seqs == [0, 1, 2, 3, 4]  # 1 again before 2, not after 4


async def test_buffered_text_whose_send_fails_goes_again_ahead_of_the_reply() -> None:
    """The 2 tokens stay buffered (16 per chunk) until the end; that chunk's send raises."""
    producer = _Producer(fail=frozenset({2}))  # started, first_token, the buffered chunk
    outcome = await _run(_FineEngine(tokens=0), producer, replace(_CFG, chunk_tokens=16))
    assert (outcome.terminal, outcome.acked) == ("done", True)
    assert [r["kind"] for _, r in producer.records] == [
        "event.started", "event.first_token", "chunk", "done", "event.done"]


async def test_a_fenced_run_stops_sending_its_reply_again() -> None:
    """Every send from the reply on fails; the lease lapses after two tries: the run ends
    unanswered (the scheduler requeues or ends it), its offset may be committed."""
    producer = _Producer(fail_from=3)
    gate = _Gate(opens=6)  # started, first_token, chunk, the terminal's check, two tries
    outcome = await _gated_run(_FineEngine(tokens=0), producer, gate)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("superseded", None, True)
    assert producer.terminals() == []
    assert producer.sends == 5  # two tries of the reply, none after the gate closed


async def test_a_fenced_run_stops_sending_its_event_again() -> None:
    """The reply is durable, the event's sends fail: the first try goes out unasked, the
    next asks and is refused. The client has its answer; the offset may be committed."""
    producer = _Producer(fail_from=4)
    gate = _Gate(opens=5)  # started, first_token, chunk, the terminal's two checks
    outcome = await _gated_run(_FineEngine(tokens=0), producer, gate)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("done", "done", True)
    assert producer.terminals() == [("done", None)]
    assert producer.sends == 5 and gate.calls == 6


@pytest.mark.parametrize("how", ["raises", "is refused"])
async def test_a_reply_no_retry_can_send_is_given_up_at_once(how: str) -> None:
    # A topic the broker refuses (ACLs) fails the same way forever: resending held the
    # run, its slot and its KV booking, and kept a drain from ever ending.
    fail, nack = (frozenset({3}), frozenset()) if how == "raises" else (frozenset(), frozenset({3}))
    producer = _Producer(fail=fail, nack=nack, error=TopicAuthorizationFailedError)
    outcome = await _run(_FineEngine(tokens=0), producer)
    # Over for good, its event.failed sent: the offset is finished, so the slot's commit
    # point moves on (held open, it froze for the rest of the process).
    assert (outcome.terminal, outcome.acked) == (None, True)
    # No reply, but the attempt's end still goes out: the scheduler releases its KV
    # booking and ingest the tenant's slot (they were taken for the worker's life).
    assert producer.sends == 5 and producer.terminals() == [("event.failed", "worker_lost")]


async def test_a_given_up_reply_sends_no_event_once_the_lease_is_refused() -> None:
    """Found by a review: the event.failed after a reply given up went out without asking
    the lease; signed by a fenced worker, it cancelled the scheduler's own ending of the
    attempt (held for its reply check), and the client got no terminal."""
    lease = {"ok": True}

    class Refused(_Producer):
        async def send(self, topic: str, value: bytes, *, key: Any,
                       headers: Any = None) -> Any:
            if json.loads(value)["kind"] == "done":
                lease["ok"] = False  # the lease lapses and is refused meanwhile
                raise TopicAuthorizationFailedError()
            return await super().send(topic, value, key=key, headers=headers)

    async def may_send() -> bool:
        return lease["ok"]

    producer = Refused()
    run = RequestRun(_assignment(), _FineEngine(0), Publisher(producer, 5.0), _CFG,
                     may_send=may_send)
    outcome = await asyncio.wait_for(run.run(), 10.0)
    assert outcome.acked and producer.terminals() == []


async def test_resending_stops_once_a_newer_attempt_took_the_request() -> None:
    producer = _Producer(fail_from=3)  # every try of the reply fails, transiently
    run = RequestRun(_assignment(), _FineEngine(tokens=0), Publisher(producer, 5.0), _CFG)
    task = asyncio.create_task(run.run())
    while producer.sends < 6:
        await asyncio.sleep(0.001)
    run.stop("superseded", "attempt 2 replaces it")
    outcome = await asyncio.wait_for(task, 5.0)
    assert (outcome.kind, outcome.acked) == ("superseded", True)
    sends = producer.sends
    await asyncio.sleep(0.05)
    assert producer.sends == sends  # nothing more goes out


async def test_resending_gives_up_past_the_requests_deadline() -> None:
    producer = _Producer(fail_from=3)
    run = RequestRun(_assignment(timeout_s=0.2), _FineEngine(tokens=0),
                     Publisher(producer, 5.0),
                     replace(_CFG, give_up_after_s=0.1, event_give_up_after_s=0.1))
    outcome = await asyncio.wait_for(run.run(), 5.0)
    assert (outcome.terminal, outcome.acked) == (None, True)
    assert producer.terminals() == []  # the events topic fails too: nothing goes out



class _ReplyDown(_Producer):
    """The reply topic refuses the terminal reply (transiently, every time); the events
    topic drops the first ``event_failures`` terminal events."""

    def __init__(self, event_failures: int) -> None:
        super().__init__()
        self.event_failures = event_failures

    async def send(self, topic: str, value: bytes, *, key: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[None]:
        kind = json.loads(value)["kind"]
        if kind == "done" or (kind == "event.failed" and self.event_failures > 0):
            if kind == "event.failed":
                self.event_failures -= 1
            self.sends += 1
            raise KafkaTimeoutError()
        return await super().send(topic, value, key=key, headers=headers)


async def test_the_end_of_a_given_up_reply_has_its_own_time_to_go_out() -> None:
    # It shared the reply's time, spent by then: one failed try and no terminal event,
    # so the scheduler kept the KV booking on a live worker.
    producer = _ReplyDown(event_failures=2)
    run = RequestRun(_assignment(timeout_s=0.2), _FineEngine(tokens=0),
                     Publisher(producer, 5.0),
                     replace(_CFG, give_up_after_s=0.1, event_give_up_after_s=0.1))
    outcome = await asyncio.wait_for(run.run(), 5.0)
    assert (outcome.terminal, outcome.acked) == (None, True)
    assert producer.terminals() == [("event.failed", "worker_lost")]


async def test_a_request_cancelled_before_its_assignment_ends_like_any_run() -> None:
    # The worker answered it with one try of each record: a failed send left it with no
    # terminal (or no terminal event) and its offset open for good.
    producer = _Producer(fail=frozenset({0}))  # the first try of the reply fails
    engine = _BrokenEngine(tokens=5)  # never asked
    run = RequestRun(_assignment(), engine, Publisher(producer, 5.0), _CFG,
                     cancelled="cancelled before it started")
    outcome = await asyncio.wait_for(run.run(), 5.0)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("cancelled", "cancelled", True)
    assert producer.terminals() == [("error", "cancelled"), ("event.aborted", "cancelled")]
    assert engine.aborted == []


class _EventsStall(_Producer):
    """The events topic times out every terminal event sent before ``until`` (wall time):
    a broker stall that begins as the reply is acknowledged."""

    def __init__(self, until: float) -> None:
        super().__init__()
        self.until = until

    async def send(self, topic: str, value: bytes, *, key: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[None]:
        if json.loads(value)["kind"] == "event.done" and time.time() < self.until:
            self.sends += 1
            raise KafkaTimeoutError()
        return await super().send(topic, value, key=key, headers=headers)


async def test_a_terminal_event_outlives_a_stall_past_the_replys_time() -> None:
    # The reply's time (give_up_after_s past the deadline) runs out while the events topic
    # stalls: the event used to be given up with it, and the scheduler's booking leaked.
    producer = _EventsStall(until=time.time() + 0.6)
    run = RequestRun(_assignment(timeout_s=0.2), _FineEngine(tokens=0),
                     Publisher(producer, 5.0),
                     replace(_CFG, give_up_after_s=0.1, event_give_up_after_s=3.0))
    outcome = await asyncio.wait_for(run.run(), 5.0)
    assert (outcome.terminal, outcome.acked) == ("done", True)
    assert producer.terminals() == [("done", None), ("event.done", None)]


async def test_a_terminal_event_is_given_up_after_its_own_long_bound() -> None:
    producer = _EventsStall(until=time.time() + 60.0)
    run = RequestRun(_assignment(timeout_s=0.2), _FineEngine(tokens=0),
                     Publisher(producer, 5.0),
                     replace(_CFG, give_up_after_s=0.1, event_give_up_after_s=0.3))
    outcome = await asyncio.wait_for(run.run(), 5.0)
    assert (outcome.terminal, outcome.acked) == ("done", True)  # the offset is finished
    assert producer.terminals() == [("done", None)]


class _ScriptedEngine(_BrokenEngine):
    """Stand-in engine: yields ``script``'s items, then raises ``then`` if given."""

    def __init__(self, *script: Any, then: BaseException | None = None,
                 abort_fails: bool = False) -> None:
        super().__init__(0)
        self.script, self.then, self.abort_fails = script, then, abort_fails

    async def abort(self, request_id: str) -> None:
        if self.abort_fails:
            raise RuntimeError("engine core died")
        await super().abort(request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        for item in self.script:
            await asyncio.sleep(0)
            yield item
        if self.then is not None:
            raise self.then


_STOP = TokenDelta("", 0, finish_reason="stop")


@pytest.mark.parametrize(("script", "says"), [
    ((TokenDelta("ab", 3), TokenDelta("c", -5)), "a delta of -5 tokens"),
    ((TokenDelta("a", 1.5),), "a delta of 1.5 tokens"),  # type: ignore[arg-type]
    ((TokenDelta(b"a", 1),), "a delta whose text is a bytes"),  # type: ignore[arg-type]
])
async def test_a_delta_the_wire_cannot_take_ends_the_request_answered(
    script: tuple[TokenDelta, ...], says: str
) -> None:
    """Found by an audit: the bad count was added to the run's, the usage of its ending
    then failed too, and only event.failed went out: the client was never answered."""
    producer = _Producer()
    await _run(_ScriptedEngine(*script, _STOP), producer)
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]
    [error] = [r for _, r in producer.records if r["kind"] == "error"]
    assert says in error["message"]


async def test_lone_surrogates_go_on_the_wire_as_replacement_characters() -> None:
    """A server that slices text by UTF-16 unit: the run's whole-request batching joined
    the halves into text the wire refuses, and the client got no reply at all."""
    producer = _Producer()
    cfg = replace(_CFG, chunk_tokens=16)
    outcome = await _run(_ScriptedEngine(TokenDelta("ok \ud83d", 1), TokenDelta("\ude00", 1),
                                         TokenDelta("x\udfff", 1), _STOP), producer, cfg)
    assert outcome.terminal == "done"
    assert producer.terminals() == [("done", None), ("event.done", None)]
    text = "".join(r["text"] for _, r in producer.records if r["kind"] == "chunk")
    assert text == "ok \ufffd\ufffdx\ufffd"  # two deltas: their halves do not meet here


async def test_a_cancelled_error_from_the_engine_is_a_failure_answered_at_once() -> None:
    """Not a cancel of the run: it waited for its deadline (600 s here) and answered
    timeout; now worker_lost at once."""
    producer = _Producer()
    outcome = await _run(_ScriptedEngine(TokenDelta("a", 1), then=asyncio.CancelledError()),
                         producer)
    assert (outcome.kind, outcome.terminal) == ("failed", "worker_lost")
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]


class _HangingEngine(_ScriptedEngine):
    """One token, then nothing until the run's deadline; its abort raises."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        yield TokenDelta("a", 1)
        await asyncio.sleep(3600)


async def test_an_abort_that_fails_still_ends_the_run_with_its_terminal() -> None:
    """It raised out of the run: no reply, no event, and an offset never finished."""
    producer = _Producer()
    run = RequestRun(_assignment(timeout_s=0.2), _HangingEngine(abort_fails=True),
                     Publisher(producer, 5.0), _CFG)
    outcome = await asyncio.wait_for(run.run(), 10.0)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("timeout", "timeout", True)
    assert producer.terminals() == [("error", "timeout"), ("event.aborted", "timeout")]


async def test_text_without_a_token_at_the_end_is_sent_not_lost() -> None:
    producer = _Producer()
    await _run(_ScriptedEngine(TokenDelta("Hello", 1), TokenDelta(" world", 0), _STOP),
               producer)
    text = "".join(r["text"] for _, r in producer.records if r["kind"] == "chunk")
    assert text == "Hello world"
    assert producer.terminals() == [("done", None), ("event.done", None)]


async def test_a_terminal_that_cannot_be_built_still_answers_the_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last resort: an exception while building the ending used to send only
    event.failed; the client now gets Error(worker_lost) first, as its one terminal."""
    producer = _Producer()
    run = RequestRun(_assignment(), _FineEngine(0), Publisher(producer, 5.0), _CFG)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(run, "_answer", broken)
    outcome = await asyncio.wait_for(run.run(), 10.0)
    assert (outcome.kind, outcome.acked) == ("failed", True)
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]


async def test_the_last_resort_asks_the_lease_first_and_sends_nothing_when_fenced() -> None:
    """A review of the last resort: its Error went out without asking may_send, after the
    lease was refused (the scheduler has placed or ended the request elsewhere by then).
    Its event.failed, signed by this worker, went out still: read by the scheduler, it
    cancelled the requeue or worker_lost ending the scheduler held for the attempt, and
    the client got no terminal at all (found by a review)."""
    producer, lease = _Producer(), {"ok": True}

    async def may_send() -> bool:
        return lease["ok"]

    run = RequestRun(_assignment(), _FineEngine(0), Publisher(producer, 5.0), _CFG,
                     may_send=may_send)

    def broken(*args: Any, **kwargs: Any) -> Any:
        lease["ok"] = False  # the lease lapses, then the ending cannot be built
        raise RuntimeError("bug")

    run._answer = broken  # type: ignore[method-assign]
    outcome = await asyncio.wait_for(run.run(), 10.0)
    assert producer.terminals() == []  # the scheduler's to end: fenced
    assert (outcome.kind, outcome.acked) == ("superseded", True)


async def test_a_reply_whose_delivery_failed_is_replaced_by_the_last_resorts() -> None:
    """A review: a reply the producer took whose delivery then failed counted as sent, so
    when its resend raised (not a Kafka error), the client got no reply."""

    class Refusing(_Producer):
        async def send(self, topic: str, value: bytes, *, key: Any,
                       headers: Any = None) -> Any:
            if json.loads(value)["kind"] == "done":
                self.dones = getattr(self, "dones", 0) + 1
                if self.dones == 1:  # taken, then its delivery fails
                    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    failed.set_exception(KafkaTimeoutError())
                    return failed
                raise RuntimeError("a client bug on the resend")
            return await super().send(topic, value, key=key, headers=headers)

    producer = Refusing()
    await _run(_FineEngine(0), producer)
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]


async def test_a_reply_the_producer_never_took_is_replaced_by_the_last_resorts() -> None:
    """A review: the flag saying a terminal reply went was set before the producer took it;
    one whose send raised at once left the client with no reply."""

    class Flaky(_Producer):
        async def send(self, topic: str, value: bytes, *, key: Any,
                       headers: Any = None) -> Any:
            if json.loads(value)["kind"] == "done" and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("a client bug before the hand-over")
            return await super().send(topic, value, key=key, headers=headers)

    producer = Flaky()
    await _run(_FineEngine(0), producer)
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]


class _SlowProducer(_Producer):
    """A broker a little slower than the engine: the run falls behind, its inbox full."""

    async def send(self, topic: str, value: bytes, *, key: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[None]:
        await asyncio.sleep(0.004)
        return await super().send(topic, value, key=key, headers=headers)


class _FastEngine(_BrokenEngine):
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        for _ in range(self.tokens):
            await asyncio.sleep(0.001)
            yield TokenDelta("ab", 1)
        yield TokenDelta("", 0, finish_reason="length", prompt_tokens=7,
                         completion_tokens=self.tokens)


async def test_a_run_behind_its_engine_still_ends_at_its_deadline() -> None:
    # A wait on an inbox that already holds a delta returns without timing out: checked
    # only when a wait timed out, the deadline of a run behind its engine passed unseen,
    # and it streamed to the engine's end (2.8 s against a 0.3 s deadline; a review).
    producer = _SlowProducer()
    run = RequestRun(_assignment(timeout_s=0.3), _FastEngine(600), Publisher(producer, 5.0),
                     _CFG)
    out = await asyncio.wait_for(run.run(), 30)
    assert out.terminal == "timeout" and out.tokens < 600  # not "done" with all 600
