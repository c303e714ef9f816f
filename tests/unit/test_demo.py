"""``llmq demo`` without a stack: its HTTP requests ask for usage and count the completion
tokens it reports, and a request that fails on the Kafka side is that request's failed
outcome, not the end of the run.

The HTTP side is ingest's SSE played by an ``httpx.MockTransport``; the Kafka side a
stand-in for :class:`~llmq.client.LlmqClient` whose every request fails.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from aiokafka.errors import KafkaTimeoutError

from services import demo
from services.common.replies import StreamClosed
from services.ingest.http.openai import Origin, sse, to_inference_request
from services.sim.workload import TraceRequest


def ingest(request: httpx.Request) -> httpx.Response:
    """A finished 3-token stream as ingest sends it; usage only when the body asks."""
    if request.url.path == "/healthz":
        return httpx.Response(200, json={"status": "ok"})
    call = to_inference_request(json.loads(request.content), "completion",
                                Origin("r1", "default", "llmq.replies.default", 0.0), {})
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in "abc"]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    if call.include_usage:
        chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                                "total_tokens": 8}})
    body = b"".join(sse(c) for c in chunks) + b"data: [DONE]\n\n"
    return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


def _serving(handler: Callable[[httpx.Request], httpx.Response]) -> type[httpx.AsyncClient]:
    """``httpx.AsyncClient`` whose every request ``handler`` answers."""
    class Client(_REAL_CLIENT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(transport=httpx.MockTransport(handler), **kwargs)

    return Client


_REAL_CLIENT = httpx.AsyncClient
_Ingest = _serving(ingest)


class _Clock:
    """``demo``'s monotonic clock: stands still but for what a failing request takes."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Handle:
    """A submitted request whose reply stream is closed under it, 0.05 s on."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def __aiter__(self) -> AsyncIterator[object]:
        return self

    async def __anext__(self) -> object:
        self.clock.now += 0.05
        raise StreamClosed("client stopped")


class _FailingClient:
    """Stand-in for LlmqClient: every request fails with ``failure``, 0.05 s after it
    was sent by ``clock``."""

    def __init__(self, failure: Exception, clock: _Clock) -> None:
        self.failure, self.clock = failure, clock

    async def __aenter__(self) -> _FailingClient:
        return self

    async def __aexit__(self, *exc: object) -> None: ...

    async def submit(self, **kwargs: Any) -> _Handle:
        if isinstance(self.failure, StreamClosed):
            return _Handle(self.clock)
        self.clock.now += 0.05
        raise self.failure


@pytest.fixture(autouse=True)
def fake_ingest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo.httpx, "AsyncClient", _Ingest)


async def test_http_requests_ask_for_usage_and_count_its_tokens() -> None:
    req = TraceRequest(0, 0.0, 5, 3, "default", "normal")
    out = await demo._via_http("http://ingest", req, "hello", "llama-3.1-8b", 10.0)
    assert out.ok and out.completion_tokens == 3
    assert demo.summarize([out], 1.0)["completion_tokens"] == 3


@pytest.mark.parametrize("failure", [KafkaTimeoutError("send timed out"),
                                     StreamClosed("client stopped")])
async def test_a_kafka_failure_is_that_requests_outcome_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch, failure: Exception,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(demo, "time", clock)
    monkeypatch.setattr(demo, "LlmqClient", lambda *a, **kw: _FailingClient(failure, clock))
    outcomes: list[demo.Outcome] = []
    summarize = demo.summarize

    def keep(found: list[demo.Outcome], elapsed_s: float) -> dict[str, Any]:
        outcomes.extend(found)
        return summarize(found, elapsed_s)

    monkeypatch.setattr(demo, "summarize", keep)
    # Even requests go over HTTP, odd ones over Kafka; the last arrives 0.6 s in.
    reqs = [TraceRequest(i, 0.2 * i, 5, 3, "default", "normal") for i in range(4)]
    summary = await demo.run_demo("127.0.0.1:9", "llmq", "http://ingest", reqs, "m", 1, 5.0)
    assert (summary["requests"], summary["completed"]) == (4, 2)
    assert summary["rejections"] == {type(failure).__name__: 2}
    failed = [o for o in outcomes if not o.ok]
    assert [o.via for o in failed] == ["kafka", "kafka"]
    # From the request's own start, not from the start of the run: the second one was
    # sent once the first had failed (clock 0.05) and failed 0.05 s later, at 0.1.
    assert [o.e2e_s for o in failed] == pytest.approx([0.05, 0.05])


@pytest.mark.parametrize(("status", "body", "code"), [
    (502, b"<html>Bad Gateway</html>", "502"),
    (500, b'{"error": "text"}', "500"),
    (429, b'{"error": {"code": "rate_limited", "message": "slow down"}}', "rate_limited"),
])
async def test_an_odd_error_body_is_that_requests_failure(
    monkeypatch: pytest.MonkeyPatch, status: int, body: bytes, code: str,
) -> None:
    """Found by an audit: a proxy's HTML page ended the whole run (JSONDecodeError), and
    ``{"error": "text"}`` with a traceback (AttributeError)."""
    monkeypatch.setattr(demo.httpx, "AsyncClient",
                        _serving(lambda _: httpx.Response(status, content=body)))
    req = TraceRequest(0, 0.0, 5, 3, "default", "normal")
    out = await demo._via_http("http://ingest", req, "hello", "llama-3.1-8b", 10.0)
    assert (out.ok, out.code) == (False, code)


async def test_an_error_event_in_the_stream_names_its_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = (b'data: {"error": {"code": "worker_lost", "message": "m"}}\n\n'
              b'data: {"error": "odd"}\n\n')

    monkeypatch.setattr(demo.httpx, "AsyncClient",
                        _serving(lambda _: httpx.Response(200, content=events)))
    req = TraceRequest(0, 0.0, 5, 3, "default", "normal")
    out = await demo._via_http("http://ingest", req, "hello", "llama-3.1-8b", 10.0)
    assert (out.ok, out.code) == (False, "worker_lost")
    assert demo._error_code(b'{"error": "odd"}') is None


def test_demo_without_a_stack_fails_at_once_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: with nothing at --url, half the requests waited out their
    timeout over Kafka, the run printed a table of failures and exited 0."""
    from click.testing import CliRunner

    from services.cli import main

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    def no_client(*_: Any, **__: Any) -> None:
        raise AssertionError("the Kafka client must not start")

    monkeypatch.setattr(demo.httpx, "AsyncClient", _serving(refused))
    monkeypatch.setattr(demo, "LlmqClient", no_client)
    monkeypatch.delenv("LLMQ_DEBUG", raising=False)
    result = CliRunner().invoke(main, ["demo", "--requests", "4", "--url", "http://h:1"])
    assert result.exit_code == 1
    assert result.output == ("Error: could not reach http://h:1/healthz (ConnectError: "
                             "connection refused); is `llmq up` running?\n")


