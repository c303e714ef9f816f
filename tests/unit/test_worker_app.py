"""The worker app's own watches, without a broker: a dead engine stops the worker, a
drain waits for the record being handled, and only a drain ends with a final heartbeat.

The worker is built as ``python -m services.worker`` builds it; the Kafka side is not
started, so only the tasks under test run. The full loop runs against a real broker in
tests/integration/test_worker_kafka.py and test_ops_drain.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from schemas.codec import encode
from schemas.workers import EventFirstToken, WorkerHeartbeat
from services.ops.drain_progress import DrainProgress
from services.worker.__main__ import build
from services.worker.app import Worker
from services.worker.engines.base import EngineError, GenerateRequest, TokenDelta
from services.worker.engines.sim.engine import SimEngine
from services.worker.kafka_io import Publisher
from tests.builders_schemas import make_admitted, make_assignment, make_request


def _worker(**overrides: Any) -> Worker:
    return build({"slot": 0, "worker_id": "w0", "time_scale": 0.01, **overrides})


async def _stop(worker: Worker) -> None:
    for task in worker._tasks:
        task.cancel()
    await asyncio.gather(*worker._tasks, return_exceptions=True)
    await worker.engine.close()


async def test_a_dead_engine_stops_the_worker_with_an_error() -> None:
    worker = _worker(heartbeat_interval_s=0.05)
    engine = worker.engine
    assert isinstance(engine, SimEngine)
    await engine.start()
    worker._spawn(worker._engine_watch())
    try:
        await asyncio.sleep(0.2)
        assert not worker._done.is_set()  # a live engine: nothing happens

        def broken_step(start: float) -> object:
            raise RuntimeError("core bug")

        engine._core.step = broken_step  # type: ignore[method-assign,assignment]
        request = GenerateRequest(request_id="r1", model="m", max_tokens=4, prompt_tokens=8)
        try:
            async for _ in engine.generate(request):
                pass
        except EngineError:
            pass  # the request ends worker_lost; the engine is dead now
        await asyncio.wait_for(worker._done.wait(), 5.0)
        assert worker._hard_stop  # run() returns 1: the scheduler declares the worker lost
    finally:
        await _stop(worker)


class _HoldingGuard:
    """Stand-in for the worker's ``Guard``: holds each record's handling until released,
    as a slow answer to a cancelled request or a held lease does."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def run(self, record: Any, handler: Callable[[], Awaitable[Any]]) -> str:
        await self.release.wait()
        return "finished"


async def test_a_drain_waits_for_the_record_being_handled() -> None:
    worker = _worker(drain_quiet_s=0.05)
    guard = _HoldingGuard()
    worker._guard = guard  # type: ignore[assignment]  # stand-in, see _HoldingGuard
    worker.draining = True
    worker._draining_acked_at = time.monotonic() - 10.0  # the draining beat is long known
    handling = asyncio.create_task(worker._on_record(SimpleNamespace(offset=0)))
    worker._spawn(worker._drain_watch())
    try:
        await asyncio.sleep(0.3)  # far past drain_quiet_s since the record arrived
        assert not worker._done.is_set()
        guard.release.set()
        await handling
        await asyncio.wait_for(worker._done.wait(), 2.0)
        assert not worker._hard_stop
    finally:
        await _stop(worker)


