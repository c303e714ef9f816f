"""The client SDK's handle without a broker: its producer is a stand-in that records what
is sent, and its reply router is the real one, never started (``route`` feeds it); so is
``llmq submit``'s. The SDK against a real broker: tests/integration/test_e2e_stack.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from llmq.client import DEFAULT_REPLY_GRACE_S, LlmqClient
from schemas.codec import decode
from schemas.control import CancelRequest
from schemas.replies import Done, Error, Timings, TokenChunk, Usage
from schemas.requests import InferenceRequest
from services.cli import main
from tests.builders_schemas import make_chunk, make_done, make_error


class _Producer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def send_and_wait(self, topic: str, value: bytes, key: Any = None,
                            headers: Any = None) -> None:
        self.sent.append((topic, value))

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def _client(**options: Any) -> tuple[LlmqClient, _Producer]:
    client = LlmqClient("127.0.0.1:9", tenant="default", **options)
    producer = client._producer = _Producer()
    return client, producer


def _chunk(request_id: str, seq: int) -> TokenChunk:
    return TokenChunk(request_id=request_id, attempt=1, seq=seq, text=f"t{seq}", tokens=1,
                      ts=1.0)


async def test_a_timed_out_request_is_cancelled_and_forgotten() -> None:
    client, producer = _client(reply_grace_s=0.05)
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=0.1, request_id="r1")
    with pytest.raises(TimeoutError, match=r"no terminal reply for r1 within its timeout of "
                       r"0\.1 s \(and 0\.05 s of grace\)"):
        async for _ in handle:
            pass
    [cancel] = [decode(v, CancelRequest) for t, v in producer.sent if t.endswith("control")]
    assert (cancel.request_id, cancel.reason) == ("r1", "client timeout")
    assert client._router.open_requests == 0
    assert not client._router.route(_chunk("r1", 0))  # a late reply goes nowhere
    again = await client.submit(prompt="hi", max_tokens=4, request_id="r1")  # id reusable
    assert again.request_id == "r1"


async def test_a_reply_that_came_in_time_is_kept_when_read_after_the_deadline() -> None:
    """Found by an audit: a handle read late raised TimeoutError (and sent a cancel) with
    its Done already queued."""
    client, producer = _client(reply_grace_s=0.0)
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=0.1, request_id="r1")
    client._router.route(_chunk("r1", 0))
    client._router.route(Done(request_id="r1", attempt=1, model="m", finish_reason="stop",
                              usage=Usage(prompt_tokens=1, completion_tokens=1),
                              timings=Timings(queued_s=0, ttft_s=0, e2e_s=0), ts=1.0))
    await asyncio.sleep(0.15)  # read after the deadline
    text, result = await handle.wait()
    assert (text, result.kind) == ("t0", "done")
    assert not [t for t, _ in producer.sent if t.endswith("control")]  # nothing cancelled


async def test_a_failed_cancel_after_the_timeout_still_raises_the_timeout() -> None:
    client, producer = _client(reply_grace_s=0.0)
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=0.05, request_id="r1")

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker gone")

    producer.send_and_wait = broken  # type: ignore[method-assign]
    with pytest.raises(TimeoutError, match="no terminal reply for r1"):
        await handle.wait()


async def test_an_empty_request_id_is_refused_not_replaced() -> None:
    client, producer = _client()
    with pytest.raises(ValidationError):
        await client.submit(prompt="hi", max_tokens=4, request_id="")
    assert producer.sent == []


async def test_leaving_the_loop_early_keeps_the_stream_for_later() -> None:
    client, _ = _client()
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=30, request_id="r2")
    router = client._router
    for seq in range(2):
        router.route(_chunk("r2", seq))
    async for chunk in handle:
        assert chunk.seq == 0
        break
    assert router.open_requests == 1
    router.route(Done(request_id="r2", attempt=1, model="m", finish_reason="stop",
                      usage=Usage(prompt_tokens=1, completion_tokens=2),
                      timings=Timings(queued_s=0.0, e2e_s=0.1), ts=1.0))
    text, end = await asyncio.wait_for(handle.wait(), 5)
    assert text == "t1" and isinstance(end, Done)
    assert router.open_requests == 0


async def test_llmqs_own_timeout_that_comes_just_after_timeout_s_is_the_result() -> None:
    # llmq ends an expired request at created_at + timeout_s, on its next dispatch cycle:
    # a moment after timeout_s. The client waits for it (before, it raised TimeoutError at
    # timeout_s exactly and sent a needless cancel).
    client, producer = _client()
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=0.1, request_id="r1")
    asyncio.get_running_loop().call_later(0.2, client._router.route, make_error(
        request_id="r1", attempt=0, code="queue_timeout", retry_after_s=None))
    text, end = await asyncio.wait_for(handle.wait(), 5)
    assert (text, isinstance(end, Error) and end.code) == ("", "queue_timeout")
    assert not [t for t, _ in producer.sent if t.endswith("control")]


def test_a_negative_reply_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="reply_grace_s"):
        LlmqClient("127.0.0.1:9", reply_grace_s=-1.0)


@pytest.mark.parametrize(("replies", "text"), [
    # Attempt 1's chunk was read before attempt 2 started: its text is void.
    ([make_chunk(request_id="r1", attempt=1, seq=0, text="old "),
      make_chunk(request_id="r1", attempt=2, seq=0, text="new"),
      make_done(request_id="r1", attempt=2)], "new"),
    # Attempt 2 finished without a chunk: still nothing of attempt 1.
    ([make_chunk(request_id="r1", attempt=1, seq=0, text="old "),
      make_done(request_id="r1", attempt=2)], ""),
])
async def test_wait_keeps_only_the_newest_attempts_text(replies: list[Any], text: str) -> None:
    client, _ = _client()
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=30, request_id="r1")
    client._router.route(replies[0])
    for i, reply in enumerate(replies[1:], 1):  # after the first was read
        asyncio.get_running_loop().call_later(0.02 * i, client._router.route, reply)
    got, end = await asyncio.wait_for(handle.wait(), 5)
    assert (got, end.attempt) == (text, 2)


async def test_stop_ends_open_handles_at_once() -> None:
    client, producer = _client()
    waiting = await client.submit(prompt="hi", max_tokens=4, timeout_s=30, request_id="r1")
    later = await client.submit(prompt="hi", max_tokens=4, timeout_s=30, request_id="r2")
    blocked = asyncio.create_task(waiting.wait())
    await asyncio.sleep(0.01)
    await client.stop()
    with pytest.raises(RuntimeError, match="LlmqClient was stopped"):
        await asyncio.wait_for(blocked, 1)  # woken, not left to its 30 s
    with pytest.raises(RuntimeError, match="LlmqClient was stopped"):
        await asyncio.wait_for(later.wait(), 1)  # iterated after stop()
    with pytest.raises(RuntimeError, match="not running: cannot cancel r2"):
        await later.cancel()
    assert not [t for t, _ in producer.sent if t.endswith("control")]


async def test_stop_ends_handles_and_stops_the_producer_even_if_the_router_fails() -> None:
    client, _ = _client()
    stopped: list[str] = []

    class _Stopping(_Producer):
        async def stop(self) -> None:
            stopped.append("producer")

    async def failing_stop() -> None:
        raise OSError("the broker went away")

    client._producer = _Stopping()
    client._router.stop = failing_stop  # type: ignore[method-assign]  # a failing router
    waiting = await client.submit(prompt="hi", max_tokens=4, timeout_s=30, request_id="r1")
    with pytest.raises(OSError, match="went away"):
        await client.stop()
    assert stopped == ["producer"] and client._producer is None
    with pytest.raises(RuntimeError, match="LlmqClient was stopped"):
        await asyncio.wait_for(waiting.wait(), 1)


async def test_a_failed_start_leaves_the_client_not_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import llmq.client as sdk

    async def no_topics(*_: Any, **__: Any) -> None: ...

    async def there(*_: Any, **__: Any) -> bool:
        return True

    async def no_router() -> None:
        raise OSError("no broker")

    monkeypatch.setattr(sdk, "ensure_topics", no_topics)
    monkeypatch.setattr(sdk, "topic_exists", there)
    monkeypatch.setattr(sdk, "make_producer", lambda _: _Producer())
    client = LlmqClient("127.0.0.1:9", tenant="default")
    client._router.start = no_router  # type: ignore[method-assign]  # a failing router
    with pytest.raises(OSError, match="no broker"):
        await client.start()
    with pytest.raises(RuntimeError, match="not running"):
        await client.submit(prompt="hi", max_tokens=4)


async def test_a_broker_without_llmqs_topics_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: the first send waited 15 s for the intake topic's metadata, then
    the CLI said the (running) broker did not answer."""
    import llmq.client as sdk

    asked: list[str] = []

    async def no_topics(*_: Any, **__: Any) -> None:
        asked.append("made the reply topic")

    async def missing(bootstrap: str, name: str) -> bool:
        asked.append(name)
        return False

    producers: list[_Producer] = []
    monkeypatch.setattr(sdk, "ensure_topics", no_topics)
    monkeypatch.setattr(sdk, "topic_exists", missing)
    monkeypatch.setattr(sdk, "make_producer", lambda _: producers.append(_Producer()))
    client = LlmqClient("127.0.0.1:9", tenant="default", prefix="other")
    with pytest.raises(sdk.TopicMissing, match=r"Kafka at 127.0.0.1:9 has no topic "
                       r"other.intake: start llmq there \(`llmq up`\), or use the topic "
                       r"prefix it runs with \(not 'other'\?\)"):
        await client.start()
    assert asked == ["other.intake"] and producers == []  # nothing made nor started
    with pytest.raises(RuntimeError, match="not running"):
        await client.submit(prompt="hi", max_tokens=4)


