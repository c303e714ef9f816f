"""The worker's side of prefill and decode apart: a prefill stage's run (``event.prefilled``,
nothing to the client), its other endings, a decode stage's run, the ``sim`` engine's fake
KV connector against hand-computed step times, the role setting and the heartbeat.

Runs use the stand-ins of tests/unit/test_worker_runner.py (a producer that records and
fails sends on cue); the engines here are stand-ins of our own interface too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

import pytest
from aiokafka.errors import (
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    TopicAuthorizationFailedError,
)
from pydantic import ValidationError

from schemas.common import Phase, engine_rank
from schemas.requests import Assignment
from schemas.workers import WorkerHeartbeat
from services.worker.__main__ import _parse, build
from services.worker.__main__ import main as worker_main
from services.worker.engines.base import (
    EngineCapacity,
    EngineError,
    GenerateRequest,
    TokenDelta,
)
from services.worker.engines.registry import check_role
from services.worker.engines.sim.engine import SimEngine
from services.worker.engines.sim.model import StepResult
from services.worker.engines.sim.profiles import get_profile
from services.worker.engines.vllm import VllmEngine
from services.worker.kafka_io import Publisher
from services.worker.runner import (
    MAX_PREFILLED_BYTES,
    Outcome,
    RequestRun,
    RunConfig,
    StopReason,
    engine_request,
)
from services.worker.settings import WorkerSettings
from tests.unit.test_worker_app import _Producer as _AckingProducer
from tests.unit.test_worker_runner import _CFG, EVENTS, REPLIES, _assignment, _Gate, _Producer

PROFILE = get_profile("llama3-8b-h100")
#: What the stand-in prefill engine reports: an engine's own keys, JSON values.
PARAMS: Mapping[str, object] = {"remote_engine_id": "e-1", "remote_block_ids": [3, 4],
                                "remote_port": 5600, "do_remote_prefill": True}


class _StageEngine:
    """Stand-in engine: records each request; yields ``deltas`` (``hang``: none, it runs
    until aborted), or raises ``error`` first."""

    name = "stage"
    disaggregation = True

    def __init__(self, deltas: list[TokenDelta] | None = None, *, hang: bool = False,
                 error: EngineError | None = None) -> None:
        self.deltas = deltas or []
        self.hang = hang
        self.error = error
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []

    async def start(self) -> None: ...
    async def close(self) -> None: ...

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        if self.hang:
            await asyncio.Event().wait()
        for delta in self.deltas:
            await asyncio.sleep(0)
            yield delta

    def capacity(self) -> EngineCapacity:
        return EngineCapacity(100, 100, 0, 0, 16, 0, 0, 4)


def _prefilled_delta(kv_transfer: Mapping[str, object] | None = PARAMS) -> TokenDelta:
    return TokenDelta(" the", 1, finish_reason="length", prompt_tokens=9, completion_tokens=1,
                      kv_transfer=kv_transfer)


def _stage(phase: Phase, timeout_s: float = 600.0,
           kv_transfer: dict[str, Any] | None = None) -> Assignment:
    return _assignment(timeout_s).evolve(phase=phase, kv_transfer=kv_transfer)


class _Counted:
    """The worker's token and TTFT callbacks, recorded."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ttfts: list[float] = []


async def _run_stage(assignment: Assignment, engine: Any, producer: _Producer,
                     cfg: RunConfig = _CFG, counted: _Counted | None = None,
                     gate: _Gate | None = None, runs: list[RequestRun] | None = None,
                     ) -> Outcome:
    """Run ``assignment`` to its end (the run is appended to ``runs``)."""
    counted = counted or _Counted()
    run = RequestRun(assignment, engine, Publisher(producer, 5.0), cfg,
                     on_tokens=counted.tokens.append, on_first_token=counted.ttfts.append,
                     may_send=gate)
    if runs is not None:
        runs.append(run)
    return await asyncio.wait_for(run.run(), 10.0)


def _kinds(producer: _Producer, topic: str | None = None) -> list[str]:
    return [r["kind"] for t, r in producer.records if topic is None or t == topic]