async def test_a_drained_prefill_worker_stays_until_its_hand_offs_kv_is_taken() -> None:
    worker = _worker(drain_quiet_s=0.05, role="prefill")
    followed: list[int] = []

    async def follow(held: int) -> None:  # stand-in: no broker to read llmq.events from
        followed.append(held)

    worker._follow_handoffs = follow  # type: ignore[method-assign]
    now = time.time()
    worker.handoffs.hold("t:a", 1, deadline=now + 60, now=now)
    worker.handoffs.hold("t:b", 1, deadline=now + 60, now=now)
    worker.draining = True
    worker._draining_acked_at = worker._last_record_at = time.monotonic() - 10.0
    worker._spawn(worker._drain_watch())
    try:
        await asyncio.sleep(0.3)  # idle, quiet, acknowledged: only the hand-offs hold it
        assert not worker._done.is_set() and followed and followed[-1] == 2

        def first_token(rid: str, attempt: int) -> EventFirstToken:
            return EventFirstToken(request_id=rid, tenant="t", attempt=attempt,
                                   worker_id="w1", ts=time.time(), ttft_s=0.1)

        await worker._on_event(first_token("t:a", 2))
        await worker._on_event(first_token("t:b", 1))  # its own attempt: not the decode
        await asyncio.sleep(0.2)
        assert not worker._done.is_set() and followed[-1] == 1
        assert worker.heartbeat_fields().waiting == 1  # a hard stop now is not clean
        # Fenced meanwhile: t:b's decode stage may be placed and still pull from this
        # engine, so the hold stays.
        worker._fence("test")
        await asyncio.sleep(0.2)
        assert not worker._done.is_set()
        await worker._on_event(first_token("t:b", 2))
        await asyncio.wait_for(worker._done.wait(), 2.0)
        assert not worker._hard_stop and worker.heartbeat_fields().waiting == 0
    finally:
        await _stop(worker)


