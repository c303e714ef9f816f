"""Prefill and decode apart, live: real processes on the real broker.

One stack (ingest, scheduler, health, one prefill and one decode ``sim`` worker at 20×
simulated speed; the sim engine's KV hand-off is a labelled fake of a KV connector: it
moves no bytes, the decode engine counts the prompt as cached). A request is placed as its
prefill stage (attempt 1) on the prefill worker, which reports ``event.prefilled`` and
sends nothing to the client; the scheduler places the decode stage (attempt 2) on the
decode worker, which streams the answer. Checked from the topics themselves.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from llmq.client import LlmqClient
from schemas.codec import decode
from schemas.messages import (
    ASSIGNMENT_ADAPTER,
    EVENT_ADAPTER,
    HEARTBEAT_ADAPTER,
    REPLY_ADAPTER,
)
from schemas.replies import Done, Error, TokenChunk
from schemas.topics import catalog, reply_spec
from services.common.kafka import make_consumer
from services.common.replies import topic_partitions
from services.common.settings import Settings
from services.stack import Stack, settings_env, stack_services
from tests.fakes.live_stack import (
    StackProcs,
    loopback_config,
    wait_stack_ready,
    write_tenants_file,
)
from tests.prefixes import unique_prefix

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "llama-3.1-8b"


class PdStack(StackProcs):
    def __init__(self, tmp: Path, bootstrap: str) -> None:
        self.prefix = unique_prefix("pd")
        self.bootstrap = bootstrap
        settings = Settings(topic_prefix=self.prefix, assignment_partitions=4)
        self.cfg = loopback_config(time_scale=0.05, model=MODEL, short_workers=0,
                                   long_workers=0, prefill_workers=1, decode_workers=1)
        self.env = settings_env(settings) | {
            "LLMQ_TENANTS_FILE": str(write_tenants_file(tmp / "tenants.toml"))}
        self.log_dir = tmp / "logs"
        # The prefill worker at real speed (the rest at 20x): its prompts take long enough
        # for a test to act while hand-offs are on their way.
        self.specs = [replace(spec, argv=_real_speed(spec.argv)) if "prefill" in spec.argv
                      else spec for spec in stack_services(self.cfg)]
        self.stack = Stack(self.specs, self.env)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.http_port}"

    def topic(self, suffix: str) -> str:
        return next(s.name for s in catalog(self.prefix) if s.name.endswith(suffix))


def _real_speed(argv: tuple[str, ...]) -> tuple[str, ...]:
    i = argv.index("--time-scale")
    return (*argv[: i + 1], "1.0", *argv[i + 2:])


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, bootstrap: str) -> Iterator[PdStack]:
    stack = PdStack(tmp_path_factory.mktemp("pd"), bootstrap)
    stack.stack.start(log_dir=stack.log_dir)

    def both_roles_beat(deadline: float) -> bool:
        # Ready as soon as a decode worker beats; a request placed before the prefill
        # worker's first beat would run whole, and the phase checks below would fail.
        beats = asyncio.run(_read_all(bootstrap, stack.topic(".heartbeats"), HEARTBEAT_ADAPTER))
        fresh = {hb.role for hb in beats if time.time() - hb.ts < 3 * hb.interval_s}
        return {"prefill", "decode"} <= fresh

    try:
        wait_stack_ready(stack.stack, stack.base_url, stack.log_dir, 180.0,
                         also=both_roles_beat)
        yield stack
    finally:
        stack.stack.stop(grace_s=20.0)


async def _read_all(bootstrap: str, topic: str, adapter: Any) -> list[Any]:
    """Every record of ``topic`` from its start to its end, decoded."""
    tps = [TopicPartition(topic, p) for p in await topic_partitions(bootstrap, topic)]
    consumer = make_consumer(bootstrap)
    await consumer.start()
    out: list[Any] = []
    try:
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out.extend(decode(r.value, adapter) for r in records if r.value is not None)
    finally:
        await consumer.stop()
    return out


async def _stages(pd: PdStack, request_id: str) -> list[tuple[int, str]]:
    placed = [a for a in await _read_all(pd.bootstrap, pd.topic(".assignments"),
                                         ASSIGNMENT_ADAPTER) if a.request_id == request_id]
    return sorted((a.attempt, a.phase) for a in placed)  # one partition per worker


async def test_http_chat_is_served_through_both_stages(pd: PdStack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "split me " * 50}],
            "max_tokens": 20}
    async with httpx.AsyncClient(timeout=60) as http:
        resp = await http.post(f"{pd.base_url}/v1/chat/completions", json=body,
                               headers={"Authorization": "Bearer open-key",
                                        "x-request-id": "pd-http-1"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 20
    # Downstream, the caller's id is scoped to its tenant (docs/live-system.md).
    assert await _stages(pd, "default:pd-http-1") == [(1, "prefill"), (2, "decode")]


async def test_a_request_runs_prefill_then_decode_with_one_terminal(pd: PdStack) -> None:
    async with LlmqClient(pd.bootstrap, prefix=pd.prefix, default_model=MODEL) as client:
        handle = await client.submit(prompt="x" * 3_000, max_tokens=40, timeout_s=60)
        chunks = []
        async for chunk in handle:
            chunks.append(chunk)
        end = handle.result
    assert isinstance(end, Done), end
    assert end.usage.completion_tokens == 40
    assert all(isinstance(c, TokenChunk) and c.attempt == 2 for c in chunks)
    rid = handle.request_id
    placed = sorted((a for a in await _read_all(pd.bootstrap, pd.topic(".assignments"),
                                                ASSIGNMENT_ADAPTER) if a.request_id == rid),
                    key=lambda a: a.attempt)  # one partition per worker: read in any order
    assert [(a.attempt, a.phase) for a in placed] == [(1, "prefill"), (2, "decode")]
    assert end.usage.prompt_tokens == placed[0].admitted.prompt_tokens
    prefill, decode_stage = placed
    assert prefill.worker_id != decode_stage.worker_id
    assert decode_stage.kv_transfer is not None and decode_stage.kv_transfer["engine"] == "sim"
    seen = [(e.kind, e.attempt) for e in await _read_all(
        pd.bootstrap, pd.topic(".events"), EVENT_ADAPTER) if e.request_id == rid]
    assert ("event.prefilled", 1) in seen and ("event.done", 2) in seen
    assert ("event.first_token", 1) not in seen  # the prefill's token is not the client's
    replies = [r for r in await _read_all(pd.bootstrap, reply_spec(pd.prefix, "default").name,
                                          REPLY_ADAPTER) if r.request_id == rid]
    terminals = [r for r in replies if isinstance(r, Done | Error)]
    assert len(terminals) == 1 and terminals[0].attempt == 2
    assert {r.attempt for r in replies} == {2}  # nothing from the prefill stage


async def test_scheduler_kill9_between_the_stages_ends_each_request_once(pd: PdStack) -> None:
    """The scheduler is killed -9 while a burst is between its stages (prefilled, decoded,
    queued) and restarted 0.5 s later: it rebuilds the hand-offs from the log and places
    their decode stages (after ``takeover_s``); every request ends once, with its answer."""
    async with LlmqClient(pd.bootstrap, prefix=pd.prefix, default_model=MODEL) as client:
        # ~7k-token prompts, ~110k tokens in all (under the overflow threshold): ~2 s of
        # prefill at real speed. The kill comes after the first hand-off, with the rest
        # still to come.
        handles = await asyncio.gather(*(
            client.submit(prompt="z" * (27_000 + 100 * i), max_tokens=40, timeout_s=120)
            for i in range(16)))
        ids = {h.request_id for h in handles}
        await _until_event(pd, ids, "event.prefilled")
        killed_at, _ = await _kill9_and_restart(pd, "scheduler")
        ends = [(await h.wait())[1] for h in handles]
    assert all(isinstance(e, Done) for e in ends), [e for e in ends if not isinstance(e, Done)]
    await _one_terminal_each(pd, ids)
    placed = await _placed_once(pd, ids)
    for rid in ids:  # each in two stages, none placed twice
        stages = sorted((a.attempt, a.phase) for a in placed if a.request_id == rid)
        assert stages == [(1, "prefill"), (2, "decode")], (rid, stages)
    # Some hand-off crossed the restart: prefilled before the kill, decoded after it.
    crossed = {a.request_id for a in placed if a.phase == "prefill" and a.assigned_at < killed_at} \
        & {a.request_id for a in placed if a.phase == "decode" and a.assigned_at > killed_at}
    assert crossed, "no hand-off crossed the scheduler's restart: the test tested nothing"


async def test_a_burst_is_served_and_every_reservation_returns(pd: PdStack) -> None:
    async with LlmqClient(pd.bootstrap, prefix=pd.prefix, default_model=MODEL) as client:
        handles = [await client.submit(prompt="y" * (200 + 400 * i), max_tokens=16 + i,
                                       timeout_s=90, priority=("high", "normal", "low")[i % 3])
                   for i in range(12)]
        ends = [(await h.wait())[1] for h in handles]
    assert all(isinstance(e, Done) for e in ends), ends
    for handle in handles:  # every one of them in two stages (none overflowed: short)
        assert await _stages(pd, handle.request_id) == [(1, "prefill"), (2, "decode")]
    # Every booking the scheduler holds, on every worker it knows (the prefill worker's
    # too), back to zero: its llmq_reserved_kv_tokens gauge.
    url = f"http://127.0.0.1:{pd.cfg.metrics_base_port}/metrics"  # the scheduler's
    deadline = time.monotonic() + 30
    reserved: dict[str, float] = {}
    while time.monotonic() < deadline:
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(url)).text
        reserved = {s.labels["worker"]: s.value for f in text_string_to_metric_families(text)
                    if f.name == "llmq_reserved_kv_tokens" for s in f.samples}
        if reserved and not any(reserved.values()):
            return
        await asyncio.sleep(1.0)
    raise AssertionError(f"reservations did not return to zero: {reserved}")


async def test_decode_worker_kill9_mid_burst_ends_each_request_once(pd: PdStack) -> None:
    """The decode worker is killed -9 while decode stages stream and others wait, and is
    restarted 0.5 s later: a stage that streamed ends ``worker_lost`` (its tokens reached
    the client), one that had not is served again, whole or in two stages; one terminal
    each, whatever the timing."""
    decode_name = next(s.name for s in pd.specs if "decode" in s.argv)
    async with LlmqClient(pd.bootstrap, prefix=pd.prefix, default_model=MODEL) as client:
        # 4,000 output tokens: ~1.2 s of decode each at 20x, so the kill lands mid-stream.
        handles = [await client.submit(prompt=f"kill decode {i} " * 60, max_tokens=4_000,
                                       timeout_s=120) for i in range(10)]
        ids = {h.request_id for h in handles}
        await _until_event(pd, ids, "event.first_token")
        killed_at, restarted_at = await _kill9_and_restart(pd, decode_name)
        ends = [(await h.wait())[1] for h in handles]
    codes = [e.code if isinstance(e, Error) else "done" for e in ends]
    assert set(codes) <= {"done", "worker_lost"}, codes
    await _one_terminal_each(pd, ids)
    events = await _read_all(pd.bootstrap, pd.topic(".events"), EVENT_ADAPTER)
    streamed = {e.request_id for e in events if e.request_id in ids
                and e.kind == "event.first_token" and e.ts < killed_at}
    assert streamed, "no decode stage streamed before the kill: the test tested nothing"
    assert codes.count("worker_lost") <= len(streamed)  # only a stage that streamed fails
    await _placed_once(pd, ids)
    await _until_role_beats(pd, "decode", since=restarted_at)


async def test_prefill_worker_kill9_mid_burst_serves_every_request_once(pd: PdStack) -> None:
    """The prefill worker is killed -9 with prompts still to compute and restarted 0.5 s
    later (a newer process): its unfinished prefill stages are placed again; nothing had
    reached a client, so every request is served, once."""
    prefill = next(s.name for s in pd.specs if "prefill" in s.argv)
    async with LlmqClient(pd.bootstrap, prefix=pd.prefix, default_model=MODEL) as client:
        # ~7k-token prompts at real speed (~0.13 s each): the kill comes after the first.
        handles = await asyncio.gather(*(
            client.submit(prompt="p" * (27_000 + 100 * i), max_tokens=30, timeout_s=120)
            for i in range(16)))
        ids = {h.request_id for h in handles}
        await _until_event(pd, ids, "event.prefilled")
        _, restarted_at = await _kill9_and_restart(pd, prefill)
        ends = [(await h.wait())[1] for h in handles]
    assert all(isinstance(e, Done) for e in ends), [e for e in ends if not isinstance(e, Done)]
    await _one_terminal_each(pd, ids)
    placed = await _placed_once(pd, ids)
    again = {a.request_id for a in placed if a.attempt > 2 or
             (a.attempt == 2 and a.phase != "decode")}
    assert again, "no prefill stage was lost with the worker: the test tested nothing"
    await _until_role_beats(pd, "prefill", since=restarted_at)


async def _kill9_and_restart(pd: PdStack, name: str) -> tuple[float, float]:
    """kill -9 ``name``, start a new process 0.5 s later: (killed at, restarted at)."""
    proc = pd.proc(name)
    killed_at = time.time()
    proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(proc.wait, 10)
    await asyncio.sleep(0.5)
    restarted_at = time.time()
    pd.restart(name)
    return killed_at, restarted_at


async def _placed_once(pd: PdStack, ids: set[str]) -> list[Any]:
    """The assignments of ``ids``, after checking no attempt of one was placed twice."""
    placed = [a for a in await _read_all(pd.bootstrap, pd.topic(".assignments"),
                                         ASSIGNMENT_ADAPTER) if a.request_id in ids]
    for rid in ids:
        attempts = [a.attempt for a in placed if a.request_id == rid]
        assert len(attempts) == len(set(attempts)), (rid, attempts)
    return placed


async def _until_event(pd: PdStack, ids: set[str], kind: str) -> None:
    deadline = time.monotonic() + 30
    while not [e for e in await _read_all(pd.bootstrap, pd.topic(".events"), EVENT_ADAPTER)
               if e.kind == kind and e.request_id in ids]:
        assert time.monotonic() < deadline, f"no {kind} within 30 s"
        await asyncio.sleep(0.05)


async def _one_terminal_each(pd: PdStack, ids: set[str]) -> None:
    terminals: dict[str, int] = dict.fromkeys(ids, 0)
    for reply in await _read_all(pd.bootstrap, reply_spec(pd.prefix, "default").name,
                                 REPLY_ADAPTER):
        if reply.request_id in ids and isinstance(reply, Done | Error):
            terminals[reply.request_id] += 1
    assert set(terminals.values()) == {1}, terminals


async def test_a_draining_prefill_worker_waits_until_its_hand_offs_kv_is_taken(
        pd: PdStack) -> None:
    """SIGTERM drains the prefill worker while the decode stages of its hand-offs still
    wait their turn (the decode worker restarted at real speed, one request at a time).
    The engine holds each prompt's KV until its decode stage takes it, so the worker must
    outlive every decode stage's first token; nothing is started over. Last in the module:
    it ends with the prefill worker drained and started again."""
    prefill = next(s.name for s in pd.specs if "prefill" in s.argv)
    decode_name = next(s.name for s in pd.specs if "decode" in s.argv)
    proc = pd.proc(decode_name)
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0
    pd.specs = [replace(s, argv=(*_real_speed(s.argv), "--max-in-flight", "1"))
                if s.name == decode_name else s for s in pd.specs]
    pd.restart(decode_name)
    await _until_role_beats(pd, "decode", since=time.time())
    async with LlmqClient(pd.bootstrap, prefix=pd.prefix, default_model=MODEL) as client:
        # Short prompts (prefilled at once), 150 output tokens each: ~0.9 s of decode at
        # real speed, one at a time, so the last decode stage starts ~7 s after the first.
        handles = [await client.submit(prompt=f"drain {i} " * 40, max_tokens=150,
                                       timeout_s=90) for i in range(8)]
        ids = {h.request_id for h in handles}
        deadline = time.monotonic() + 30
        while not ids <= {e.request_id for e in await _read_all(
                pd.bootstrap, pd.topic(".events"), EVENT_ADAPTER)
                if e.kind == "event.prefilled"}:
            assert time.monotonic() < deadline, "not every prefill finished in 30 s"
            await asyncio.sleep(0.05)
        worker = pd.proc(prefill)

        def exit_time() -> tuple[int, float]:
            return worker.wait(90), time.time()

        drained_at = time.time()
        worker.send_signal(signal.SIGTERM)
        exited = asyncio.create_task(asyncio.to_thread(exit_time))
        ends = [(await h.wait())[1] for h in handles]
        code, exited_at = await exited
    assert code == 0
    assert all(isinstance(e, Done) for e in ends), ends
    firsts = [e.ts for e in await _read_all(pd.bootstrap, pd.topic(".events"), EVENT_ADAPTER)
              if e.request_id in ids and e.kind == "event.first_token" and e.attempt == 2]
    assert len(firsts) == len(ids)
    # Without the wait the worker left ~2 s after SIGTERM (drain_quiet_s), before most
    # decode stages had their KV; it must have outlived the last first token.
    assert max(firsts) > drained_at + 3.0, "the decode stages were done before the drain"
    assert exited_at >= max(firsts)
    for handle in handles:  # nothing started over: the KV was there for every one
        assert await _stages(pd, handle.request_id) == [(1, "prefill"), (2, "decode")]
    pd.restart(prefill)
    await _until_role_beats(pd, "prefill", since=time.time())


async def _until_role_beats(pd: PdStack, role: str, since: float) -> None:
    deadline = time.monotonic() + 60
    while not [hb for hb in await _read_all(pd.bootstrap, pd.topic(".heartbeats"),
                                            HEARTBEAT_ADAPTER)
               if hb.role == role and hb.ts > since and not hb.draining]:
        assert time.monotonic() < deadline, f"no {role} worker beat within 60 s"
        await asyncio.sleep(0.5)
