"""The whole live stack, as `llmq up` runs it: real processes on the real broker.

One stack per module (ingest, scheduler, health, 2 short-pool + 1 long-pool sim workers at
20× simulated speed), a unique topic prefix and free loopback ports. Tests drive it over
the OpenAI-compatible HTTP API, the OpenAI SDK and the Kafka client SDK, and check the
fleet-level promises: tokens stream back, limits refuse with 429 + Retry-After, priority
and lanes hold, drain and a scheduler kill -9 lose nothing, reservations return to zero.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiokafka import TopicPartition

from llmq.client import LlmqClient
from schemas.codec import decode, encode
from schemas.messages import REPLY_ADAPTER, STATUS_ADAPTER
from schemas.replies import Done, Error, TokenChunk
from schemas.status import QueueStatus
from schemas.topics import catalog, reply_spec
from services.common.kafka import make_consumer
from services.common.replies import topic_partitions
from services.common.settings import Settings
from services.stack import Stack, settings_env, stack_services
from tests.builders_schemas import make_prompt_request
from tests.fakes.live_stack import StackProcs, loopback_config, wait_stack_ready
from tests.prefixes import unique_prefix

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "llama-3.1-8b"
LIMITED_KEY = "limited-key"


def _tenants_file(path: Path) -> Path:
    digest = hashlib.sha256(LIMITED_KEY.encode()).hexdigest()
    open_digest = hashlib.sha256(b"open-key").hexdigest()
    path.write_text(
        "[tenants.default]\n"
        f'api_key_sha256 = ["{open_digest}"]\n'
        "rpm = 100000\ntpm = 100000000\nmax_concurrency = 10000\n"
        'max_priority = "high"\nmay_set_lane = true\n\n'
        "[tenants.limited]\n"
        f'api_key_sha256 = ["{digest}"]\n'
        "rpm = 3\ntpm = 100000\nmax_concurrency = 100\n"
    )
    return path


class LiveStack(StackProcs):
    """The stack's processes plus what tests need to reach them."""

    def __init__(self, tmp: Path, bootstrap: str) -> None:
        self.prefix = unique_prefix("e")
        self.settings = Settings(topic_prefix=self.prefix, assignment_partitions=8)
        self.bootstrap = bootstrap
        self.cfg = loopback_config(time_scale=0.05, model=MODEL)
        self.http_port = self.cfg.http_port
        self.env = settings_env(self.settings) | {
            "LLMQ_TENANTS_FILE": str(_tenants_file(tmp / "tenants.toml")),
        }
        self.specs = stack_services(self.cfg)
        self.log_dir = tmp / "logs"
        self.stack = Stack(self.specs, self.env)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def headers(self, key: str = "open-key") -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def _warm_up(self, deadline: float) -> bool:
        """One request end to end: on a fresh broker the Faust consumer groups of ingest
        and the scheduler may still be settling when every probe already says ready."""
        body = {"model": MODEL, "prompt": "warm up", "max_tokens": 2}
        try:
            resp = httpx.post(f"{self.base_url}/v1/completions", json=body,
                              headers=self.headers(),
                              timeout=max(1.0, deadline - time.monotonic()))
        except httpx.TimeoutException:
            return False
        return resp.status_code == 200

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        wait_stack_ready(self.stack, self.base_url, self.log_dir, timeout_s,
                         also=self._warm_up)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, bootstrap: str) -> Iterator[LiveStack]:
    tmp = tmp_path_factory.mktemp("stack")
    stack = LiveStack(tmp, bootstrap)
    stack.stack.start(log_dir=stack.log_dir)
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stack.stop(grace_s=20.0)


def _chat(live: LiveStack, text: str, max_tokens: int = 24, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, **extra}
    return httpx.post(f"{live.base_url}/v1/chat/completions", json=body,
                      headers=live.headers(), timeout=60)


def test_http_streaming_and_non_streaming(live: LiveStack) -> None:
    resp = _chat(live, "hello")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 24
    assert body["choices"][0]["message"]["content"]

    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream please"}],
            "max_tokens": 40, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{live.base_url}/v1/chat/completions", json=body,
                      headers=live.headers(), timeout=60) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert len(chunks) >= 2  # streamed in several pieces, not one blob
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text


def test_openai_sdk(live: LiveStack) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{live.base_url}/v1", api_key="open-key", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16)
    assert out.usage is not None and out.usage.completion_tokens == 16
    assert [m.id for m in client.models.list().data] == [MODEL]


async def test_kafka_client_sdk(live: LiveStack) -> None:
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL) as client:
        handle = await client.submit(prompt="via kafka", max_tokens=30, timeout_s=60)
        text, end = await handle.wait()
    assert isinstance(end, Done), end
    assert end.usage.completion_tokens == 30 and text