# ---- the engine request --------------------------------------------------------------
def test_a_prefill_asks_for_one_token_at_its_phases_rank_and_a_decode_carries_the_params(
) -> None:
    # Low class (as admitted: no aged class), short lane: rank 4 whole, 3 as a prefill
    # (every short prompt before the long ones, schemas.common.engine_rank).
    prefill = engine_request(_stage("prefill").evolve(engine_priority=None), "r1#1")
    assert (prefill.phase, prefill.max_tokens, prefill.priority, prefill.kv_transfer) == \
        ("prefill", 1, 3, None)
    assert prefill.priority == engine_rank(2, "short", "prefill") != engine_rank(2, "short")
    decode = engine_request(_stage("decode", kv_transfer=dict(PARAMS)).evolve(
        engine_priority=None), "r1#2")
    assert (decode.phase, decode.max_tokens, decode.priority) == ("decode", 8, 4)
    assert decode.kv_transfer == PARAMS
    whole = engine_request(_assignment(), "r1#1")
    assert (whole.phase, whole.max_tokens, whole.kv_transfer) == ("whole", 8, None)


# ---- a prefill stage that hands its KV on -----------------------------------------------
async def test_a_prefill_sends_event_prefilled_and_nothing_to_the_client() -> None:
    producer, counted = _Producer(), _Counted()
    engine = _StageEngine([TokenDelta(" a", 0), _prefilled_delta()])
    outcome = await _run_stage(_stage("prefill"), engine, producer, counted=counted)
    assert (outcome.kind, outcome.terminal, outcome.acked, outcome.e2e_s, outcome.tokens) == \
        ("prefilled", None, True, None, 0)
    assert [t for t, _ in producer.records] == [EVENTS, EVENTS]  # nothing on REPLIES
    assert _kinds(producer) == ["event.started", "event.prefilled"]
    prefilled = producer.records[1][1]
    assert prefilled["kv_transfer"] == PARAMS
    assert (prefilled["prompt_tokens"], prefilled["attempt"], prefilled["worker_id"]) == \
        (9, 1, "w")
    assert counted.tokens == [] and counted.ttfts == []  # its token is discarded
    [request] = engine.requests
    assert (request.phase, request.max_tokens) == ("prefill", 1)
    assert engine.aborted == []  # it finished: nothing to free


# Sends: 0 event.started, 1 event.prefilled (then more for every try again).
@pytest.mark.parametrize(("fail", "nack", "sends"), [
    (frozenset({1}), frozenset(), 3),  # its send raises once
    (frozenset({1, 2, 3}), frozenset(), 5),  # ... three times
    (frozenset(), frozenset({1, 2}), 4),  # it is lost twice (no ack)
    (frozenset(), frozenset({0}), 3),  # event.started is lost: sent again first
])
async def test_event_prefilled_is_sent_again_until_acknowledged(
    fail: frozenset[int], nack: frozenset[int], sends: int,
) -> None:
    producer = _Producer(fail=fail, nack=nack)
    outcome = await _run_stage(_stage("prefill"), _StageEngine([_prefilled_delta()]), producer)
    assert (outcome.kind, outcome.acked) == ("prefilled", True)
    assert _kinds(producer) == ["event.started", "event.prefilled"]
    assert producer.sends == sends


@pytest.mark.parametrize(("opens", "kinds", "kind"), [
    (1, ["event.started"], "superseded"),  # fenced at the end's first check
    (2, ["event.started"], "superseded"),  # ... at its send's check
    (3, ["event.started", "event.prefilled"], "prefilled"),
])
async def test_a_fenced_prefill_sends_no_event_prefilled(
    opens: int, kinds: list[str], kind: str,
) -> None:
    producer, runs = _Producer(), []
    outcome = await _run_stage(_stage("prefill"), _StageEngine([_prefilled_delta()]), producer,
                               gate=_Gate(opens), runs=runs)
    assert (outcome.kind, outcome.terminal, outcome.acked) == (kind, None, True)
    assert _kinds(producer) == kinds
    # Held for a decode stage only if offered (found by an audit: a prefill fenced before
    # its event.prefilled went was held too, and a draining worker waited on it).
    assert runs[0].handed_off == ("event.prefilled" in kinds)


