"""The live ``sim`` engine (async wrapper over SimEngineCore): streaming, batching, abort,
time scale, capacity."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from services.worker.engines.base import (
    Engine,
    EngineAborted,
    EngineError,
    GenerateRequest,
    TokenDelta,
)
from services.worker.engines.sim.engine import WORDS, SimEngine
from services.worker.engines.sim.profiles import get_profile

PROFILE = get_profile("llama3-8b-h100")


def make_req(request_id: str = "r1", max_tokens: int = 20, prompt_tokens: int = 100,
             **changes: object) -> GenerateRequest:
    return replace(GenerateRequest(request_id=request_id, model="m", max_tokens=max_tokens,
                                   prompt_tokens=prompt_tokens, prompt="hello"),
                   **changes)  # type: ignore[arg-type]  # test builder


async def started(time_scale: float = 0.01, **profile_changes: object) -> SimEngine:
    profile = replace(PROFILE, **profile_changes) if profile_changes else PROFILE  # type: ignore[arg-type]
    engine = SimEngine(profile, time_scale=time_scale, seed=1)
    await engine.start()
    return engine


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [d async for d in stream]


async def test_it_implements_the_engine_protocol() -> None:
    engine = await started()
    try:
        assert isinstance(engine, Engine)
    finally:
        await engine.close()


async def test_two_concurrent_requests_both_stream_their_exact_lengths() -> None:
    engine = await started()
    try:
        a, b = await asyncio.gather(
            collect(engine.generate(make_req("a", max_tokens=30))),
            collect(engine.generate(make_req("b", max_tokens=45))),
        )
    finally:
        await engine.close()
    for deltas, want in ((a, 30), (b, 45)):
        assert sum(d.tokens for d in deltas) == want
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (want - 1)
        last = deltas[-1]
        assert (last.finish_reason, last.completion_tokens, last.prompt_tokens) == \
            ("length", want, 100)
        assert all(d.text.strip() in WORDS for d in deltas)
    assert engine.capacity().running == 0


async def test_requests_share_the_batch() -> None:
    """While both run, capacity shows two running sequences (continuous batching)."""
    engine = await started(time_scale=0.05)
    try:
        seen: list[int] = []

        async def watch() -> None:
            for _ in range(100):
                seen.append(engine.capacity().running)
                await asyncio.sleep(0.002)

        await asyncio.gather(collect(engine.generate(make_req("a", max_tokens=60))),
                             collect(engine.generate(make_req("b", max_tokens=60))), watch())
    finally:
        await engine.close()
    assert max(seen) == 2


async def test_text_is_deterministic_per_request_and_seed() -> None:
    engine = await started()
    try:
        one = await collect(engine.generate(make_req("same", max_tokens=10)))
        two = await collect(engine.generate(make_req("same", max_tokens=10)))
        other = await collect(engine.generate(make_req("other", max_tokens=10)))
    finally:
        await engine.close()
    text = "".join(d.text for d in one)
    assert text == "".join(d.text for d in two)
    assert text != "".join(d.text for d in other)


async def test_abort_ends_the_stream_and_frees_kv() -> None:
    engine = await started(time_scale=0.05)
    total = engine.capacity().kv_free_tokens
    try:
        stream = engine.generate(make_req("a", max_tokens=100_000))
        got = 0
        with pytest.raises(EngineAborted):
            async for delta in stream:
                got += delta.tokens
                if got == 5:
                    assert engine.capacity().kv_free_tokens < total
                    await engine.abort("a")
        assert got == 5
        cap = engine.capacity()
        assert (cap.running, cap.waiting, cap.kv_free_tokens) == (0, 0, total)
        await engine.abort("a")  # unknown now: a no-op
    finally:
        await engine.close()


async def test_closing_the_iterator_aborts_the_request() -> None:
    engine = await started(time_scale=0.05)
    try:
        stream = engine.generate(make_req("a", max_tokens=100_000))
        await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]  # an async generator
        assert engine.capacity().running == 0
    finally:
        await engine.close()


@pytest.mark.parametrize("scale", [0.01, 0.2])
async def test_time_scale_sets_the_pace(scale: float) -> None:
    """200 tokens alone take ≈ 200 × 5.76 ms = 1.15 s simulated: 11.5 ms at 0.01, and about
    0.23 s at 0.2. Only the lower bound is asserted (never faster than the model says, scaled);
    how much slower a loaded machine makes it is for the benchmarks."""
    engine = await started(time_scale=scale)
    try:
        t0 = time.monotonic()
        deltas = await collect(engine.generate(make_req(max_tokens=200)))
        elapsed = time.monotonic() - t0
    finally:
        await engine.close()
    assert sum(d.tokens for d in deltas) == 200
    assert elapsed >= 1.0 * scale, elapsed  # 1.0 s simulated: under the 1.15 s the model says


async def test_too_large_and_duplicate_requests_are_engine_errors() -> None:
    engine = await started(num_blocks=10)  # 160 KV tokens
    try:
        with pytest.raises(EngineError) as info:
            await collect(engine.generate(make_req(max_tokens=100, prompt_tokens=100)))
        assert info.value.code == "too_large"
        first = engine.generate(make_req("dup", max_tokens=50, prompt_tokens=10))
        await anext(first)
        with pytest.raises(EngineError) as info:
            await collect(engine.generate(make_req("dup", max_tokens=5, prompt_tokens=10)))
        assert info.value.code == "invalid"
        await first.aclose()  # type: ignore[attr-defined]  # an async generator
    finally:
        await engine.close()


async def test_capacity_reports_the_profile() -> None:
    engine = await started()
    try:
        cap = engine.capacity()
    finally:
        await engine.close()
    assert cap.kv_total_tokens == PROFILE.num_blocks * PROFILE.block_size
    assert cap.kv_total_bytes == cap.kv_total_tokens * PROFILE.kv_bytes_per_token
    assert (cap.max_num_seqs, cap.block_size, cap.vram_total_bytes) == (256, 16, 0)
    assert cap.gpu_util is None


async def test_close_ends_open_streams() -> None:
    engine = await started(time_scale=0.05)
    stream = engine.generate(make_req(max_tokens=100_000))
    await anext(stream)
    await engine.close()
    with pytest.raises(EngineAborted):
        await collect(stream)


@pytest.mark.parametrize(("policy", "want"), [("priority", ["a", "c", "b"]),
                                              ("fcfs", ["a", "b", "c"])])
async def test_waiting_requests_start_by_priority_unless_fcfs(policy: str, want: list[str]) -> None:
    """One sequence slot: while "a" runs, "b" (low) then "c" (high) wait; under the priority
    policy "c" starts first (vLLM's --scheduling-policy priority), under fcfs "b"."""
    engine = SimEngine(replace(PROFILE, max_num_seqs=1), time_scale=0.01, seed=1,
                       scheduling_policy=policy)  # type: ignore[arg-type]  # parametrized
    await engine.start()
    finished: list[str] = []

    async def run(name: str, priority: int, max_tokens: int) -> None:
        await collect(engine.generate(make_req(name, max_tokens=max_tokens, priority=priority)))
        finished.append(name)

    try:
        first = asyncio.create_task(run("a", 1, 2000))
        while engine.capacity().running == 0:
            await asyncio.sleep(0.001)
        low = asyncio.create_task(run("b", 2, 5))
        await asyncio.sleep(0.005)
        high = asyncio.create_task(run("c", 0, 5))
        await asyncio.wait_for(asyncio.gather(first, low, high), timeout=30)
    finally:
        await engine.close()
    assert finished == want


async def test_a_failed_driver_fails_running_and_new_requests_at_once() -> None:
    # A bug in the core (stood in for by a step that raises) must not leave anyone waiting:
    # what runs fails worker_lost, and so does anything submitted afterwards.
    engine = await started(time_scale=0.01)
    try:
        def broken_step(start: float) -> object:
            raise RuntimeError("core bug")

        engine._core.step = broken_step  # type: ignore[method-assign,assignment]
        with pytest.raises(EngineError) as running:
            await asyncio.wait_for(collect(engine.generate(make_req("a"))), 5)
        assert running.value.code == "worker_lost"
        assert engine._driver is not None
        await asyncio.wait_for(asyncio.gather(engine._driver, return_exceptions=True), 5)
        with pytest.raises(EngineError) as later:
            await asyncio.wait_for(collect(engine.generate(make_req("b"))), 5)
        assert later.value.code == "worker_lost" and "not running" in later.value.message
    finally:
        await engine.close()


async def test_a_dead_engine_reports_no_free_kv() -> None:
    """Fail closed: once the driver died, capacity says so and offers no KV, so the
    scheduler places nothing more here (each such request would end worker_lost)."""
    engine = await started(time_scale=0.01)
    try:
        assert engine.capacity().alive
        assert engine.capacity().kv_free_tokens == engine.capacity().kv_total_tokens

        def broken_step(start: float) -> object:
            raise RuntimeError("core bug")

        engine._core.step = broken_step  # type: ignore[method-assign,assignment]
        with pytest.raises(EngineError):
            await asyncio.wait_for(collect(engine.generate(make_req("a"))), 5)
        assert engine._driver is not None
        await asyncio.wait_for(asyncio.gather(engine._driver, return_exceptions=True), 5)
        cap = engine.capacity()
        assert not cap.alive
        assert (cap.kv_free_tokens, cap.kv_free_bytes) == (0, 0)
        assert cap.kv_total_tokens == PROFILE.num_blocks * PROFILE.block_size
    finally:
        await engine.close()