class _Producer:
    """Stand-in for the aiokafka producer: every send is acknowledged and kept."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    async def send(self, topic: str, value: bytes, *, key: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[None]:
        self.records.append((topic, json.loads(value)))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


@pytest.mark.parametrize(("hard_stop", "outcome"), [(False, "drained"), (True, "lost")])
async def test_only_a_finished_drain_ends_with_a_final_heartbeat(hard_stop: bool,
                                                                  outcome: str) -> None:
    # A second signal mid-drain cancels the run, which aborts it in the engine: a final
    # beat would then say "draining, nothing running" and `llmq drain --wait` would report
    # a clean drain though the request got no terminal. Its last word must be the beat
    # that still shows the run.
    worker = _worker(time_scale=1.0)  # real time: the run is still going when stopped
    await worker.engine.start()
    producer = _Producer()
    worker._publisher = Publisher(producer, 5.0)
    worker._serving = True  # as once it holds its slot; the Kafka side is not started
    worker.lease.restart(time.monotonic())
    await worker._heartbeat()  # what `llmq drain` reads first
    if hard_stop:
        now = time.time()
        request = make_request(request_id="r1", model=worker.id.model, max_tokens=4000,
                               timeout_s=600, created_at=now)
        admitted = make_admitted(request=request, reply_topic="p.replies.acme",
                                 admitted_at=now)
        worker._start_run(make_assignment(admitted=admitted, worker_id="w0", partition=0,
                                          deadline=now + 600, assigned_at=now), 0, None)
        await asyncio.sleep(0.2)
        assert worker.engine.capacity().running == 1
    worker.begin_drain("SIGTERM")
    await worker._heartbeat()  # the draining beat
    if hard_stop:
        worker.stop_now()
    await worker._shutdown()

    beats = [WorkerHeartbeat.model_validate(record) for topic, record in producer.records
             if topic == worker.topics.heartbeats]
    assert len(beats) == (2 if hard_stop else 3)
    progress = DrainProgress(beats[0])
    for beat in beats[1:]:
        progress.observe(beat)
    assert progress.outcome(beats[-1].ts + 60) == outcome


class _Stalling(_Producer):
    """A producer whose ``event.prefilled`` sends are never acknowledged: the broker is
    slow, and the process is fenced meanwhile."""

    async def send(self, topic: str, value: bytes, *, key: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[None]:
        if b'"event.prefilled"' not in value:
            return await super().send(topic, value, key=key, headers=headers)
        self.records.append((topic, json.loads(value)))
        return asyncio.get_running_loop().create_future()  # never done


@pytest.mark.parametrize("fenced", [False, True])
async def test_a_prefill_stage_that_handed_its_kv_on_is_held(fenced: bool) -> None:
    # Held from the moment its event.prefilled may be in the log: acknowledged, or sent
    # and then cut short by a fence (the decode stage may be placed all the same).
    worker = _worker(role="prefill")
    await worker.engine.start()
    producer = _Stalling() if fenced else _Producer()
    worker._publisher = Publisher(producer, 0.3)  # a stalled send is given up quickly
    worker._serving = True
    worker.lease.restart(time.monotonic())
    now = time.time()
    request = make_request(request_id="r1", model=worker.id.model, max_tokens=40,
                           timeout_s=600, created_at=now)
    admitted = make_admitted(request=request, reply_topic="p.replies.acme", admitted_at=now)
    try:
        worker._start_run(make_assignment(admitted=admitted, worker_id="w0", partition=0,
                                          deadline=now + 600, assigned_at=now,
                                          phase="prefill"), 0, None)
        (task,) = worker._run_tasks
        if fenced:
            for _ in range(100):
                if any(r.get("kind") == "event.prefilled" for _, r in producer.records):
                    break
                await asyncio.sleep(0.02)
            worker._fence("test")
        await asyncio.wait_for(task, 5.0)
        assert [r["kind"] for _, r in producer.records].count("event.prefilled") >= 1
        assert worker.handoffs.held(time.time()) == 1
        assert worker.handoffs.since() is not None and worker.handoffs.since() <= now + 1
    finally:
        await _stop(worker)


def _record_generate(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids the worker's engine is asked to generate from then on."""
    asked: list[str] = []
    generate = worker.engine.generate

    def recording(request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        asked.append(request.request_id)
        return generate(request)

    monkeypatch.setattr(worker.engine, "generate", recording)
    return asked


@pytest.mark.parametrize(("model", "ran_before", "code"), [
    # Misrouted or forged: running it would answer with the wrong model. Its one terminal
    # is worker_lost (the fleet's fault, retryable).
    ("another-model", False, "worker_lost"),
    # The scheduler forgot the first use of the id (past its deadline plus its log's
    # memory) and placed the reuse; dropped as a duplicate, it got no answer and its
    # booking stayed. Answered invalid: ids are single-use.
    (None, True, "invalid"),
], ids=["another model", "an id reused"])
async def test_an_assignment_this_worker_must_not_run_is_answered_unrun(
        model: str | None, ran_before: bool, code: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    worker = _worker()
    asked = _record_generate(worker, monkeypatch)
    await worker.engine.start()
    producer = _Producer()
    worker._publisher = Publisher(producer, 5.0)
    worker._serving = True
    worker.lease.restart(time.monotonic())
    now = time.time()
    if ran_before:
        worker.ledger.record("r1", 1, now - 7_200)  # another admission, two hours ago
    request = make_request(request_id="r1", model=model or worker.id.model, max_tokens=40,
                           timeout_s=600, created_at=now)
    admitted = make_admitted(request=request, reply_topic="p.replies.acme", admitted_at=now)
    try:
        record = SimpleNamespace(offset=0, headers=[], value=encode(make_assignment(
            admitted=admitted, worker_id="w0", partition=0, deadline=now + 600,
            assigned_at=now, worker_started_at=worker.started_at)))
        assert await worker._admit(record) == "running"
        (task,) = worker._run_tasks
        await asyncio.wait_for(task, 5.0)
        kinds = [(topic, r["kind"], r.get("code")) for topic, r in producer.records]
        assert ("p.replies.acme", "error", code) in kinds
        assert (worker.topics.events, "event.failed", code) in kinds
        assert not any(kind == "event.started" for _, kind, _ in kinds)
        assert asked == []  # the engine never saw it
    finally:
        await _stop(worker)


@pytest.mark.parametrize(("max_in_flight", "cap"), [(None, 1024), (8, 8)])
async def test_the_in_flight_cap_is_the_started_engines_max_num_seqs(
    max_in_flight: int | None, cap: int,
) -> None:
    """Found by an audit: read before the engine started, the cap was the profile's 256
    while a vLLM started with max_num_seqs 1024 reported 1024 in every heartbeat."""
    import dataclasses

    worker = _worker(**({} if max_in_flight is None else {"max_in_flight": max_in_flight}))
    engine = worker.engine
    profile_capacity = engine.capacity
    started = engine.start

    async def start() -> None:
        await started()
        engine.capacity = lambda: dataclasses.replace(  # type: ignore[method-assign]
            profile_capacity(), max_num_seqs=1024)

    engine.start = start  # type: ignore[method-assign]
    assert worker._max_in_flight == (max_in_flight or 256)
    await worker._start_engine()
    try:
        assert worker._max_in_flight == cap
    finally:
        await engine.close()


class _SentPublisher:
    """Stand-in publisher: records what is sent, every record acknowledged."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    async def send(self, topic: str, msg: Any, headers: Any = None) -> asyncio.Future[Any]:
        self.sent.append((topic, msg))
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def acked(self, futures: Any) -> bool:
        return True


async def test_an_assignment_that_does_not_decode_is_ended_worker_lost() -> None:
    """Found by an audit of the commits: dead-lettered and finished unanswered (a newer
    wire schema during a rolling upgrade), its attempt stayed active in the scheduler's
    log, its KV booked on this worker, and its client waited out its timeout."""
    from services.common.guard import Guard

    worker = _worker()
    dead: list[Any] = []

    async def dead_letter(key: Any, value: Any, headers: Any) -> None:
        dead.append(value)

    worker._guard = Guard(dead_letter, name="worker.slot0")
    publisher = _SentPublisher()
    worker._publisher = publisher  # type: ignore[assignment]  # stand-in, see above
    try:
        def record(offset: int, **changes: Any) -> SimpleNamespace:
            raw = json.loads(encode(make_assignment(
                worker_id="w0", partition=0, worker_started_at=worker.started_at)))
            raw["schema_version"] += 1
            raw.update(changes)
            return SimpleNamespace(topic="llmq.assignments", partition=0, offset=offset,
                                   key=b"k", value=json.dumps(raw).encode(), headers=[])

        await worker._on_record(record(41))
        assert len(dead) == 1 and worker.tracker.commit_point() == 42
        [(reply_topic, reply), (events_topic, event)] = publisher.sent
        assert (reply.kind, reply.code, reply.attempt) == ("error", "worker_lost", 1)
        assert reply_topic.startswith("llmq.replies.") and events_topic == "llmq.events"
        assert (event.kind, event.code, event.worker_id) == ("event.failed", "worker_lost",
                                                             "w0")
        await worker._on_record(record(42, worker_id="w9"))  # another worker's: not ours
        await worker._on_record(record(43, worker_started_at=1.0))  # an earlier process's
        # Found by a review of the first version: a second copy of the same attempt (the
        # scheduler sends again) was answered again; the ledger's gate applies now.
        await worker._on_record(record(44))
        assert len(publisher.sent) == 2 and len(dead) == 4
        await worker._on_record(record(45, attempt=2))  # a newer attempt: answered
        assert [m.attempt for _, m in publisher.sent] == [1, 1, 2, 2]
        # Found by a review: a number past a float killed the consumer (the offset never
        # finished), and a NaN admission time refused the id in the dedupe ledger.
        for offset, admitted_at in ((46, "1" + "0" * 400), (47, "NaN")):
            raw = json.loads(record(offset, attempt=3).value)
            text = json.dumps(raw).replace(str(raw["admitted"]["admitted_at"]), admitted_at)
            await worker._on_record(SimpleNamespace(
                topic="llmq.assignments", partition=0, offset=offset, key=b"k",
                value=text.encode(), headers=[]))
        assert len(publisher.sent) == 4 and worker.tracker.commit_point() == 48
    finally:
        await worker.engine.close()