@pytest.mark.parametrize("error", [TopicAuthorizationFailedError, MessageSizeTooLargeError])
@pytest.mark.parametrize("how", ["raises", "is refused"])
async def test_an_event_prefilled_the_broker_refuses_fails_the_run_for_the_client(
    error: type[Exception], how: str,
) -> None:
    # Certainly not written, so no decode stage follows: the client got no answer at all
    # (and ingest's HTTP side a 504 past the timeout) when only event.failed went out.
    fail, nack = (frozenset({1}), frozenset()) if how == "raises" else (frozenset(), frozenset({1}))
    producer = _Producer(fail=fail, nack=nack, error=error)
    outcome = await _run_stage(_stage("prefill"), _StageEngine([_prefilled_delta()]), producer)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("failed", "worker_lost", True)
    assert outcome.e2e_s is not None
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]
    assert _kinds(producer, REPLIES) == ["error"]
    assert "event.prefilled" not in _kinds(producer)
    error_reply, failed = producer.records[-2][1], producer.records[-1][1]
    assert "refuses its event.prefilled" in error_reply["message"]
    assert failed["message"] == error_reply["message"]
    assert failed["usage"]["prompt_tokens"] == 9  # the engine's count, kept


class _PrefilledDown(_Producer):
    """The events topic takes everything but ``event.prefilled``, which fails transiently
    every time (a broker that does not answer in time)."""

    async def send(self, topic: str, value: bytes, *, key: bytes,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[None]:
        if json.loads(value)["kind"] == "event.prefilled":
            self.sends += 1
            raise KafkaTimeoutError()
        return await super().send(topic, value, key=key, headers=headers)


async def test_an_event_prefilled_given_up_past_the_deadline_only_ends_the_attempt() -> None:
    # It may yet have been written (and its decode stage placed): no reply to the client.
    producer = _PrefilledDown()
    outcome = await _run_stage(_stage("prefill", timeout_s=0.2),
                               _StageEngine([_prefilled_delta()]), producer,
                               cfg=replace(_CFG, give_up_after_s=0.1))
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("prefilled", None, True)
    assert producer.terminals() == [("event.failed", "worker_lost")]
    assert _kinds(producer, REPLIES) == []
    failed = producer.records[-1][1]
    assert failed["message"] == "its event.prefilled could not be sent"


# ---- a prefill stage that ends otherwise: a whole run's ending -------------------------
@pytest.mark.parametrize(("kv_transfer", "says"), [
    (None, "without KV-transfer parameters"),  # the engine gave none
    ({f"k{i}": i for i in range(65)}, "cannot go on the wire"),  # over 64 keys
    # Over Kafka's default record limit, encoded: the broker would refuse it.
    ({"blocks": list(range(200_000))}, "KV-transfer parameters are too large"),
])
async def test_a_prefill_without_usable_params_fails_worker_lost(
    kv_transfer: dict[str, object] | None, says: str,
) -> None:
    producer = _Producer()
    outcome = await _run_stage(_stage("prefill"), _StageEngine([_prefilled_delta(kv_transfer)]),
                               producer)
    assert (outcome.kind, outcome.terminal, outcome.acked) == ("failed", "worker_lost", True)
    assert producer.terminals() == [("error", "worker_lost"), ("event.failed", "worker_lost")]
    assert "event.prefilled" not in _kinds(producer)
    assert _kinds(producer, REPLIES) == ["error"]  # the client's one terminal, no chunk
    assert says in producer.records[-1][1]["message"]


async def test_params_just_under_the_bound_go_out() -> None:
    # The bound is on the encoded event, not on the parameters alone.
    producer = _Producer()
    params = {"blob": "x" * (MAX_PREFILLED_BYTES - 1024)}
    outcome = await _run_stage(_stage("prefill"), _StageEngine([_prefilled_delta(params)]),
                               producer)
    assert (outcome.kind, outcome.acked) == ("prefilled", True)
    assert len(json.dumps(producer.records[-1][1], separators=(",", ":"))) <= MAX_PREFILLED_BYTES


async def test_a_prefill_past_its_deadline_times_out_for_the_client() -> None:
    producer, engine = _Producer(), _StageEngine(hang=True)
    outcome = await _run_stage(_stage("prefill", timeout_s=0.2), engine, producer)
    assert (outcome.kind, outcome.terminal) == ("timeout", "timeout")
    assert producer.terminals() == [("error", "timeout"), ("event.aborted", "timeout")]
    assert engine.aborted == ["r1#1"]


async def _stopped_prefill(reason: StopReason, message: str) -> tuple[Outcome, _Producer,
                                                                    _StageEngine]:
    """A prefill run stopped (``reason``) once its engine has the request."""
    producer, engine = _Producer(), _StageEngine(hang=True)
    run = RequestRun(_stage("prefill"), engine, Publisher(producer, 5.0), _CFG)
    task = asyncio.create_task(run.run())
    while not engine.requests:
        await asyncio.sleep(0.001)
    run.stop(reason, message)
    return await asyncio.wait_for(task, 5.0), producer, engine


async def test_a_cancelled_prefill_ends_cancelled_for_the_client() -> None:
    outcome, producer, engine = await _stopped_prefill("cancelled", "client went away")
    assert (outcome.kind, outcome.terminal) == ("cancelled", "cancelled")
    assert producer.terminals() == [("error", "cancelled"), ("event.aborted", "cancelled")]
    assert engine.aborted == ["r1#1"]


async def test_a_prefill_the_engine_refuses_fails_with_its_code() -> None:
    producer = _Producer()
    engine = _StageEngine(error=EngineError("too_large", "prompt over the model's length"))
    outcome = await _run_stage(_stage("prefill"), engine, producer)
    assert (outcome.kind, outcome.terminal) == ("failed", "too_large")
    assert producer.terminals() == [("error", "too_large"), ("event.failed", "too_large")]


async def test_a_superseded_prefill_ends_unanswered() -> None:
    outcome, producer, _ = await _stopped_prefill("superseded", "attempt 2 replaces it")
    assert (outcome.kind, outcome.acked) == ("superseded", True)
    assert _kinds(producer) == ["event.started"]


# ---- a decode stage ----------------------------------------------------------------
async def test_a_decode_streams_to_the_client_with_the_prefills_params() -> None:
    producer, counted = _Producer(), _Counted()
    engine = _StageEngine([TokenDelta(" a", 1), TokenDelta(" b", 1, finish_reason="length",
                                                           prompt_tokens=9,
                                                           completion_tokens=2)])
    outcome = await _run_stage(_stage("decode", kv_transfer=dict(PARAMS)), engine, producer,
                               counted=counted)
    assert (outcome.kind, outcome.terminal, outcome.acked, outcome.tokens) == \
        ("done", "done", True, 2)
    assert _kinds(producer) == ["event.started", "event.first_token", "chunk", "chunk", "done",
                                "event.done"]
    [request] = engine.requests
    assert (request.phase, request.kv_transfer, request.max_tokens) == ("decode", PARAMS, 8)
    assert counted.tokens == [1, 1] and len(counted.ttfts) == 1


# ---- the sim engine's fake connector ---------------------------------------------------
# llama3-8b-h100 in integer ns (the core's clock): β0 = 5_752_705, β1 = 17_251 per prefill
# token, β2 = 5_999 per decode token.
def _recorded(engine: SimEngine) -> list[StepResult]:
    """Every step the engine's core runs, from now on."""
    steps: list[StepResult] = []
    step = engine._core.step

    def recording(now: float) -> StepResult:
        result = step(now)
        steps.append(result)
        return result

    engine._core.step = recording  # type: ignore[method-assign]  # a spy on the core
    return steps


def _sim_req(phase: Phase, request_id: str = "r1#1", prompt_tokens: int = 100,
             max_tokens: int = 3, kv_transfer: Mapping[str, object] | None = None
             ) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model="m", max_tokens=max_tokens,
                           prompt_tokens=prompt_tokens, prompt="hello", phase=phase,
                           kv_transfer=kv_transfer)