def test_burst_over_tenant_limit_gets_429_with_retry_after(live: LiveStack) -> None:
    codes = []
    retry_after = None
    for i in range(6):
        resp = httpx.post(
            f"{live.base_url}/v1/completions",
            json={"model": MODEL, "prompt": f"burst {i}", "max_tokens": 4},
            headers=live.headers(LIMITED_KEY), timeout=60,
        )
        codes.append(resp.status_code)
        if resp.status_code == 429:
            retry_after = resp.headers.get("retry-after")
            assert resp.json()["error"]["code"] == "rate_limited"
    assert codes[:3] == [200, 200, 200]
    assert codes[3:] == [429, 429, 429]
    assert retry_after is not None and int(retry_after) >= 1


async def test_short_request_not_stuck_behind_long_ones(live: LiveStack) -> None:
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL) as client:
        # ~1,000 prompt + 5,000 output tokens: long lane, ~1.5 s each at 20x sim speed.
        longs = [
            await client.submit(prompt="x" * 4_000, max_tokens=5000, timeout_s=120)
            for _ in range(4)
        ]
        for handle in longs:  # all of them are generating now (not refused: see the assert)
            first = await handle.stream.get(timeout=30)
            assert isinstance(first, TokenChunk), first
        t0 = time.monotonic()
        short = await client.submit(prompt="quick question", max_tokens=8, timeout_s=60)
        _, end = await short.wait()
        short_s = time.monotonic() - t0
        assert isinstance(end, Done), end
        results = [await h.wait() for h in longs]
        long_s = time.monotonic() - t0
    assert all(isinstance(r[1], Done) for r in results)
    # The short request finished while the long ones were still generating. A timing
    # ratio, not an order of ends: RequestHandle.result is set only as its stream is
    # read, so the longs' ends cannot be checked without waiting for them; stuck behind
    # them, the short one would take about as long as they do (ratio near 1).
    assert short_s < long_s / 2, (short_s, long_s)


async def _queue_status(live: LiveStack) -> dict[str, QueueStatus]:
    topic = next(s.name for s in catalog(live.prefix) if s.name.endswith(".status"))
    consumer = make_consumer(live.bootstrap, topic)
    await consumer.start()
    latest: dict[str, QueueStatus] = {}
    try:
        batches = await consumer.getmany(timeout_ms=2000)
        for records in batches.values():
            for r in records:
                if r.value is not None:
                    msg = decode(r.value, STATUS_ADAPTER)
                    latest[msg.model] = msg
    finally:
        await consumer.stop()
    return latest


async def _wait_reservations_zero(live: LiveStack, timeout_s: float = 30.0) -> QueueStatus:
    """Wait until nothing is pending and no reservation is left (the warm-up's included)."""
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = (await _queue_status(live)).get(MODEL)
        if status and status.running_tokens == 0 and (
            status.pending_requests == 0
        ) and (
            time.time() - status.ts < 5
        ):
            return status
        await asyncio.sleep(1.0)
    raise AssertionError(f"reservations did not return to zero: {status}")


async def test_cancel_frees_the_reservation_and_idle_is_zero(live: LiveStack) -> None:
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL) as client:
        handle = await client.submit(prompt="cancel me", max_tokens=1800, timeout_s=120)
        async for _chunk in handle:
            await handle.cancel("test")
            break
        async for _chunk in handle:
            pass
        assert isinstance(handle.result, Error) and handle.result.code == "cancelled"
    await _wait_reservations_zero(live)


async def test_scheduler_kill9_loses_no_accepted_request(live: LiveStack) -> None:
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL) as client:
        handles = [
            await client.submit(prompt=f"survive {i}", max_tokens=60, timeout_s=120)
            for i in range(12)
        ]
        live.proc("scheduler").send_signal(signal.SIGKILL)
        live.proc("scheduler").wait()
        more = [
            await client.submit(prompt=f"while down {i}", max_tokens=20, timeout_s=120)
            for i in range(4)
        ]
        live.restart("scheduler")
        results = [await h.wait() for h in [*handles, *more]]
    ends = [end for _, end in results]
    assert all(isinstance(e, Done) for e in ends), [e for e in ends if not isinstance(e, Done)]
    await _wait_reservations_zero(live, timeout_s=40)


async def test_ingest_kill9_mid_burst_loses_no_kafka_request(live: LiveStack) -> None:
    """Requests produced straight to the intake topic while ingest is killed -9 and
    restarted 0.5 s later: the restarted ingest admits every one (its Faust recovery seeks
    back to the committed offsets; records fetched meanwhile were once cleared unprocessed,
    faust-streaming#596, see services.common.faust_recovery) and each gets its terminal."""
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL) as client:
        handles = []
        for i in range(160):
            if i == 60:
                ingest = live.proc("ingest")
                ingest.send_signal(signal.SIGKILL)
                await asyncio.to_thread(ingest.wait, 10)
            if i == 75:  # 0.5 s later
                live.restart("ingest")
            handles.append(await client.submit(prompt=f"intake {i}", max_tokens=4,
                                               timeout_s=120))
            await asyncio.sleep(0.03)
        results = [await h.wait() for h in handles]
    assert all(isinstance(end, Done) for _, end in results), \
        [end for _, end in results if not isinstance(end, Done)]
    await asyncio.to_thread(live.wait_ready)  # the API is back for the tests after


