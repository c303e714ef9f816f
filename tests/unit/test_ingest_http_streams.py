"""How a call ends, driven through the ASGI app: streams that end in an error still end
with ``[DONE]``, a streaming client that leaves before its first reply cancels at once, and
a request that llmq restarts (attempt + 1) answers with the newest attempt's text only.

As in test_ingest_http_disconnect.py the gateway is the real one and its Kafka producer a
stand-in; here the stand-in answers each submitted request with a script of replies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from schemas.codec import decode
from schemas.control import CancelRequest
from schemas.replies import TokenChunk
from schemas.requests import InferenceRequest
from services.common.replies import Reply, ReplyRouter
from services.ingest.cluster import ClusterTracker, Freshness
from services.ingest.http import HttpDeps, create_api, routes
from services.ingest.http.gateway import Gateway
from services.ingest.http.openai import ApiDefaults
from services.ingest.tenants import load_tenancy
from services.ingest.topics import IngestTopics
from tests.builders_schemas import make_chunk, make_done, make_error, make_heartbeat

TOPICS = IngestTopics.of("llmq", "llmq-ingest", "a")
#: (delay in seconds, or an event to wait for; reply for a request id)
Script = list[tuple[float | asyncio.Event, Callable[[str], Reply]]]


def chunk(rid: str) -> Reply:
    return TokenChunk(request_id=rid, attempt=1, seq=0, text="hi", tokens=1, ts=1.0)


class _Producer:
    """Stand-in for the gateway's producer: plays ``script`` for each submitted request."""

    def __init__(self, router: ReplyRouter, script: Script) -> None:
        self.router, self.script = router, script
        self.cancels: list[CancelRequest] = []
        self.requests: list[InferenceRequest] = []  # as submitted to intake
        self._gated: set[asyncio.Task[None]] = set()

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None,
                            headers: Any = None) -> None:
        if topic == TOPICS.intake:
            self.requests.append(decode(value, InferenceRequest))
            rid = self.requests[-1].request_id
            for delay, reply in self.script:
                if isinstance(delay, asyncio.Event):
                    task = asyncio.create_task(self._route_after(delay, reply(rid)))
                    self._gated.add(task)
                    task.add_done_callback(self._gated.discard)
                else:
                    asyncio.get_running_loop().call_later(delay, self.router.route, reply(rid))
        elif topic == TOPICS.control:
            self.cancels.append(decode(value, CancelRequest))

    async def _route_after(self, gate: asyncio.Event, reply: Reply) -> None:
        await gate.wait()
        self.router.route(reply)

    async def stop(self) -> None: ...


class Api:
    def __init__(self, script: Script, reply_grace_s: float = 1.0,
                 text_sent: asyncio.Event | None = None) -> None:
        self.text_sent = text_sent  # set once the client was sent some of the body
        tenancy = load_tenancy(None)
        tracker = ClusterTracker(tenancy.config.admission.registry, Freshness())
        tracker.observe_heartbeat(make_heartbeat(worker_id="w", model="m"))
        gateway = Gateway("127.0.0.1:9", TOPICS, instance_id="a")  # never connects
        self.router = gateway._router = ReplyRouter("127.0.0.1:9", TOPICS.reply)
        self.producer = gateway._producer = _Producer(self.router, script)
        watcher = SimpleNamespace(tracker=tracker, running=True, caught_up=asyncio.Event())
        self.app = create_api(HttpDeps(gateway=gateway, tenancy=tenancy, watcher=watcher,  # type: ignore[arg-type]
                                       defaults=ApiDefaults(), reply_grace_s=reply_grace_s))

    async def post(self, body: dict[str, Any], leave_after_s: float | None = None,
                   path: str = "/v1/completions") -> Any:
        """Status and body of one call to ``path``; the client leaves after
        ``leave_after_s`` (None: it stays)."""
        gone = asyncio.Event()
        if leave_after_s is not None:
            asyncio.get_running_loop().call_later(leave_after_s, gone.set)
        return await self.call([json.dumps(body).encode()], [], gone, path=path)

    async def call(self, parts: list[bytes], headers: list[tuple[bytes, bytes]],
                   gone: asyncio.Event | None = None, cut_after: int | None = None,
                   path: str = "/v1/completions") -> Any:
        """One POST to ``path`` whose body arrives in ``parts`` (with ``headers``);
        once they are read (or ``cut_after`` of them: the client leaves mid-upload), the
        client waits for its answer, or leaves when ``gone`` is set. Its status, body,
        headers and how many parts the app read."""
        out = SimpleNamespace(status=None, body=b"", read=0, headers=[])
        left = gone if gone is not None else asyncio.Event()
        sent = len(parts) if cut_after is None else cut_after

        async def receive() -> dict[str, Any]:
            if out.read == sent:
                await left.wait()
                return {"type": "http.disconnect"}
            out.read += 1
            return {"type": "http.request", "body": parts[out.read - 1],
                    "more_body": out.read < len(parts)}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                out.status = message["status"]
                out.headers = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                out.body += message.get("body", b"")
                if self.text_sent is not None and message.get("body"):
                    self.text_sent.set()

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"), *headers],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8080),
        }
        await asyncio.wait_for(self.app(scope, receive, send), 10)
        return out


