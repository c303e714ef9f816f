"""The ``openai`` engine against a FAKE OpenAI-compatible server written here.

The fake (Starlette on uvicorn, 127.0.0.1, a free port) stands in for an external vLLM
server: ``/v1/completions`` and ``/v1/chat/completions`` stream one SSE event per token,
then a finish event, a usage event and ``[DONE]``; ``/metrics`` serves vLLM-named gauges
the test sets. It records the request bodies and whether a client went away mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from services.worker.engines.base import (
    ChatTurn,
    EngineAborted,
    EngineError,
    GenerateRequest,
    TokenDelta,
)
from services.worker.engines.openai import OpenAIEngine, parse_vllm_metrics, request_body
from services.worker.engines.sim.profiles import get_profile
from tests.fakes.http_server import serving

pytestmark = pytest.mark.timeout(30)

PROFILE = get_profile("llama3-8b-h100")


@dataclass
class FakeServerState:
    """What the FAKE server serves and what it saw."""

    metrics: str = ""
    metrics_status: int = 200
    bodies: list[dict[str, Any]] = field(default_factory=list)
    token_delay_s: float = 0.0
    disconnected: list[str] = field(default_factory=list)
    fail_with: int | None = None


def fake_app(state: FakeServerState) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await request.json()
        state.bodies.append(body)
        if state.fail_with is not None:
            return JSONResponse({"error": "nope"}, status_code=state.fail_with)
        chat = request.url.path.endswith("/chat/completions")
        n = int(body["max_tokens"])

        async def events() -> AsyncIterator[bytes]:
            try:
                for i in range(n):
                    piece = f" tok{i}"
                    choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None}
                              if chat else {"index": 0, "text": piece, "finish_reason": None})
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
                    await asyncio.sleep(state.token_delay_s)
                end = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                       else {"index": 0, "text": "", "finish_reason": "length"})
                yield f"data: {json.dumps({'choices': [end]})}\n\n".encode()
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                state.disconnected.append(str(body.get("prompt") or body.get("messages")))
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(state.metrics, status_code=state.metrics_status)

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/metrics", metrics),
    ])


VLLM_METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0
"""


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, FakeServerState]]:
    state = FakeServerState(metrics=VLLM_METRICS)
    async with serving(fake_app(state)) as url:
        yield url, state


@pytest.fixture
async def engine(server: tuple[str, FakeServerState]) -> AsyncIterator[OpenAIEngine]:
    eng = OpenAIEngine(server[0], "served-model", profile=PROFILE, metrics_interval_s=0.05)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


def make_req(request_id: str = "r1", max_tokens: int = 5, **changes: Any) -> GenerateRequest:
    return replace(GenerateRequest(request_id=request_id, model="m", max_tokens=max_tokens,
                                   prompt_tokens=3, prompt="hi"), **changes)


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [d async for d in stream]


async def test_completion_streams_deltas_and_usage(
    engine: OpenAIEngine, server: tuple[str, FakeServerState]
) -> None:
    deltas = await collect(engine.generate(make_req(max_tokens=5, stop=("\n",), seed=3)))
    assert "".join(d.text for d in deltas) == " tok0 tok1 tok2 tok3 tok4"
    assert sum(d.tokens for d in deltas) == 5
    last = deltas[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 7, 5)
    body = server[1].bodies[0]
    assert body["model"] == "served-model" and body["stream"] is True
    assert body["stop"] == ["\n"] and body["seed"] == 3 and body["prompt"] == "hi"
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


async def test_chat_uses_chat_completions(
    engine: OpenAIEngine, server: tuple[str, FakeServerState]
) -> None:
    req = make_req(max_tokens=3, prompt=None, messages=(ChatTurn("user", "hello"),))
    deltas = await collect(engine.generate(req))
    assert "".join(d.text for d in deltas) == " tok0 tok1 tok2"
    assert server[1].bodies[0]["messages"] == [{"role": "user", "content": "hello"}]


async def test_abort_closes_the_stream(
    engine: OpenAIEngine, server: tuple[str, FakeServerState]
) -> None:
    server[1].token_delay_s = 0.01
    stream = engine.generate(make_req(max_tokens=10_000))
    got = 0
    with pytest.raises(EngineAborted):
        async for delta in stream:
            got += delta.tokens
            if got == 3:
                await engine.abort("r1")
    assert got == 3
    for _ in range(100):  # the server notices the client went away
        if server[1].disconnected:
            break
        await asyncio.sleep(0.02)
    assert server[1].disconnected == ["hi"]


@pytest.mark.parametrize("status, code", [(400, "invalid"), (404, "unknown_model"),
                                          (503, "overloaded"), (500, "worker_lost")])