async def _terminals_on_reply_topic(live: LiveStack, request_ids: set[str]) -> dict[str, int]:
    """Terminal replies (done or error, any attempt) per request id, read from the start of
    the default tenant's reply topic to its end."""
    topic = reply_spec(live.prefix, "default").name
    tps = [TopicPartition(topic, p) for p in await topic_partitions(live.bootstrap, topic)]
    consumer = make_consumer(live.bootstrap)
    await consumer.start()
    try:
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        counts = dict.fromkeys(request_ids, 0)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    reply = decode(record.value, REPLY_ADAPTER)
                    if reply.request_id in counts and isinstance(reply, Done | Error):
                        counts[reply.request_id] += 1
        return counts
    finally:
        await consumer.stop()


#: Produces stdin's bytes to argv[1] (key argv[2]) with a header key that is not UTF-8,
#: through aiokafka's pure-Python record builder (its C builder refuses such a key).
_BAD_HEADER_PRODUCER = """
import asyncio, os, sys
from aiokafka import AIOKafkaProducer

class RawKey(str):
    def encode(self, *args, **kwargs):
        return b"\\xff\\xfe"

async def main():
    producer = AIOKafkaProducer(bootstrap_servers=os.environ["BOOTSTRAP"])
    await producer.start()
    try:
        await producer.send_and_wait(sys.argv[1], sys.stdin.buffer.read(),
                                     key=sys.argv[2].encode(), headers=[(RawKey("x"), b"v")])
    finally:
        await producer.stop()

asyncio.run(main())
"""


async def test_a_request_with_a_header_key_that_is_not_utf8_is_served(
    live: LiveStack,
) -> None:
    """Kafka does not check header keys; aiokafka decodes them strictly and failed the whole
    fetch, which crashed ingest's Faust fetcher (and again after every restart). Now the
    record is read with U+FFFD in the key: the request is served like any other and ingest
    keeps serving."""
    request = make_prompt_request("odd header", request_id="odd-header-1", tenant="default",
                                  model=MODEL, max_tokens=8, created_at=time.time(),
                                  timeout_s=60.0, priority="normal", reply_to=None,
                                  prefix_hash=None)
    intake = next(s.name for s in catalog(live.prefix) if s.name.endswith(".intake"))
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL):
        pass  # creates the tenant's reply topic, as any Kafka client of llmq does
    produced = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", _BAD_HEADER_PRODUCER, intake, "default"],
        input=encode(request), capture_output=True, timeout=60,
        env={**os.environ, "AIOKAFKA_NO_EXTENSIONS": "1", "BOOTSTRAP": live.bootstrap},
    )
    assert produced.returncode == 0, produced.stderr
    deadline = time.monotonic() + 60
    while (await _terminals_on_reply_topic(live, {"odd-header-1"}))["odd-header-1"] == 0:
        assert time.monotonic() < deadline, "no terminal for the request"
        await asyncio.sleep(0.5)
    assert live.proc("ingest").poll() is None
    assert _chat(live, "still there?").status_code == 200


async def test_worker_kill9_and_immediate_restart_end_each_request_once(
    live: LiveStack,
) -> None:
    """A worker killed mid-stream and restarted at once (same id, same slot): its
    uncommitted assignments are read again by the new process, which drops them (stamped
    for the old process); the scheduler requeues what had not streamed and ends what had
    with worker_lost. Every request ends, and with exactly one terminal reply."""
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL) as client:
        # Long lane (> 2,000 tokens): the long-pool worker, ~2 s each at 20x.
        handles = [
            await client.submit(prompt=f"restart {i}", max_tokens=6_000, timeout_s=120)
            for i in range(8)
        ]
        await asyncio.sleep(1.0)  # streaming by now
        victim = live.proc("worker-2")
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
        live.restart("worker-2")
        results = [await h.wait() for h in handles]
    ends = {h.request_id: end for h, (_, end) in zip(handles, results, strict=True)}
    assert all(isinstance(e, Done) or (isinstance(e, Error) and e.code == "worker_lost")
               for e in ends.values()), ends
    assert any(isinstance(e, Error) or e.attempt > 1 for e in ends.values())  # it hit work
    await asyncio.sleep(2.0)  # room for a second terminal, were one coming
    counts = await _terminals_on_reply_topic(live, set(ends))
    assert set(counts.values()) == {1}, counts
    await _wait_reservations_zero(live, timeout_s=40)


async def test_drain_loses_nothing(live: LiveStack) -> None:
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL) as client:
        handles = [
            await client.submit(prompt=f"drain {i}", max_tokens=200, timeout_s=120)
            for i in range(8)
        ]
        await asyncio.sleep(1.0)
        worker = live.proc("worker-0")
        worker.send_signal(signal.SIGTERM)  # drain: finish in-flight, take nothing new
        results = [await h.wait() for h in handles]
        code = await asyncio.to_thread(worker.wait, 60)
    assert code == 0
    assert all(isinstance(end, Done) for _, end in results)