def test_submit_says_in_one_line_that_llmqs_topics_are_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llmq.client import TopicMissing

    async def start(client: LlmqClient) -> None:
        raise TopicMissing(f"Kafka at {client.bootstrap} has no topic llmq.intake: ...")

    monkeypatch.setenv("LLMQ_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.delenv("LLMQ_DEBUG", raising=False)
    monkeypatch.setattr(LlmqClient, "start", start)
    result = CliRunner().invoke(main, ["submit", "hi"])
    assert result.exit_code == 1
    assert result.output == "Error: Kafka at 127.0.0.1:1 has no topic llmq.intake: ...\n"


def test_a_topic_the_broker_lacks_is_not_called_kafka_not_answering() -> None:
    from aiokafka.errors import UnknownTopicOrPartitionError

    from services.cli import operator_error
    from services.common.settings import Settings

    said = operator_error(UnknownTopicOrPartitionError(), Settings(kafka_bootstrap="b:1"))
    assert said is not None and said.startswith("Kafka at b:1 lacks a topic llmq uses")
    assert "did not answer" not in said


def test_submit_makes_the_reply_topic_with_the_configured_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: the CLI's client made a tenant's reply topic with 1 replica
    whatever LLMQ_REPLICATION_FACTOR said (ingest makes it with the setting)."""
    seen: list[int] = []

    async def start(client: LlmqClient) -> None:
        seen.append(client.replication_factor)
        raise OSError("stop here")

    monkeypatch.setenv("LLMQ_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("LLMQ_REPLICATION_FACTOR", "3")
    monkeypatch.setattr(LlmqClient, "start", start)
    CliRunner().invoke(main, ["submit", "hi"])
    assert seen == [3]


def _submit_cli(monkeypatch: pytest.MonkeyPatch, args: list[str],
                replies: list[Callable[[str], Any]]) -> tuple[Any, _Producer]:
    """``llmq submit`` whose client answers the request with ``replies`` (built from its
    request id, 20 ms apart) and waits 50 ms past its timeout."""
    producer = _Producer()

    async def start(client: LlmqClient) -> None:
        client._producer, client.reply_grace_s = producer, 0.05
        send = producer.send_and_wait

        async def send_and_wait(topic: str, value: bytes, key: Any = None,
                                headers: Any = None) -> None:
            await send(topic, value, key, headers)
            if topic.endswith(".intake"):
                rid = decode(value, InferenceRequest).request_id
                for i, reply in enumerate(replies, 1):
                    asyncio.get_running_loop().call_later(
                        0.02 * i, client._router.route, reply(rid))

        producer.send_and_wait = send_and_wait  # type: ignore[method-assign]  # answers the request

    async def stop(client: LlmqClient) -> None:
        client._producer = None

    monkeypatch.setattr(LlmqClient, "start", start)
    monkeypatch.setattr(LlmqClient, "stop", stop)
    return CliRunner().invoke(main, ["submit", "hi", *args]), producer


def test_submit_json_prints_one_object_on_a_client_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The chunk comes 20 ms after the send; 0.5 s leaves a loaded machine (the whole suite
    # on two cores) time to start the command and send before the timeout runs out.
    result, producer = _submit_cli(monkeypatch, ["--timeout", "0.5", "--json"], [
        lambda rid: make_chunk(request_id=rid, attempt=1, seq=0, text="partial")])
    assert result.exit_code == 1
    out = json.loads(result.stdout)
    assert (out["outcome"], out["code"], out["text"]) == ("error", "client_timeout", "partial")
    assert "within its timeout of 0.5 s" in out["message"]  # not "0 s"
    assert set(out) == {"outcome", "code", "message", "retry_after_s", "request_id", "text",
                        "e2e_s"}  # the shape of an llmq error
    [cancel] = [decode(v, CancelRequest) for t, v in producer.sent if t.endswith("control")]
    assert cancel.request_id == out["request_id"]


def test_submit_keeps_only_the_newest_attempts_text(monkeypatch: pytest.MonkeyPatch) -> None:
    replies = [lambda rid: make_chunk(request_id=rid, attempt=1, seq=0, text="old "),
               lambda rid: make_chunk(request_id=rid, attempt=2, seq=0, text="new"),
               lambda rid: make_done(request_id=rid, attempt=2)]
    result, _ = _submit_cli(monkeypatch, ["--json"], replies)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"] == "new"
    printed, _ = _submit_cli(monkeypatch, [], replies)  # printed text cannot be taken back
    assert printed.stdout == "old new"
    assert "restarted the request (attempt 2): the text above is void" in printed.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["submit", ""], "invalid input: prompt: String should have at least 1 character"),
    (["submit", "hi", "--model", ""], "invalid input: model: String should match pattern"),
])
def test_submit_refuses_a_bad_input_in_one_line_before_kafka(
    monkeypatch: pytest.MonkeyPatch, args: list[str], says: str
) -> None:
    """Found by an audit: checked only once connected (with Kafka down, the Kafka error
    hid it), and printed as pydantic's four lines."""
    monkeypatch.setenv("LLMQ_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # never reached
    monkeypatch.delenv("LLMQ_DEBUG", raising=False)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert says in result.output and len(result.output.strip().splitlines()) == 1


def test_kafka_down_is_one_line_without_aiokafkas_own() -> None:
    """In a real process (pytest's log capture would hide it): aiokafka's log of the
    failed connection came first, on stderr through logging's last-resort handler."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env["LLMQ_KAFKA_BOOTSTRAP"] = "127.0.0.1:1"
    done = subprocess.run([sys.executable, "-c", "from services.cli import main; main()", "dev",
                           "topics"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith("Error: Kafka at 127.0.0.1:1 did not answer")


def test_clients_wait_longer_than_a_worker_sends_a_terminal_past_the_deadline() -> None:
    # At 10 s of grace, a Done a worker sent again after a broker blip (it tries for 12 s
    # past the deadline) could land after the caller was told TimeoutError / 504.
    import dataclasses

    from services.ingest.settings import IngestSettings
    from services.worker.runner import RunConfig

    give_up = next(f.default for f in dataclasses.fields(RunConfig)
                   if f.name == "give_up_after_s")
    assert isinstance(give_up, float)
    assert give_up < DEFAULT_REPLY_GRACE_S
    assert IngestSettings.model_fields["reply_grace_s"].default > give_up


# -- found by an audit of the SDK (each fails on the code before) --------------------------

def _cancels(producer: _Producer) -> list[str]:
    return [decode(v, CancelRequest).request_id for t, v in producer.sent
            if t.endswith("control")]


async def test_a_handle_nobody_reads_is_forgotten_after_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller cancelled while waiting (a web handler whose caller left) kept its stream,
    and every reply of it, for the client's life; the id stayed taken."""
    monkeypatch.setattr("llmq.client.ABANDONED_AFTER_S", 0.05)
    client, _ = _client(reply_grace_s=0.0)
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=0.05, request_id="r1")
    waiter = asyncio.create_task(handle.wait())
    await asyncio.sleep(0.01)
    waiter.cancel()  # abandoned before its deadline
    await asyncio.gather(waiter, return_exceptions=True)
    assert client._router.open_requests == 1
    await asyncio.sleep(0.15)
    client._router.expire(time.monotonic())  # what the router's loop does every poll
    assert client._router.open_requests == 0
    assert not client._router.route(_chunk("r1", 0))
    assert (await client.submit(prompt="hi", max_tokens=4, request_id="r1")).request_id == "r1"


async def test_close_forgets_a_handle_without_cancelling_it() -> None:
    client, producer = _client()
    async with await client.submit(prompt="hi", max_tokens=4, request_id="r1") as handle:
        assert client._router.open_requests == 1
    assert client._router.open_requests == 0 and _cancels(producer) == []
    assert handle.stream.closed == "closed by its caller"


async def test_an_old_handle_read_again_leaves_a_retry_with_its_id_alone() -> None:
    """Reading an old handle again closed the stream of a newer request with the same id
    (its Done then went nowhere), and a timed-out one sent a second cancel that ended it."""
    client, producer = _client(reply_grace_s=0.0)
    refused = await client.submit(prompt="hi", max_tokens=4, request_id="r1")
    client._router.route(make_error(request_id="r1", attempt=0, code="rate_limited"))
    assert (await refused.wait())[1].kind == "error"
    late = await client.submit(prompt="hi", max_tokens=4, timeout_s=0.05, request_id="r2")
    with pytest.raises(TimeoutError):
        await late.wait()
    assert _cancels(producer) == ["r2"]

    retries = [await client.submit(prompt="hi", max_tokens=4, request_id=rid)
               for rid in ("r1", "r2")]
    assert (await refused.wait())[1].kind == "error"  # read again: still its own result
    with pytest.raises(TimeoutError):
        await late.wait()  # given up before: at once, and no second cancel
    await refused.cancel()
    await late.cancel()  # finished or given up: nothing to cancel (it would end the retry)
    assert _cancels(producer) == ["r2"]
    for retry in retries:
        rid = retry.request_id
        assert client._router.route(_chunk(rid, 0))
        assert client._router.route(make_done(request_id=rid, attempt=1))
        text, end = await asyncio.wait_for(retry.wait(), 5)
        assert (text, end.kind) == ("t0", "done")


async def test_a_submit_cancelled_mid_send_cancels_the_request_in_llmq() -> None:
    """aiokafka delivers a batched record whose wait was cancelled: llmq ran a request
    nobody waited for, charged to the tenant, and a retry ran it twice."""
    client, producer = _client()
    stuck = asyncio.Event()

    async def slow_send(topic: str, value: bytes, key: Any = None, headers: Any = None) -> None:
        producer.sent.append((topic, value))  # in the producer's batch
        if topic.endswith("intake"):
            await stuck.wait()

    producer.send_and_wait = slow_send  # type: ignore[method-assign]
    submit = asyncio.create_task(client.submit(prompt="hi", max_tokens=4, request_id="r1"))
    await asyncio.sleep(0.01)
    submit.cancel()
    with pytest.raises(asyncio.CancelledError):
        await submit
    await client.stop()  # waits for the cancel it sent
    assert _cancels(producer) == ["r1"]
    assert client._router.open_requests == 0


async def test_a_step_of_the_wall_clock_does_not_end_a_running_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deadline was compared with time.time(): an NTP step of +700 s ended a healthy
    600 s request at its next chunk, with a cancel."""
    client, producer = _client()
    handle = await client.submit(prompt="hi", max_tokens=4, timeout_s=600, request_id="r1")
    stepped = time.time() + 700
    monkeypatch.setattr("llmq.client.time.time", lambda: stepped)
    client._router.route(_chunk("r1", 0))
    asyncio.get_running_loop().call_later(0.05, client._router.route,
                                          make_done(request_id="r1", attempt=1))
    text, end = await asyncio.wait_for(handle.wait(), 5)
    assert (text, end.kind) == ("t0", "done") and _cancels(producer) == []


async def test_a_client_started_twice_is_refused() -> None:
    client, _ = _client()  # running: it has its producer
    with pytest.raises(RuntimeError, match="already started"):
        await client.start()


def test_a_reserved_tenant_name_is_refused_at_once() -> None:
    """ingest dead-letters a tenant named like its own reply topics, unanswered: every
    handle waited out its whole timeout."""
    with pytest.raises(ValueError, match="reserved"):
        LlmqClient("127.0.0.1:9", tenant="ingest-a")


def test_submit_help_names_the_grace_the_client_waits() -> None:
    out = " ".join(CliRunner().invoke(main, ["submit", "--help"]).output.split())
    assert f"waits {DEFAULT_REPLY_GRACE_S:g} s more" in out


async def test_a_handle_made_without_a_give_up_time_works_it_out() -> None:
    from llmq.client import RequestHandle

    client, _ = _client()
    request = client.new_request(prompt="hi", max_tokens=4, timeout_s=30, request_id="r1")
    handle = RequestHandle(request, client._router.open("r1"), client, 30, 5.0)
    assert handle.give_up_at is not None
    assert 34 < handle.give_up_at - time.monotonic() <= 35
