"""The worker app's own watches, without a broker: a dead engine stops the worker, and a
drain waits for the record being handled.

The worker is built as ``python -m services.worker`` builds it; the Kafka side is not
started, so only the tasks under test run. The full loop runs against a real broker in
tests/integration/test_worker_kafka.py and test_ops_drain.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from services.worker.__main__ import build
from services.worker.app import Worker
from services.worker.engines.base import EngineError, GenerateRequest
from services.worker.engines.sim.engine import SimEngine


def _worker(**overrides: Any) -> Worker:
    return build({"slot": 0, "worker_id": "w0", "time_scale": 0.01, **overrides})


async def _stop(worker: Worker) -> None:
    for task in worker._tasks:
        task.cancel()
    await asyncio.gather(*worker._tasks, return_exceptions=True)
    await worker.engine.close()


async def test_a_dead_engine_stops_the_worker_with_an_error() -> None:
    worker = _worker(heartbeat_interval_s=0.05)
    engine = worker.engine
    assert isinstance(engine, SimEngine)
    await engine.start()
    worker._spawn(worker._engine_watch())
    try:
        await asyncio.sleep(0.2)
        assert not worker._done.is_set()  # a live engine: nothing happens

        def broken_step(start: float) -> object:
            raise RuntimeError("core bug")

        engine._core.step = broken_step  # type: ignore[method-assign,assignment]
        request = GenerateRequest(request_id="r1", model="m", max_tokens=4, prompt_tokens=8)
        try:
            async for _ in engine.generate(request):
                pass
        except EngineError:
            pass  # the request ends worker_lost; the engine is dead now
        await asyncio.wait_for(worker._done.wait(), 5.0)
        assert worker._hard_stop  # run() returns 1: the scheduler declares the worker lost
    finally:
        await _stop(worker)


class _HoldingGuard:
    """Stand-in for the worker's ``Guard``: holds each record's handling until released,
    as a slow answer to a cancelled request or a held lease does."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def run(self, record: Any, handler: Callable[[], Awaitable[Any]]) -> str:
        await self.release.wait()
        return "finished"


async def test_a_drain_waits_for_the_record_being_handled() -> None:
    worker = _worker(drain_quiet_s=0.05)
    guard = _HoldingGuard()
    worker._guard = guard  # type: ignore[assignment]  # stand-in, see _HoldingGuard
    worker.draining = True
    worker._draining_acked_at = time.monotonic() - 10.0  # the draining beat is long known
    handling = asyncio.create_task(worker._on_record(SimpleNamespace(offset=0)))
    worker._spawn(worker._drain_watch())
    try:
        await asyncio.sleep(0.3)  # far past drain_quiet_s since the record arrived
        assert not worker._done.is_set()
        guard.release.set()
        await handling
        await asyncio.wait_for(worker._done.wait(), 2.0)
        assert not worker._hard_stop
    finally:
        await _stop(worker)
