"""The ``openai`` engine's handling of what a vLLM server streams and publishes.

Against a FAKE OpenAI-compatible server written here (Starlette on uvicorn, 127.0.0.1, a
free port): every stream sends the SSE payloads the test scripts, then ``[DONE]``; a
non-streaming request (a prefill stage) gets the JSON answer the test sets; ``/metrics``
serves the text the test sets. No Kafka.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from schemas.common import Phase
from services.worker.engines import openai
from services.worker.engines.base import EngineAborted, EngineError, GenerateRequest, TokenDelta
from services.worker.engines.openai import Handoff, OpenAIEngine
from services.worker.engines.sim.model import EngineProfile
from services.worker.engines.sim.profiles import get_profile
from tests.fakes.http_server import serving

pytestmark = pytest.mark.timeout(60)

PROFILE = get_profile("llama3-8b-h100")
METRICS = ("vllm:kv_cache_usage_perc 0.25\nvllm:num_requests_running 1\n"
           'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1\n')


def text(piece: str, finish: str | None = None, usage: int | None = None) -> dict[str, Any]:
    """A /v1/completions chunk; ``usage``: the cumulative completion tokens it reports."""
    event: dict[str, Any] = {"choices": [{"index": 0, "text": piece, "finish_reason": finish}]}
    if usage is not None:
        event["usage"] = {"prompt_tokens": 3, "completion_tokens": usage}
    return event


def final_usage(completion_tokens: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens}}


#: kv_transfer_params as a vLLM prefill server with NixlConnector answers them.
NIXL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
               "remote_block_ids": [1, 2, 3], "remote_engine_id": "eng-p",
               "remote_request_id": "cmpl-x", "remote_host": "10.0.0.5", "remote_port": 5600,
               "tp_size": 1}


def prefill_answer(params: dict[str, Any] | None = NIXL_PARAMS,
                   finish: str = "length") -> dict[str, Any]:
    """A non-streaming /v1/completions answer of one token."""
    answer: dict[str, Any] = {
        "id": "cmpl-x", "object": "text_completion", "model": "m",
        "choices": [{"index": 0, "text": " the", "finish_reason": finish}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    if params is not None:
        answer["kv_transfer_params"] = params
    return answer


@dataclass
class FakeServer:
    """What the FAKE server answers and what it saw."""

    events: list[dict[str, Any]] = field(
        default_factory=lambda: [text(" a"), text("", "length"), final_usage(1)])
    status: int = 200
    error: dict[str, Any] = field(default_factory=dict)
    metrics: str = METRICS
    hold: asyncio.Event | None = None  # when set, streams wait for it after their first event
    streaming: int = 0  # streams open now
    bodies: list[dict[str, Any]] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)  # X-Request-Id, per request
    strict: bool = False  # refuses stream_options it does not know, as OpenAI's API does
    flat_errors: bool = False  # its error body is {"object": "error", "message": ...}
    answer: dict[str, Any] = field(default_factory=prefill_answer)  # for stream: false
    metrics_hold: asyncio.Event | None = None  # when set, /metrics waits for it
    metrics_status: int = 200  # 404: a server without /metrics
    headers_hold: asyncio.Event | None = None  # when set, a stream's headers wait for it

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            self.request_ids.append(request.headers.get("x-request-id"))
            if self.strict and "continuous_usage_stats" in body.get("stream_options", {}):
                message = "Unknown parameter: 'stream_options.continuous_usage_stats'."
                if self.flat_errors:  # vLLM's older servers and their kin
                    return JSONResponse({"object": "error", "message": message,
                                         "type": "BadRequestError", "param": None,
                                         "code": 400}, status_code=400)
                return JSONResponse({"error": {
                    "message": message,
                    "type": "invalid_request_error", "code": "unknown_parameter"}},
                    status_code=400)
            if self.status != 200:
                return JSONResponse(self.error, status_code=self.status)
            if body.get("stream") is False:
                if self.hold is not None:
                    await self.hold.wait()
                return JSONResponse(self.answer)
            if self.headers_hold is not None:
                await self.headers_hold.wait()
            return StreamingResponse(self._stream(), media_type="text/event-stream")

        async def metrics(_: Request) -> Response:
            if self.metrics_hold is not None:
                await self.metrics_hold.wait()
            return PlainTextResponse(self.metrics, status_code=self.metrics_status)

        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                                 Route("/metrics", metrics)])

    async def _stream(self) -> AsyncIterator[bytes]:
        self.streaming += 1
        try:
            for i, event in enumerate(self.events):
                yield f"data: {json.dumps(event)}\n\n".encode()
                if i == 0 and self.hold is not None:
                    await self.hold.wait()
            yield b"data: [DONE]\n\n"
        finally:
            self.streaming -= 1


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, FakeServer]]:
    fake = FakeServer()
    async with serving(fake.app()) as url:
        try:
            yield url, fake
        finally:
            if fake.hold is not None:
                fake.hold.set()  # held streams end, so the server can stop


async def started(url: str, profile: EngineProfile = PROFILE, **options: Any) -> OpenAIEngine:
    engine = OpenAIEngine(url, "m", profile=profile, **options)
    await engine.start()
    return engine


def make_req(request_id: str = "r1") -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model="m", max_tokens=8, prompt_tokens=3,
                           prompt="hi")


async def collect(engine: OpenAIEngine, request_id: str = "r1") -> list[TokenDelta]:
    return [d async for d in engine.generate(make_req(request_id))]


async def eventually(check: Callable[[], bool], within_s: float = 3.0) -> bool:
    for _ in range(int(within_s / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


# ---- connections ------------------------------------------------------------------------
async def test_streams_beyond_httpx_default_pool_all_run_and_metrics_still_scrape(
    server: tuple[str, FakeServer]
) -> None:
    url, fake = server
    n = 120  # httpx's default pool holds 100 connections
    fake.hold = asyncio.Event()
    engine = await started(url, replace(PROFILE, max_num_seqs=n), connect_timeout_s=0.5,
                           metrics_interval_s=3600)
    try:
        runs = [asyncio.create_task(collect(engine, f"r{i}")) for i in range(n)]
        assert await eventually(lambda: fake.streaming == n), fake.streaming
        await engine.refresh_metrics()  # the pool is full of streams
        assert engine.capacity().kv_free_tokens == 12_000
        fake.hold.set()
        done = await asyncio.gather(*runs)
        assert all(deltas[-1].finish_reason == "length" for deltas in done)
    finally:
        await engine.close()


# ---- how a stream ends ----------------------------------------------------------------
@pytest.mark.parametrize(("reason", "want"), [
    ("stop", "stop"), ("length", "length"), ("repetition", "stop"),
])
async def test_finish_reasons(server: tuple[str, FakeServer], reason: str, want: str) -> None:
    url, fake = server
    fake.events = [text(" a"), text("", reason), final_usage(1)]
    engine = await started(url)
    try:
        assert (await collect(engine))[-1].finish_reason == want
    finally:
        await engine.close()


async def test_a_request_the_server_ends_in_error_fails(server: tuple[str, FakeServer]) -> None:
    url, fake = server
    fake.events = [text(" a"), text("", "error"), final_usage(1)]
    engine = await started(url)
    try:
        with pytest.raises(EngineError) as failed:
            await collect(engine)
        assert failed.value.code == "worker_lost"
    finally:
        await engine.close()


TOO_LONG = ("This model's maximum context length is 8192 tokens. However, you requested 9000 "
            "tokens (8992 in the messages, 8 in the completion). Please reduce the length.")


@pytest.mark.parametrize(("message", "code"), [
    (TOO_LONG, "too_large"),
    ("temperature must be non-negative, got -1.0.", "invalid"),
])
async def test_a_400_over_the_model_length_is_too_large(
    server: tuple[str, FakeServer], message: str, code: str
) -> None:
    url, fake = server
    fake.status = 400
    fake.error = {"object": "error", "message": message, "type": "BadRequestError",
                  "code": 400}
    engine = await started(url)
    try:
        with pytest.raises(EngineError) as refused:
            await collect(engine)
        assert refused.value.code == code
    finally:
        await engine.close()


# ---- token counts -----------------------------------------------------------------------
COUNTS = {
    # vLLM with continuous_usage_stats: a chunk's tokens are the growth of the usage.
    "continuous usage, merged chunks": (
        [text(" a b c", usage=3), text("", usage=4), text(" d e", "stop", usage=6),
         final_usage(6)],
        [3, 3, 0],
    ),
    # A server that ignores continuous_usage_stats: one per chunk, the rest on the last.
    "final usage only": (
        [text(" a b c d e"), text(""), text(" f", "stop"), final_usage(7)],
        [1, 1, 5],
    ),
    "no usage at all": ([text(" a"), text(" b", "length")], [1, 1, 0]),
}


@pytest.mark.parametrize(("events", "tokens"), COUNTS.values(), ids=COUNTS.keys())
async def test_delta_tokens_follow_the_servers_count(
    server: tuple[str, FakeServer], events: list[dict[str, Any]], tokens: list[int]
) -> None:
    url, fake = server
    fake.events = events
    engine = await started(url)
    try:
        deltas = await collect(engine)
    finally:
        await engine.close()
    assert [d.tokens for d in deltas] == tokens
    assert fake.bodies[0]["stream_options"] == {"include_usage": True,
                                                "continuous_usage_stats": True}


@pytest.mark.parametrize("usage", [True, False], ids=["with usage", "without usage"])
async def test_a_character_split_between_two_events_is_joined(
    server: tuple[str, FakeServer], usage: bool
) -> None:
    """A server slicing text by UTF-16 unit sends an emoji's halves in two events: the
    first half is held for the second, and the tokens still add up."""
    url, fake = server
    fake.events = [text("hi ", usage=1 if usage else None),
                   text("\ud83d", usage=2 if usage else None),
                   text("\ude00", "stop", usage=3 if usage else None)]
    engine = await started(url)
    try:
        deltas = await collect(engine)
    finally:
        await engine.close()
    assert "".join(d.text for d in deltas).encode("utf-16-le", "surrogatepass").decode(
        "utf-16-le") == "hi \U0001F600"
    assert [d.text for d in deltas if d.text] == ["hi ", "\ud83d\ude00"]
    assert sum(d.tokens for d in deltas) == 3


async def test_a_half_character_at_the_end_is_kept_for_the_run(
    server: tuple[str, FakeServer]
) -> None:
    url, fake = server
    fake.events = [text("a", usage=1), text("\ud83d", "stop", usage=2)]
    engine = await started(url)
    try:
        deltas = await collect(engine)
    finally:
        await engine.close()
    assert deltas[-1].finish_reason == "stop" and deltas[-1].text == "\ud83d"
    assert sum(d.tokens for d in deltas) == 2


# ---- capacity -----------------------------------------------------------------------------
NON_FINITE = {
    "NaN kv usage": "vllm:kv_cache_usage_perc NaN\n",
    "infinite running": "vllm:kv_cache_usage_perc 0.2\nvllm:num_requests_running +Inf\n",
    "overflowing waiting": "vllm:kv_cache_usage_perc 0.2\nvllm:num_requests_waiting 1e400\n",
}


@pytest.mark.parametrize("metrics", NON_FINITE.values(), ids=NON_FINITE.keys())
async def test_non_finite_metrics_are_unknown_load(
    server: tuple[str, FakeServer], metrics: str
) -> None:
    url, fake = server
    engine = await started(url, metrics_interval_s=3600)
    try:
        assert engine.capacity().kv_free_tokens == 12_000
        fake.metrics = metrics
        await engine.refresh_metrics()
        assert engine.capacity().kv_free_tokens == 0  # unknown: fail closed
    finally:
        await engine.close()


async def test_the_load_view_holds_while_a_scrape_is_on_its_way(
    server: tuple[str, FakeServer]
) -> None:
    # A heartbeat taken while a scrape waits for its answer reports the last view, not an
    # unknown load (no free KV) at every scrape.
    # A server without /metrics (404), accounted locally: all of its KV is free.
    url, fake = server
    fake.metrics_status = 404
    engine = await started(url, metrics_interval_s=3600)
    try:
        free = engine.capacity().kv_free_tokens
        assert free == engine.capacity().kv_total_tokens > 0
        fake.metrics_hold = asyncio.Event()
        scrape = asyncio.create_task(engine.refresh_metrics())
        await asyncio.sleep(0.05)
        assert not scrape.done()
        assert engine.capacity().kv_free_tokens == free  # was 0 (unknown) meanwhile
        fake.metrics_hold.set()
        await scrape
        assert engine.capacity().kv_free_tokens == free
    finally:
        if fake.metrics_hold is not None:
            fake.metrics_hold.set()  # or closing would wait for the held scrape
        await engine.close()


async def test_the_poll_outlives_a_failing_scrape(
    server: tuple[str, FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = server
    engine = await started(url, metrics_interval_s=0.01)

    def free() -> int:
        return engine.capacity().kv_free_tokens

    def broken(_: str) -> openai.ServerLoad:
        raise RuntimeError("a failure refresh_metrics does not expect")

    try:
        assert free() == 12_000

        monkeypatch.setattr(openai, "parse_vllm_metrics", broken)
        assert await eventually(lambda: free() == 0)  # unknown: fail closed
        monkeypatch.undo()
        assert await eventually(lambda: free() == 12_000)  # and it still follows the server
    finally:
        await engine.close()


@pytest.mark.parametrize("flat", [False, True])
async def test_a_server_refusing_continuous_usage_stats_is_asked_again_without_it(
    server: tuple[str, FakeServer], flat: bool,
) -> None:
    # A strict OpenAI-compatible server refused every request once the field was sent.
    url, fake = server
    fake.strict, fake.flat_errors = True, flat
    engine = await started(url)
    try:
        first, second = await collect(engine, "r1"), await collect(engine, "r2")
    finally:
        await engine.close()
    assert [d.text for d in first] == [d.text for d in second] == [" a", ""]
    assert sum(d.tokens for d in first) == 1  # the final usage still counts
    assert [b["stream_options"] for b in fake.bodies] == [
        {"include_usage": True, "continuous_usage_stats": True},
        {"include_usage": True}, {"include_usage": True}]


async def test_requests_in_flight_at_the_first_refusal_are_asked_again_too(
    server: tuple[str, FakeServer],
) -> None:
    # The retry followed the engine-wide flag: the first refusal cleared it, and requests
    # already sent with the field whose refusal came later failed as invalid.
    url, fake = server
    fake.strict = True
    engine = await started(url)
    assert engine._client is not None
    real_send, sends = engine._client.send, [0]

    async def slow_refusals(request: Any, **kwargs: Any) -> Any:
        n, sends[0] = sends[0], sends[0] + 1
        response = await real_send(request, **kwargs)
        if 0 < n < 4:  # the first wave's later refusals come after the first one
            await asyncio.sleep(0.2)
        return response

    engine._client.send = slow_refusals  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(collect(engine, f"r{i}") for i in range(4)))
    finally:
        await engine.close()
    assert all([d.text for d in r] == [" a", ""] for r in results)


# ---- prefill and decode apart (vLLM's P/D protocol) -------------------------------------
def stage(phase: Phase, kv_transfer: dict[str, Any] | None = None,
          request_id: str = "r1") -> GenerateRequest:
    return replace(make_req(request_id), phase=phase, kv_transfer=kv_transfer,
                   max_tokens=1 if phase == "prefill" else 8, stop=("\n",))


async def test_a_prefill_posts_the_pd_request_and_hands_on_the_servers_params(
    server: tuple[str, FakeServer],
) -> None:
    url, fake = server
    engine = await started(url)
    try:
        [last] = [d async for d in engine.generate(stage("prefill"))]
    finally:
        await engine.close()
    [body] = fake.bodies
    assert (body["max_tokens"], body["stream"], body["ignore_eos"]) == (1, False, True)
    assert "stream_options" not in body and "stop" not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    # The server's parameters in the engine's envelope, with the header the prefill was
    # sent with: the decode worker sends the same one (vLLM's proxy's pairing).
    [x_request_id] = fake.request_ids
    assert x_request_id and len(x_request_id) >= 32
    assert last.kv_transfer == {"engine": "openai", "kv_transfer_params": NIXL_PARAMS,
                                "x_request_id": x_request_id}
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 3, 1)


async def test_every_prefill_has_its_own_request_id(server: tuple[str, FakeServer]) -> None:
    url, fake = server
    engine = await started(url)
    try:
        for rid in ("r1", "r2"):
            [_ async for _ in engine.generate(stage("prefill", request_id=rid))]
    finally:
        await engine.close()
    assert len(set(fake.request_ids)) == 2 and None not in fake.request_ids


@pytest.mark.parametrize(("finish", "cap_named"), [("length", False), ("stop", True)])
async def test_a_prefill_answered_without_params_says_the_server_has_no_connector(
    server: tuple[str, FakeServer], finish: str, cap_named: bool,
) -> None:
    url, fake = server
    fake.answer = prefill_answer(params=None, finish=finish)
    engine = await started(url)
    try:
        with pytest.raises(EngineError) as failed:
            async for _ in engine.generate(stage("prefill")):
                pass
    finally:
        await engine.close()
    assert failed.value.code == "worker_lost"
    assert "no KV connector configured" in failed.value.message
    assert "--kv-transfer-config" in failed.value.message
    assert ("not at its 1-token cap" in failed.value.message) == cap_named


async def test_a_server_without_a_kv_connector_kills_the_engine(
    server: tuple[str, FakeServer], caplog: pytest.LogCaptureFixture,
) -> None:
    # Every prefill placed here would fail the client's request while the worker kept
    # heartbeating healthy: dead, the worker exits and the scheduler requeues its work.
    url, fake = server
    fake.answer = prefill_answer(params=None)
    fake.hold = asyncio.Event()
    engine = await started(url, metrics_interval_s=3600)

    async def prefill(rid: str) -> list[TokenDelta]:
        return [d async for d in engine.generate(stage("prefill", request_id=rid))]

    try:
        assert engine.capacity().alive
        prefills = [asyncio.create_task(prefill(rid)) for rid in ("r1", "r2")]
        assert await eventually(lambda: len(fake.bodies) == 2)  # both in flight
        fake.hold.set()
        failed = await asyncio.gather(*prefills, return_exceptions=True)
        assert all(isinstance(f, EngineError) and f.code == "worker_lost" for f in failed)
        capacity = engine.capacity()
        assert (capacity.alive, capacity.kv_free_tokens, capacity.kv_free_bytes) == \
            (False, 0, 0)
        with pytest.raises(EngineError) as refused:  # nothing more goes to the server
            await collect(engine, "r3")
        assert refused.value.code == "worker_lost"
        assert len(fake.bodies) == 2
    finally:
        await engine.close()
    [logged] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "no KV connector" in logged.getMessage()
    assert "--kv-transfer-config" in logged.getMessage()
    assert "this worker stops" in logged.getMessage()


@pytest.mark.parametrize(("params", "warned"), [
    (NIXL_PARAMS, False),
    ({k: v for k, v in NIXL_PARAMS.items() if k != "remote_request_id"}, True),
    ({**NIXL_PARAMS, "remote_request_id": None}, True),
    ({"some_connector": 1}, False),  # no NixlConnector: nothing to say
])
async def test_a_vllm_pairing_by_the_header_only_is_logged_once(
    server: tuple[str, FakeServer], caplog: pytest.LogCaptureFixture,
    params: dict[str, Any], warned: bool,
) -> None:
    url, fake = server
    fake.answer = prefill_answer(params=params)
    engine = await started(url)
    try:
        for rid in ("r1", "r2"):
            [_ async for _ in engine.generate(stage("prefill", request_id=rid))]
    finally:
        await engine.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                and "remote_request_id" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)


#: What an openai prefill worker reports (its final delta's kv_transfer).
ENVELOPE = Handoff(NIXL_PARAMS, "4f1c2a9e-0b7d-4e55-9a51-2f0e8c3d6b17").envelope()


async def test_a_decode_streams_with_the_prefills_params_and_request_id(
    server: tuple[str, FakeServer],
) -> None:
    url, fake = server
    engine = await started(url)
    try:
        deltas = [d async for d in engine.generate(stage("decode", ENVELOPE))]
    finally:
        await engine.close()
    [body] = fake.bodies
    assert body["kv_transfer_params"] == NIXL_PARAMS  # unwrapped: the server's own
    assert fake.request_ids == [ENVELOPE["x_request_id"]]  # the prefill's header
    assert (body["stream"], body["max_tokens"], body["stop"]) == (True, 8, ["\n"])
    assert [d.text for d in deltas] == [" a", ""] and deltas[-1].finish_reason == "length"


BAD_HANDOFFS: dict[str, tuple[dict[str, Any] | None, str]] = {
    "none": (None, "needs kv_transfer"),
    "the server's params, unwrapped": (dict(NIXL_PARAMS), "kv_transfer.engine"),
    "a sim prefill's": ({"engine": "sim", "prompt_tokens": 3}, "kv_transfer.engine"),
    "no params": ({**ENVELOPE, "kv_transfer_params": None}, "kv_transfer_params"),
    "empty params": ({**ENVELOPE, "kv_transfer_params": {}}, "kv_transfer_params"),
    "no request id": ({k: v for k, v in ENVELOPE.items() if k != "x_request_id"},
                      "x_request_id"),
    "a request id no header takes": ({**ENVELOPE, "x_request_id": "a\nb"}, "x_request_id"),
}


@pytest.mark.parametrize(("kv_transfer", "names"), BAD_HANDOFFS.values(),
                         ids=BAD_HANDOFFS.keys())
async def test_a_decode_without_this_engines_handoff_is_the_fleets_fault(
    server: tuple[str, FakeServer], kv_transfer: dict[str, Any] | None, names: str,
) -> None:
    # The client did nothing wrong, and its retry works on a fleet whose stages match:
    # worker_lost (503, retryable), not invalid (400).
    url, fake = server
    engine = await started(url)
    try:
        with pytest.raises(EngineError) as refused:
            async for _ in engine.generate(stage("decode", kv_transfer)):
                pass
        assert engine._in_flight == {}
    finally:
        await engine.close()
    assert refused.value.code == "worker_lost" and names in refused.value.message
    assert fake.bodies == []  # nothing was asked of the server


@pytest.mark.parametrize(("phase", "status", "message", "code"), [
    # A decode's body passed the prefill server already: what is refused is the hand-off.
    ("decode", 400, "kv_transfer_params: remote_block_ids is invalid", "worker_lost"),
    ("decode", 422, "kv_transfer_params: field required", "worker_lost"),
    ("decode", 400, TOO_LONG, "too_large"),
    ("whole", 400, "temperature must be non-negative, got -1.0.", "invalid"),
    ("whole", 422, "field required", "invalid"),
    ("prefill", 400, "temperature must be non-negative, got -1.0.", "invalid"),
])
async def test_a_400_to_a_decode_is_the_fleets_fault(
    server: tuple[str, FakeServer], phase: Phase, status: int, message: str, code: str,
) -> None:
    url, fake = server
    fake.status = status
    fake.error = {"object": "error", "message": message, "type": "BadRequestError",
                  "code": status}
    engine = await started(url)
    try:
        with pytest.raises(EngineError) as refused:
            async for _ in engine.generate(stage(phase, ENVELOPE if phase == "decode"
                                                 else None)):
                pass
    finally:
        await engine.close()
    assert refused.value.code == code


async def test_aborting_a_prefill_cancels_its_request(server: tuple[str, FakeServer]) -> None:
    # The answer's headers come only once the prompt is computed: closing a response
    # (as a stream is aborted) could not reach it.
    url, fake = server
    fake.hold = asyncio.Event()
    engine = await started(url)
    try:
        prefill = asyncio.create_task(anext(engine.generate(stage("prefill"))))
        assert await eventually(lambda: len(fake.bodies) == 1)
        await engine.abort("r1")
        with pytest.raises(EngineAborted):
            await asyncio.wait_for(prefill, 5.0)
        assert engine._prefills == {} and engine._in_flight == {}
    finally:
        await engine.close()


async def test_aborting_a_stream_before_its_headers_came_ends_it_when_they_do(
    server: tuple[str, FakeServer],
) -> None:
    # Its response was not open yet: the abort was lost and the stream ran on.
    url, fake = server
    fake.headers_hold = asyncio.Event()
    engine = await started(url)
    try:
        gen = engine.generate(stage("whole"))
        first = asyncio.create_task(anext(gen))
        assert await eventually(lambda: len(fake.bodies) == 1)
        await engine.abort("r1")
        fake.headers_hold.set()
        with pytest.raises(EngineAborted):
            await asyncio.wait_for(first, 5.0)
        assert engine._responses == {} and engine._in_flight == {} and engine._aborted == set()
        await engine.abort("r1")  # no longer in flight: nothing is remembered for it
        assert engine._aborted == set()
    finally:
        await engine.close()


PREFILL_ANSWERS = {
    "completions": (prefill_answer(), " the"),
    "chat": ({"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                           "finish_reason": "length"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 1},
              "kv_transfer_params": {"remote_request_id": "chatcmpl-1"}}, "Hi"),
}


@pytest.mark.parametrize(("answer", "text"), PREFILL_ANSWERS.values(),
                         ids=PREFILL_ANSWERS.keys())
def test_a_prefill_answer_becomes_one_final_delta(answer: dict[str, Any], text: str) -> None:
    delta = openai.prefill_delta(answer, "xid-1")
    assert (delta.text, delta.tokens, delta.finish_reason) == (text, 1, "length")
    assert delta.kv_transfer == {"engine": "openai",
                                 "kv_transfer_params": answer["kv_transfer_params"],
                                 "x_request_id": "xid-1"}
    # What the decode worker unwraps is what the prefill server said.
    assert Handoff.of(delta.kv_transfer) == Handoff(answer["kv_transfer_params"], "xid-1")


def test_a_prefill_the_server_ended_in_error_fails() -> None:
    with pytest.raises(EngineError) as failed:
        openai.prefill_delta(prefill_answer(finish="error"), "xid-1")
    assert failed.value.code == "worker_lost" and "error" in failed.value.message