async def test_http_errors_become_terminal_codes(
    engine: OpenAIEngine, server: tuple[str, FakeServerState], status: int, code: str
) -> None:
    server[1].fail_with = status
    with pytest.raises(EngineError) as info:
        await collect(engine.generate(make_req()))
    assert info.value.code == code


async def test_capacity_from_metrics(
    engine: OpenAIEngine, server: tuple[str, FakeServerState]
) -> None:
    cap = engine.capacity()
    assert (cap.kv_total_tokens, cap.kv_free_tokens, cap.block_size) == (16_000, 12_000, 16)
    assert (cap.running, cap.waiting) == (3, 2)
    assert cap.kv_free_bytes == 12_000 * PROFILE.kv_bytes_per_token
    # The background poll follows the server.
    server[1].metrics = VLLM_METRICS.replace("0.25", "0.5")
    for _ in range(100):
        if engine.capacity().kv_free_tokens == 8_000:
            break
        await asyncio.sleep(0.02)
    assert engine.capacity().kv_free_tokens == 8_000


async def test_unreadable_metrics_fail_closed(
    engine: OpenAIEngine, server: tuple[str, FakeServerState]
) -> None:
    server[1].metrics_status = 500
    await engine.refresh_metrics()
    assert engine.capacity().kv_free_tokens == 0


async def test_server_without_metrics_is_accounted_locally(
    engine: OpenAIEngine, server: tuple[str, FakeServerState]
) -> None:
    server[1].metrics_status = 404
    await engine.refresh_metrics()
    server[1].token_delay_s = 0.01
    stream = engine.generate(make_req(max_tokens=100))
    await anext(stream)
    cap = engine.capacity()
    assert cap.kv_total_tokens == PROFILE.kv_total_tokens  # no cache_config_info: profile
    assert cap.kv_free_tokens == PROFILE.kv_total_tokens - 103 and cap.running == 1
    await stream.aclose()  # type: ignore[attr-defined]  # an async generator


async def test_a_server_that_lost_its_metrics_and_then_fails_is_unknown_again(
    engine: OpenAIEngine, server: tuple[str, FakeServerState]
) -> None:
    server[1].metrics_status = 404  # a server without /metrics: accounted locally
    await engine.refresh_metrics()
    assert engine.capacity().kv_free_tokens == PROFILE.kv_total_tokens
    server[1].metrics_status = 503  # now failing: the local account no longer holds
    await engine.refresh_metrics()
    assert engine.capacity().kv_free_tokens == 0


async def test_without_metrics_requests_beyond_max_num_seqs_are_waiting(
    server: tuple[str, FakeServerState]
) -> None:
    profile = replace(PROFILE, max_num_seqs=2)
    eng = OpenAIEngine(server[0], "served-model", profile=profile, metrics_interval_s=3600)
    await eng.start()
    server[1].metrics_status = 404
    await eng.refresh_metrics()
    server[1].token_delay_s = 0.01
    streams = [eng.generate(make_req(request_id=f"r{i}", max_tokens=100)) for i in range(5)]
    try:
        for stream in streams:
            await anext(stream)
        cap = eng.capacity()
        assert (cap.running, cap.waiting) == (2, 3)
    finally:
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]  # an async generator
        await eng.close()


async def test_unreachable_server_is_worker_lost() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    eng = OpenAIEngine(f"http://127.0.0.1:{port}", "m", profile=PROFILE)
    await eng.start()
    try:
        assert eng.capacity().kv_free_tokens == 0  # unknown: fail closed
        with pytest.raises(EngineError) as info:
            await collect(eng.generate(make_req()))
        assert info.value.code == "worker_lost"
    finally:
        await eng.close()


METRIC_CASES = {
    "vllm v1 names": (VLLM_METRICS, (0.25, 3, 2, 1000, 16)),
    "older gpu_cache name, two engines": (
        'vllm:gpu_cache_usage_perc{engine="0"} 0.2\nvllm:gpu_cache_usage_perc{engine="1"} 0.4\n'
        'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n',
        (0.3, 3, 0, None, None),
    ),
    "no vllm metrics": ("process_cpu_seconds_total 1.0\n", (None, 0, 0, None, None)),
}


@pytest.mark.parametrize("text, want", METRIC_CASES.values(), ids=METRIC_CASES.keys())
def test_parse_vllm_metrics(text: str, want: tuple[object, ...]) -> None:
    load = parse_vllm_metrics(text)
    usage = None if load.kv_usage is None else pytest.approx(load.kv_usage)
    assert (usage, load.running, load.waiting, load.num_gpu_blocks, load.block_size) == want


def test_request_body_passes_sampling_through() -> None:
    path, body = request_body(make_req(top_k=5, temperature=0.0), "srv")
    assert path == "/v1/completions"
    assert (body["top_k"], body["temperature"], body["max_tokens"]) == (5, 0.0, 5)
    assert "stop" not in body and "seed" not in body