async def _sim(time_scale: float = 0.0, **profile_changes: Any) -> SimEngine:
    engine = SimEngine(replace(PROFILE, **profile_changes), time_scale=time_scale, seed=1)
    await engine.start()
    return engine


def _ns(steps: list[StepResult]) -> list[tuple[int, int, int]]:
    """(duration ns, prefill tokens, decode tokens) of each step that ran."""
    return [(round(s.duration_s * 1e9), s.prefill_tokens, s.decode_tokens)
            for s in steps if s.duration_s > 0]


async def test_a_sim_prefill_computes_the_prompt_samples_one_token_and_reports_params(
) -> None:
    engine = await _sim()
    steps = _recorded(engine)
    try:
        deltas = [d async for d in engine.generate(_sim_req("prefill", max_tokens=50))]
    finally:
        await engine.close()
    # One step: β0 + 100 · β1 = 5_752_705 + 1_725_100 ns.
    assert _ns(steps) == [(7_477_805, 100, 0)]
    [last] = deltas
    assert (last.tokens, last.finish_reason, last.prompt_tokens, last.completion_tokens) == \
        (1, "length", 100, 1)
    assert last.kv_transfer == {"engine": "sim", "prompt_tokens": 100}
    assert engine.capacity().kv_free_tokens == PROFILE.kv_total_tokens


