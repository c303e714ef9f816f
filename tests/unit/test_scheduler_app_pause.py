"""The dispatch loop's pause between cycles (``Scheduler._pause``), with the Faust app and
the log reader as stand-ins.

With several replicas a worker's turn opens for placement only with a log read answered a
guard into it (filter ``replica-turn``). A request waiting for that turn is placed at the
first cycle after such a read: the pause ends at a newer read instead of waiting for its
timer, which added up to ``dispatch_interval_s`` to the request's wait (measured with
``scripts/bench/replica_placement.py``). Alone, or with nothing pending, the pause is the
timer or a wake-up, as before: no cycle per read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest

from services.common.log_reader import LogReader
from services.common.settings import Settings
from services.scheduler.app import Scheduler, SchedulerRuntime
from services.scheduler.runtime.topics import SchedulerTopics
from services.scheduler.settings import SchedulerSettings
from tests.unit.test_scheduler_app_barrier import _event

T = 1_700_000_000.0
INTERVAL_S = 3.0  # the timer: far longer than any pause these tests expect to end early


def _scheduler(replicas: int, reads: list[float]) -> Scheduler:
    """A replica of ``replicas`` whose log reader reports ``reads[-1]`` as read."""
    settings = Settings()
    rt = SchedulerRuntime(settings, SchedulerSettings(replicas=replicas,
                                                      dispatch_interval_s=INTERVAL_S),
                          SchedulerTopics.of(settings.topic_prefix), clock=lambda: T)
    scheduler = Scheduler(rt, SimpleNamespace())  # type: ignore[arg-type]
    scheduler.reader.caught_up_at = lambda topic: reads[-1]  # type: ignore[method-assign]

    async def caught_up(topics: set[str], timeout_s: float) -> bool:
        return True

    async def no_flush() -> None: ...

    scheduler.reader.barrier = caught_up  # type: ignore[method-assign]

    scheduler._flush = no_flush  # type: ignore[method-assign]
    return scheduler


async def _pending(scheduler: Scheduler) -> None:
    event, tp = _event(scheduler)
    await scheduler.on_assigned(None, {tp}, signal=None)
    await scheduler.on_request_event(event)
    assert len(scheduler.state.pending) == 1
    scheduler.wake.clear()  # the arrival's wake-up: the next cycle would place it


async def _timed_pause(scheduler: Scheduler, read_at: float, reads: list[float],
                       newer_after_s: float) -> float:
    """How long ``_pause(read_at)`` takes when the reader reads ``read_at + 1`` after
    ``newer_after_s``."""

    async def newer_read() -> None:
        await asyncio.sleep(newer_after_s)
        reads.append(read_at + 1.0)

    began = time.monotonic()
    reader = asyncio.create_task(newer_read())
    await scheduler._pause(read_at)
    took = time.monotonic() - began
    reader.cancel()
    return took


async def test_with_replicas_a_newer_log_read_ends_the_pause() -> None:
    reads = [T]
    scheduler = _scheduler(2, reads)
    await _pending(scheduler)
    took = await _timed_pause(scheduler, T, reads, newer_after_s=0.1)
    assert 0.1 <= took < INTERVAL_S / 2, took


async def test_with_replicas_a_read_already_newer_ends_it_at_once() -> None:
    reads = [T + 1.0]
    scheduler = _scheduler(2, reads)
    await _pending(scheduler)
    took = await _timed_pause(scheduler, T, reads, newer_after_s=10.0)
    assert took < INTERVAL_S / 2, took


async def test_with_replicas_a_wake_still_ends_it() -> None:
    reads = [T]
    scheduler = _scheduler(2, reads)
    await _pending(scheduler)
    asyncio.get_running_loop().call_later(0.1, scheduler.wake.set)
    took = await _timed_pause(scheduler, T, reads, newer_after_s=10.0)
    assert 0.1 <= took < INTERVAL_S / 2, took


async def test_with_nothing_pending_a_newer_read_does_not_end_it() -> None:
    reads = [T]
    scheduler = _scheduler(2, reads)
    took = await _timed_pause(scheduler, T, reads, newer_after_s=0.1)
    assert took >= INTERVAL_S * 0.9, took


async def test_alone_a_newer_read_does_not_end_it() -> None:
    reads = [T]
    scheduler = _scheduler(1, reads)
    await _pending(scheduler)
    took = await _timed_pause(scheduler, T, reads, newer_after_s=0.1)
    assert took >= INTERVAL_S * 0.9, took


async def test_with_the_reader_behind_it_waits_for_its_batch_not_polling() -> None:
    # A reader behind reports 0.0 until its batch is handled, and that batch wakes the
    # loop (on_batch): looking for a newer read every 5 ms meanwhile would be spent work.
    reads = [0.0]
    scheduler = _scheduler(2, reads)
    asked: list[str] = []
    scheduler.reader.caught_up_at = (  # type: ignore[method-assign]
        lambda topic: asked.append(topic) or reads[-1])
    await _pending(scheduler)
    asyncio.get_running_loop().call_later(0.5, scheduler.wake.set)
    began = time.monotonic()
    await scheduler._pause(0.0)
    assert 0.5 <= time.monotonic() - began < INTERVAL_S / 2
    assert len(asked) <= 3, len(asked)


async def test_a_stop_as_a_wake_up_comes_still_stops_the_pause() -> None:
    # The cancel and the wake-up in one turn of the loop: Python 3.11's wait_for returned
    # the wake-up and dropped the cancel, so the dispatch loop ran on past its stop (a CI
    # run: "task scheduler-dispatch did not end within 10 s of its cancel", exit 1).
    scheduler = _scheduler(1, [T])
    pause = asyncio.create_task(scheduler._pause(T))
    await asyncio.sleep(0)  # waiting for the wake-up
    scheduler.wake.set()
    pause.cancel()
    done, _ = await asyncio.wait((pause,), timeout=1.0)
    assert done and pause.cancelled()


async def test_a_stop_ends_the_dispatch_loop_even_if_a_wait_drops_its_cancel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A cycle whose wait drops the cancel, as Python 3.11's wait_for does when the wait
    # ends at that moment (aiokafka's sends use it): the loop ran on, and the stop waited
    # its 10 s for the task and exited 1.
    scheduler = _scheduler(1, [T])
    monkeypatch.setattr(LogReader, "running", property(lambda self: True))
    in_cycle = asyncio.Event()

    async def cycle(now: float, read_at: float) -> None:
        in_cycle.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.05)

    scheduler._cycle = cycle  # type: ignore[method-assign]
    scheduler._publish_status = lambda now: None  # type: ignore[method-assign]
    loop = asyncio.create_task(scheduler._dispatch_loop())
    scheduler.wake.set()
    await asyncio.wait_for(in_cycle.wait(), 1.0)
    scheduler.request_stop()
    loop.cancel()  # dropped by the cycle
    done, _ = await asyncio.wait((loop,), timeout=1.0)
    assert done, "the dispatch loop ran on past its stop"
