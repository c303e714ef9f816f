"""A request its client abandons, or whose send fails midway, is cancelled (one
``CancelRequest`` on the control topic) — a streaming client that goes away while a write
is in progress too, and the app returns cleanly.

Over a real socket (tests/integration/test_ingest_api.py) the client usually leaves while
the body's generator waits for a reply, and the generator's cleanup cancels. Here the ASGI
app is driven by hand so the client leaves *during* a ``send``: then the generator never
resumes and only the response's background task can cancel. The gateway is the real one;
its Kafka producer is a stand-in (it records what is sent and answers the submit with a
first chunk, as the worker would) and its reply router is never started.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError

from schemas.codec import decode
from schemas.control import CancelRequest
from schemas.replies import TokenChunk
from schemas.requests import InferenceRequest
from services.common.replies import ReplyRouter
from services.ingest.cluster import ClusterTracker, Freshness
from services.ingest.http import HttpDeps, create_api
from services.ingest.http.errors import ApiError
from services.ingest.http.gateway import Gateway
from services.ingest.http.openai import ApiDefaults
from services.ingest.tenants import load_tenancy
from services.ingest.topics import IngestTopics
from tests.builders_schemas import make_heartbeat, make_prompt_request

TOPICS = IngestTopics.of("llmq", "llmq-ingest", "a")


class _Producer:
    """Stand-in for the gateway's aiokafka producer."""

    def __init__(self, gateway: Gateway, router: ReplyRouter) -> None:
        self.gateway, self.router = gateway, router
        self.cancels: list[CancelRequest] = []

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None,
                            headers: Any = None) -> None:
        if topic == TOPICS.intake:
            req = decode(value, InferenceRequest)
            first = TokenChunk(request_id=req.request_id, attempt=1, seq=0, text="hello",
                               tokens=1, ts=1.0)
            asyncio.get_running_loop().call_soon(self.router.route, first)
        elif topic == TOPICS.control:
            self.cancels.append(decode(value, CancelRequest))

    async def stop(self) -> None: ...


@pytest.mark.parametrize("during", ["http.response.start", "http.response.body"])
async def test_a_client_leaving_during_a_write_cancels_its_request(during: str) -> None:
    tenancy = load_tenancy(None)
    tracker = ClusterTracker(tenancy.config.admission.registry, Freshness())
    tracker.observe_heartbeat(make_heartbeat(worker_id="w", model="m"))
    gateway = Gateway("127.0.0.1:9", TOPICS, instance_id="a")  # never connects
    router = gateway._router = ReplyRouter("127.0.0.1:9", TOPICS.reply)
    producer = gateway._producer = _Producer(gateway, router)
    watcher = SimpleNamespace(tracker=tracker, running=True, caught_up=asyncio.Event())
    api = create_api(HttpDeps(gateway=gateway, tenancy=tenancy, watcher=watcher,  # type: ignore[arg-type]
                              defaults=ApiDefaults(), reply_grace_s=1.0))
    body = json.dumps({"model": "m", "prompt": "x", "stream": True, "timeout": 30}).encode()
    gone = asyncio.Event()
    sent: list[str] = []
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["type"])
        if message["type"] == during:
            gone.set()  # the client leaves while this write is in progress
            await asyncio.sleep(0.2)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8080),
    }
    await asyncio.wait_for(api(scope, receive, send), 10)  # returns: nothing escapes
    for _ in range(100):
        if producer.cancels:
            break
        await asyncio.sleep(0.01)
    assert [(c.reason, c.issued_by) for c in producer.cancels] == [
        ("client disconnected", "ingest")]
    assert router.open_requests == 0  # its reply stream is closed


class _FailingProducer:
    """Stand-in whose intake send fails (``error``) or never finishes (None)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error
        self.cancels: list[CancelRequest] = []

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None,
                            headers: Any = None) -> None:
        if topic == TOPICS.control:
            self.cancels.append(decode(value, CancelRequest))
            return
        if self.error is not None:
            raise self.error
        await asyncio.Event().wait()  # hangs until cancelled


def _gateway(producer: _FailingProducer) -> Gateway:
    gateway = Gateway("127.0.0.1:9", TOPICS, instance_id="a")
    gateway._router = ReplyRouter("127.0.0.1:9", TOPICS.reply)
    gateway._producer = producer
    return gateway


async def _cancels(producer: _FailingProducer) -> list[str]:
    for _ in range(100):
        if producer.cancels:
            break
        await asyncio.sleep(0.01)
    return [c.request_id for c in producer.cancels]


async def test_a_send_that_fails_midway_is_cancelled_in_case_it_landed() -> None:
    # A timed-out send may still land: the client is told to retry, so the first copy
    # must not run (for nobody, or twice with the retry).
    producer = _FailingProducer(KafkaTimeoutError())
    gateway = _gateway(producer)
    with pytest.raises(ApiError) as refused:
        await gateway.submit(make_prompt_request(request_id="r1"))
    assert refused.value.status == 503
    assert await _cancels(producer) == ["r1"]
    assert gateway._router is not None and gateway._router.open_requests == 0


async def test_a_client_leaving_while_its_request_is_sent_cancels_it() -> None:
    producer = _FailingProducer(None)
    gateway = _gateway(producer)
    sending = asyncio.create_task(gateway.submit(make_prompt_request(request_id="r2")))
    await asyncio.sleep(0.05)
    sending.cancel()  # the HTTP client went away
    with pytest.raises(asyncio.CancelledError):
        await sending
    assert await _cancels(producer) == ["r2"]


async def test_a_failed_send_of_a_client_chosen_id_is_not_cancelled() -> None:
    # The client (x-request-id) retries with the same id: a cancel would hit the retry.
    producer = _FailingProducer(KafkaTimeoutError())
    gateway = _gateway(producer)
    with pytest.raises(ApiError):
        await gateway.submit(make_prompt_request(request_id="mine"), client_id=True)
    await asyncio.sleep(0.05)
    assert producer.cancels == []
    assert gateway._router is not None and gateway._router.open_requests == 0


async def test_a_client_chosen_id_whose_send_the_client_left_is_refused_for_a_while() -> None:
    """Found by an audit: cancelled as the client left (the copy likely landed), the id was
    not marked ended, so a retry with it was accepted and got the first copy's
    `cancelled` (replies go by id). It is refused 409 for a while, as after any call."""
    producer = _FailingProducer(None)
    gateway = _gateway(producer)
    sending = asyncio.create_task(gateway.submit(
        make_prompt_request(request_id="acme:job-1", tenant="acme"), client_id=True))
    await asyncio.sleep(0.05)
    sending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sending
    assert await _cancels(producer) == ["acme:job-1"]
    with pytest.raises(ApiError) as refused:
        await gateway.submit(make_prompt_request(request_id="acme:job-1", tenant="acme"),
                             client_id=True)
    assert refused.value.status == 409