async def test_a_sim_decode_computes_only_the_last_prompt_token_then_decodes() -> None:
    engine = await _sim()
    try:
        [prefilled] = [d async for d in engine.generate(_sim_req("prefill"))]
        steps = _recorded(engine)
        deltas = [d async for d in engine.generate(
            _sim_req("decode", "r1#2", kv_transfer=prefilled.kv_transfer))]
    finally:
        await engine.close()
    # 99 prompt tokens arrived: the first step computes 1 (β0 + β1 = 5_769_956 ns) and
    # samples the first token; then two decode steps (β0 + β2 = 5_758_704 ns).
    assert _ns(steps) == [(5_769_956, 1, 0), (5_758_704, 0, 1), (5_758_704, 0, 1)]
    assert [d.tokens for d in deltas] == [1, 1, 1]
    last = deltas[-1]
    assert (last.finish_reason, last.completion_tokens, last.prompt_tokens, last.kv_transfer) \
        == ("length", 3, 100, None)


@pytest.mark.parametrize(("kv_transfer", "names"), [
    (None, "needs kv_transfer"),
    ({"engine": "vllm", "prompt_tokens": 100}, "kv_transfer.engine"),
    ({"prompt_tokens": 100}, "kv_transfer.engine"),
    ({"engine": "sim", "prompt_tokens": 99}, "kv_transfer.prompt_tokens"),
    ({"engine": "sim", "prompt_tokens": "100"}, "kv_transfer.prompt_tokens"),
    ({"engine": "sim"}, "kv_transfer.prompt_tokens"),
])
async def test_a_sim_decode_refuses_params_no_sim_prefill_made(
    kv_transfer: Mapping[str, object] | None, names: str,
) -> None:
    engine = await _sim()
    try:
        with pytest.raises(EngineError) as refused:
            async for _ in engine.generate(_sim_req("decode", kv_transfer=kv_transfer)):
                pass
    finally:
        await engine.close()
    # The fleet's fault (a prefill of another engine), not the client's: 503, retryable.
    assert refused.value.code == "worker_lost"
    assert names in refused.value.message


async def test_a_sim_prefill_needs_room_for_its_prompt_and_one_token_only() -> None:
    engine = await _sim(num_blocks=4)  # 64 tokens of KV
    try:
        [last] = [d async for d in engine.generate(
            _sim_req("prefill", prompt_tokens=60, max_tokens=100))]
        assert last.completion_tokens == 1
        with pytest.raises(EngineError) as refused:
            async for _ in engine.generate(_sim_req("whole", "r2#1", prompt_tokens=60,
                                                    max_tokens=100)):
                pass
        assert refused.value.code == "too_large"
    finally:
        await engine.close()


# ---- the role: settings, startup check, heartbeat --------------------------------------
def test_the_role_comes_from_a_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings(slot=0).role == "mixed"
    assert WorkerSettings(**_parse(["--slot", "0", "--role", "prefill"])).role == "prefill"
    monkeypatch.setenv("LLMQ_WORKER_ROLE", "decode")
    assert WorkerSettings(slot=0).role == "decode"
    with pytest.raises(ValidationError):
        WorkerSettings(slot=0, role="both")  # type: ignore[arg-type]  # deliberately wrong


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_split_role_needs_an_engine_that_runs_the_phases_apart(role: str) -> None:
    assert build({"slot": 0, "worker_id": "w0", "role": role}).id.role == role  # sim can
    with pytest.raises(ValueError, match=f"role {role} needs") as refused:
        build({"slot": 0, "worker_id": "w0", "role": role, "engine": "vllm"})
    assert "the vllm engine does not (engines that do: sim, openai)" in str(refused.value)
    check_role("mixed", VllmEngine("m", profile=PROFILE))  # mixed: any engine


def test_a_split_role_on_an_engine_without_it_exits_2(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert worker_main(["--slot", "0", "--role", "decode", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "role decode needs" in err


@pytest.mark.parametrize("role", ["mixed", "prefill", "decode"])
async def test_the_heartbeat_reports_the_role(role: str) -> None:
    worker = build({"slot": 0, "worker_id": "w0", "role": role})
    producer = _AckingProducer()
    worker._publisher = Publisher(producer, 5.0)
    worker.lease.restart(time.monotonic())
    try:
        await worker._heartbeat()
    finally:
        await worker.engine.close()
    [beat] = [WorkerHeartbeat.model_validate(r) for topic, r in producer.records
              if topic == worker.topics.heartbeats]
    assert beat.role == role