def events(body: bytes) -> list[Any]:
    """The SSE events' data: parsed JSON, or the literal ``[DONE]``."""
    out = []
    for event in body.split(b"\n\n"):
        if event:
            data = event.removeprefix(b"data: ")
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def test_a_stream_ended_by_an_error_reply_ends_with_done() -> None:
    api = Api([(0.01, chunk), (0.02, lambda rid: make_error(
        request_id=rid, attempt=1, code="worker_lost", retry_after_s=None))])
    out = await api.post({"model": "m", "prompt": "x", "stream": True})
    assert out.status == 200
    sent = events(out.body)
    assert sent[0]["choices"][0]["text"] == "hi"
    assert sent[1]["error"]["code"] == "worker_lost"
    assert sent[2:] == ["[DONE]"]


async def test_a_stream_ended_by_its_deadline_ends_with_done() -> None:
    api = Api([(0.01, chunk)], reply_grace_s=0.0)
    out = await api.post({"model": "m", "prompt": "x", "stream": True, "timeout": 0.3})
    assert out.status == 200
    sent = events(out.body)
    assert sent[1]["error"]["code"] == "timeout"
    assert sent[2:] == ["[DONE]"]
    assert [c.reason for c in api.producer.cancels] == ["no answer within the timeout"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_leaving_while_its_request_is_queued_cancels_it(
    stream: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No reply comes (queued for long): the only way to notice is to poll the client.
    monkeypatch.setattr(routes, "_DISCONNECT_POLL_S", 0.05)
    api = Api([])
    call = api.post({"model": "m", "prompt": "x", "stream": stream, "timeout": 30},
                    leave_after_s=0.1)
    out = await asyncio.wait_for(call, 3)  # long before the request's own deadline
    assert out.status == 499
    assert [(c.reason, c.issued_by) for c in api.producer.cancels] == [
        ("client disconnected", "ingest")]
    assert api.router.open_requests == 0


async def test_an_oversized_body_is_refused_before_it_is_read_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 200 MB body was read whole and parsed (0.9 s of this event loop, 862 MB) before
    # its 413. Now: refused on its Content-Length unread, or once the parts read pass it.
    monkeypatch.setattr(routes, "MAX_BODY_BYTES", 1_000)
    api = Api([])
    declared = await api.call([b"x" * 600] * 5, [(b"content-length", b"3000")])
    assert declared.status == 413 and declared.read == 0
    assert json.loads(declared.body)["error"]["code"] == "too_large"
    streamed = await api.call([b"x" * 600] * 5, [])
    assert streamed.status == 413 and streamed.read == 2  # 1,200 bytes > 1,000: no more
    small = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()
    assert len(small) < 1_000
    answering = Api([(0.01, lambda rid: make_error(
        request_id=rid, attempt=1, code="worker_lost", retry_after_s=None))])
    fine = await answering.call([small[:10], small[10:]], [])
    assert fine.status == 503  # read in two parts, admitted, answered by its one reply


def attempt_chunk(attempt: int, text: str) -> Callable[[str], Reply]:
    return lambda rid: make_chunk(request_id=rid, attempt=attempt, seq=0, text=text)


def attempt_done(attempt: int) -> Callable[[str], Reply]:
    return lambda rid: make_done(request_id=rid, attempt=attempt)


async def test_a_started_stream_that_llmq_restarts_ends_with_worker_lost() -> None:
    # "old" was sent to the client: attempt 2's text cannot replace it, so the stream ends
    # as a lost worker's does, the client retries, and attempt 2 is cancelled.
    # Attempt 2 replies only once "old" went out, not some milliseconds later.
    old_sent = asyncio.Event()
    api = Api([(0.01, attempt_chunk(1, "old")), (old_sent, attempt_chunk(2, "new")),
               (old_sent, attempt_done(2))], text_sent=old_sent)
    out = await api.post({"model": "m", "prompt": "x", "stream": True})
    assert out.status == 200
    sent = events(out.body)
    assert sent[0]["choices"][0]["text"] == "old"
    assert sent[1]["error"]["code"] == "worker_lost"
    assert "restarted (attempt 2) after its first tokens were sent" in (
        sent[1]["error"]["message"])
    assert sent[2:] == ["[DONE]"]
    assert [c.reason for c in api.producer.cancels] == [
        "restarted (attempt 2) after its stream had started"]
    assert api.router.open_requests == 0


async def test_a_stream_restarted_before_it_sent_text_carries_on() -> None:
    # Attempt 1's chunk was still queued, unread, when attempt 2's came: nothing was sent.
    # Both come in one turn of the loop (one gate), not on two timers of the same delay:
    # those could fire a turn apart, and the first chunk was then sent (a CI run failed
    # so once: the stream ended worker_lost, as it must when text was sent).
    both = asyncio.Event()  # and the Done after them, in the same turn, in order
    api = Api([(both, attempt_chunk(1, "old")), (both, attempt_chunk(2, "new")),
               (both, attempt_done(2))])
    asyncio.get_running_loop().call_later(0.01, both.set)
    out = await api.post({"model": "m", "prompt": "x", "stream": True})
    sent = events(out.body)
    assert [e["choices"][0]["text"] for e in sent[:-1]] == ["new", ""]
    assert sent[-2]["choices"][0]["finish_reason"] == "stop"
    assert sent[-1] == "[DONE]" and not api.producer.cancels


async def test_a_gathered_answer_keeps_only_the_newest_attempts_text() -> None:
    api = Api([(0.01, attempt_chunk(1, "old ")), (0.05, attempt_chunk(2, "new")),
               (0.06, attempt_done(2))])
    out = await api.post({"model": "m", "prompt": "x"})
    assert out.status == 200
    assert json.loads(out.body)["choices"][0]["text"] == "new"
    assert not api.producer.cancels


def test_a_client_chosen_id_is_scoped_to_its_tenant() -> None:
    # Replies are routed by request id alone: unscoped, a tenant reusing another's
    # x-request-id got that request's late replies (after its caller gave up) as its own.
    assert routes.scoped_request_id("acme", "job-1") == "acme:job-1"
    assert routes.scoped_request_id("beta", "job-1") == "beta:job-1"
    long = routes.scoped_request_id("acme", "j" * 128)
    assert long.startswith("acme:") and len(long) <= 128
    assert long != routes.scoped_request_id("acme", "j" * 127 + "k")
    assert routes.scoped_request_id("acme", "bad id!") == "bad id!"  # validation names it


async def test_the_caller_sees_its_own_id_while_llmq_uses_the_scoped_one() -> None:
    api = Api([(0.01, lambda rid: make_done(request_id=rid, attempt=1))])
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    sent: list[str] = []
    submit = api.producer.send_and_wait

    async def record(topic: str, value: bytes, key: bytes | None = None,
                     headers: Any = None) -> None:
        if topic == TOPICS.intake:
            sent.append(decode(value, InferenceRequest).request_id)
        await submit(topic, value, key, headers)

    api.producer.send_and_wait = record  # type: ignore[method-assign]
    out = await api.call([body], [(b"x-request-id", b"job-1")])
    assert out.status == 200 and json.loads(out.body)["id"] == "job-1"
    assert sent == ["default:job-1"]


async def test_a_client_id_whose_call_ended_is_refused_to_the_next_call() -> None:
    # Intake still holds the first call's reservation for a moment after its answer, and
    # the scheduler remembers the id for long: a new call with it waited for its timeout.
    api = Api([(0.01, lambda rid: make_done(request_id=rid, attempt=1))])
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    first = await api.call([body], [(b"x-request-id", b"job-42")])
    assert first.status == 200
    again = await api.call([body], [(b"x-request-id", b"job-42")])
    assert again.status == 409
    error = json.loads(again.body)["error"]
    assert (error["code"], error["param"]) == ("duplicate_request", "x-request-id")
    assert "'job-42' was used by a call that ended" in error["message"]
    # An id llmq chose is never reused; another client id is fine.
    assert (await api.call([body], [(b"x-request-id", b"job-43")])).status == 200
    assert (await api.post({"model": "m", "prompt": "x"})).status == 200


async def test_a_retry_with_the_id_of_an_abandoned_call_is_refused_not_sent_its_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(routes, "_DISCONNECT_POLL_S", 0.05)
    api = Api([])
    body = json.dumps({"model": "m", "prompt": "x", "timeout": 30}).encode()
    gone = asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, gone.set)
    left = await api.call([body], [(b"x-request-id", b"job-7")], gone)
    assert left.status == 499 and len(api.producer.cancels) == 1
    retry = await api.call([body], [(b"x-request-id", b"job-7")])
    assert retry.status == 409


async def test_a_gathered_answer_notices_its_client_leaving_while_tokens_flow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: a non-streaming call looked for its client only after a second
    without a reply, so while the model generated (a chunk every 20 ms here) a client
    that left was never noticed: the request ran to its end for nobody."""
    monkeypatch.setattr(routes, "_DISCONNECT_POLL_S", 0.05)
    script: Script = [(0.02 * i, lambda rid, i=i: make_chunk(request_id=rid, attempt=1, seq=i))
                      for i in range(1, 150)]
    script.append((3.1, lambda rid: make_done(request_id=rid, attempt=1)))
    api = Api(script)
    out = await asyncio.wait_for(
        api.post({"model": "m", "prompt": "x", "timeout": 30}, leave_after_s=0.2), 2)
    assert out.status == 499
    assert [c.reason for c in api.producer.cancels] == ["client disconnected"]


@pytest.mark.parametrize(("code", "status", "again"), [
    ("rate_limited", 429, 200), ("overloaded", 503, 200), ("too_large", 413, 409)])
async def test_an_id_refused_at_admission_may_be_retried_at_once(
    code: str, status: int, again: int,
) -> None:
    """Found by an audit: the OpenAI SDK retries a 429 with the same x-request-id, which
    got 409 for 60 s (and retried that too: the 409 did not say not to)."""
    refused: set[str] = set()

    def first_refused(rid: str) -> Reply:
        if rid in refused:
            return make_done(request_id=rid, attempt=1)
        refused.add(rid)
        return make_error(request_id=rid, attempt=0, code=code, retry_after_s=1.0)

    api = Api([(0.01, first_refused)])
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    first = await api.call([body], [(b"x-request-id", b"job-1")])
    assert first.status == status
    retry = await api.call([body], [(b"x-request-id", b"job-1")])
    assert retry.status == again
    if again == 409:
        assert (b"x-should-retry", b"false") in retry.headers


async def test_a_client_gone_during_its_upload_gets_no_500() -> None:
    """Found by an audit: Starlette's ClientDisconnect reached the catch-all handler, a
    500, and was raised out of the app (an error in the server's log)."""
    api = Api([])
    gone = asyncio.Event()
    gone.set()
    out = await api.call([b'{"model": "m",', b'"prompt": "x"}'], [], gone, cut_after=1)
    assert out.status == 499
    assert api.producer.cancels == [] and api.router.open_requests == 0


def _answers() -> dict[str, float]:
    from services.common.metrics import REGISTRY

    return {s: REGISTRY.get_sample_value("llmq_http_responses_total", {"status": s}) or 0.0
            for s in ("200", "499", "503", "504")}


def _counted_since(before: dict[str, float]) -> dict[str, float]:
    after = _answers()
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


async def test_a_call_is_counted_by_the_status_it_was_answered_with() -> None:
    """Found by a review: llmq_http_responses_total counted the span's outcome, so a
    gathered call past its deadline (504) counted as 499, and a stream that began 200 and
    ended in an error counted as that error's status."""
    late = Api([(0.01, chunk)], reply_grace_s=0.0)  # a chunk, never a terminal
    before = _answers()
    out = await late.post({"model": "m", "prompt": "x", "timeout": 0.3})
    assert (out.status, _counted_since(before)) == (504, {"504": 1})
    failing = Api([(0.01, chunk), (0.02, lambda rid: make_error(
        request_id=rid, attempt=1, code="worker_lost", retry_after_s=None))])
    before = _answers()
    out = await failing.post({"model": "m", "prompt": "x", "stream": True})
    assert (out.status, _counted_since(before)) == (200, {"200": 1})