def test_demo_exits_1_when_nothing_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from services.cli import main

    def refusing(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/healthz":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(503, json={"error": {"code": "overloaded", "message": "m"}})

    clock = _Clock()
    monkeypatch.setattr(demo.httpx, "AsyncClient", _serving(refusing))
    monkeypatch.setattr(demo, "time", clock)
    monkeypatch.setattr(demo, "LlmqClient", lambda *a, **kw: _FailingClient(
        KafkaTimeoutError("send timed out"), clock))
    result = CliRunner().invoke(main, ["demo", "--requests", "4", "--json"])
    assert result.exit_code == 1, result.output
    summary = json.loads(result.stdout)
    assert summary["completed"] == 0
    assert summary["rejections"] == {"overloaded": 2, "KafkaTimeoutError": 2}
    assert "no request completed" in result.stderr


async def test_an_api_still_starting_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found running `llmq demo` right after `llmq up --detach`: ingest listens only once
    it has recovered its tables, a few seconds later, and the demo failed at once."""
    tries: list[str] = []

    def starting(request: httpx.Request) -> httpx.Response:
        tries.append(str(request.url))
        if len(tries) < 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"status": "ok"})

    monkeypatch.setattr(demo.httpx, "AsyncClient", _serving(starting))
    await demo.await_api("http://h:1", wait_s=5.0)
    assert len(tries) == 3
    tries.clear()
    with pytest.raises(httpx.ConnectError):
        await demo.await_api("http://h:1")  # no stack recorded: at once
    assert len(tries) == 1
