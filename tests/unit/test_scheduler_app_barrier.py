"""The request agent's catch-up after a rebalance (``Scheduler.on_request_event``), with
the Faust app and the log reader as stand-ins: a failing read of the log's end does not
lose the record that waited for it, and a record that waited through another rebalance
is left to its partition's owner."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition

from schemas.codec import encode
from services.common.settings import Settings
from services.scheduler.app import Scheduler, SchedulerRuntime
from services.scheduler.runtime.topics import SchedulerTopics
from services.scheduler.settings import SchedulerSettings
from tests.builders_schemas import make_admitted, make_heartbeat, make_request

T = 1_700_000_000.0


def _scheduler(barrier: Callable[[set[str], float], Awaitable[bool]],
               **options: Any) -> Scheduler:
    settings = Settings()
    rt = SchedulerRuntime(settings, SchedulerSettings(**{"catchup_timeout_s": 2.0,
                                                         "replicas": 1, **options}),
                          SchedulerTopics.of(settings.topic_prefix), clock=lambda: T)
    scheduler = Scheduler(rt, SimpleNamespace())  # type: ignore[arg-type]
    scheduler.reader.barrier = barrier  # type: ignore[method-assign]

    async def no_flush() -> None: ...

    scheduler._flush = no_flush  # type: ignore[method-assign]
    return scheduler


def _event(scheduler: Scheduler) -> tuple[Any, TopicPartition]:
    topic = scheduler.rt.topics.request_names[3]
    tp = TopicPartition(topic, 0)
    request = make_request(request_id="r1", tenant="acme", model="m", max_tokens=10,
                           timeout_s=600, created_at=T, prefix_hash=None)
    admitted = make_admitted(request=request, priority="normal", lane="short",
                             prompt_tokens=10, reply_topic="llmq.replies.acme", admitted_at=T)
    message = SimpleNamespace(tp=tp, offset=5, value=encode(admitted), key=b"r1", headers=[],
                              topic=topic, partition=0)
    return SimpleNamespace(message=message, ack=lambda: None), tp


async def test_a_failing_catch_up_is_tried_again_and_the_record_kept() -> None:
    # end_offsets raising (the broker away after the rebalance) escaped the agent before
    # the record was tracked: faust restarted the agent without it, later acks committed
    # past it, and the barrier was skipped for the rest of the generation.
    calls: list[str] = []

    async def barrier(topics: set[str], timeout_s: float) -> bool:
        calls.append("barrier")
        if len(calls) < 3:
            raise RuntimeError("KafkaTimeoutError: end_offsets")
        return True

    scheduler = _scheduler(barrier)
    event, tp = _event(scheduler)
    await scheduler.on_assigned(None, {tp}, signal=None)
    await scheduler.on_request_event(event)
    assert calls == ["barrier"] * 3 and not scheduler._barrier_needed
    assert scheduler.state.tracked() == 1 and scheduler.acks.outstanding(tp) == 1


async def test_a_record_that_waited_through_a_revocation_is_left_to_the_new_owner() -> None:
    gate = asyncio.Event()

    async def barrier(topics: set[str], timeout_s: float) -> bool:
        await gate.wait()
        return True

    scheduler = _scheduler(barrier)
    event, tp = _event(scheduler)
    await scheduler.on_assigned(None, {tp}, signal=None)
    waiting = asyncio.create_task(scheduler.on_request_event(event))
    await asyncio.sleep(0.01)
    await scheduler.on_revoked(None, {tp}, signal=None)  # the partition goes elsewhere
    await scheduler.on_assigned(None, set(), signal=None)
    gate.set()
    await waiting
    assert scheduler.state.tracked() == 0  # not queued here: its new owner reads it again
    assert scheduler.acks.next_offset(tp) is None


async def test_a_placement_that_did_not_get_out_before_a_revoke_is_taken_back() -> None:
    # A broker in trouble during a rebalance: the placement was decided, never sent. Sent
    # later, it would land after the new owner read the log without it and placed the
    # request too: the request run twice. Now it is taken back, and should the partition
    # come back here, its redelivered record is placed afresh (not acked as done).
    async def caught_up(topics: set[str], timeout_s: float) -> bool:
        return True

    scheduler = _scheduler(caught_up)  # its flush sends nothing: the broker is away
    state = scheduler.state
    state.observe_heartbeat(make_heartbeat(
        worker_id="w0", partition=0, model="m", model_version=None, pool="any",
        kv_total_tokens=10_000, kv_free_tokens=10_000, kv_total_bytes=10_000,
        kv_free_bytes=10_000, block_size=16, running=0, waiting=0, max_num_seqs=8,
        draining=False, interval_s=1.0, started_at=T - 100, seq=1, ts=T))
    state.restore()
    event, tp = _event(scheduler)
    await scheduler.on_assigned(None, {tp}, signal=None)
    await scheduler.on_request_event(event)
    scheduler.outbox.submit(state.tick(T).effects)
    assert state.log.status("r1") == "active" and state.reserved_kv("w0") > 0
    await scheduler.on_revoked(None, {tp}, signal=None)
    assert len(scheduler.outbox) == 0  # nothing of it goes out later
    assert (state.log.status("r1"), state.reserved_kv("w0")) == ("unknown", 0)
    await scheduler.on_assigned(None, {tp}, signal=None)  # the partition comes back
    await scheduler.on_request_event(event)
    assert state.tracked() == 1  # queued again, its record held: not acked and skipped
    assert scheduler.acks.outstanding(tp) == 1


def test_one_of_several_replicas_places_only_once_its_log_is_read_up_to_the_turn() -> None:
    async def caught_up(topics: set[str], timeout_s: float) -> bool:
        return True

    scheduler = _scheduler(caught_up)
    read_up_to = [0.0]
    scheduler.reader.caught_up_at = lambda topic: read_up_to[0]  # type: ignore[method-assign]
    assert scheduler._log_read_at() == math.inf  # alone: its own ledger is the truth
    scheduler.state.turns = (2, 0)
    assert scheduler._log_read_at() == 0.0  # not read to the end: no turn may be used
    read_up_to[0] = T + 0.55
    assert scheduler._log_read_at() == T + 0.55  # the filter compares each worker's turn


async def test_a_stop_is_bounded_and_names_a_task_that_ignores_its_cancel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A replica's graceful stop once went past the 45 s a test gave it, and nothing said
    # where it waited: every wait of the stop is bounded now, and a task still running
    # after its cancel is named, with the place it waits in.
    scheduler = _scheduler(lambda topics, timeout_s: asyncio.sleep(0, True),
                           send_timeout_s=0.3)

    async def deaf() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # what a library call that swallows a cancel does

    scheduler._main_task = asyncio.create_task(deaf(), name="scheduler-dispatch")
    await asyncio.sleep(0)
    caplog.set_level(logging.INFO, logger="services.scheduler")
    start = time.monotonic()
    await asyncio.wait_for(scheduler.stop(), 5)
    assert time.monotonic() - start < 2
    (warning,) = [r.getMessage() for r in caplog.records if "did not end" in r.getMessage()]
    assert "scheduler-dispatch" in warning and "in deaf" in warning
    assert any("stopped in" in r.getMessage() for r in caplog.records)
    scheduler._main_task.get_coro().close()  # type: ignore[union-attr]


async def test_an_older_read_of_the_turns_answering_last_is_not_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rebalance starts a read of the group's members, and the one before is not
    cancelled: the read of the first rebalance (this replica alone) answering after the
    read of the second (two replicas) set the turns back to alone until the next read,
    30 s later, while the other replica placed in turns."""
    import services.scheduler.app as app

    class Admin:
        def __init__(self, **kwargs: Any) -> None: ...
        async def start(self) -> None: ...
        async def close(self) -> None: ...

    answers = [asyncio.get_running_loop().create_future() for _ in range(2)]
    asked = iter(answers)

    async def members(admin: Any, group: str, timeout_s: float) -> list[Any]:
        return list(await next(asked))

    monkeypatch.setattr(app, "AIOKafkaAdminClient", Admin)
    monkeypatch.setattr(app, "group_members", members)
    scheduler = _scheduler(lambda topics, timeout_s: asyncio.sleep(0, True), replicas=None,
                           scheduler_id="scheduler-a")
    first = asyncio.ensure_future(scheduler._read_turns())
    second = asyncio.ensure_future(scheduler._read_turns())
    await asyncio.sleep(0)
    answers[1].set_result([SimpleNamespace(client_id=c) for c in ("scheduler-a", "scheduler-b")])
    await second
    assert scheduler.state.turns == (2, 0)
    answers[0].set_result([SimpleNamespace(client_id="scheduler-a")])
    await first
    assert scheduler.state.turns == (2, 0)


@pytest.mark.parametrize(("before", "after", "generations", "continued"), [
    (True, True, 1, True), (True, False, 1, False), (False, True, 1, False),
    (True, True, 2, False)])
async def test_leadership_held_through_a_rebalance_is_told_to_the_state(
        before: bool, after: bool, generations: int, continued: bool) -> None:
    """Faust's leader is the owner of one partition: held when revoked and assigned again
    in the next generation, nobody else led in between (found by a review: each rebalance
    started another takeover). A generation skipped: this replica was out of the group
    meanwhile, and another may have led."""
    scheduler = _scheduler(lambda topics, timeout_s: asyncio.sleep(0, True))
    app: Any = scheduler.app
    leader = TopicPartition(f"{scheduler.rt.app_id}-__assignor-__leader", 0)
    _, tp = _event(scheduler)
    app.consumer_generation_id = 7
    await scheduler.on_assigned(None, {tp, leader} if before else {tp}, signal=None)
    assert not scheduler.state._continued  # the first assignment: a start
    await scheduler.on_revoked(None, {tp, leader} if before else {tp}, signal=None)
    app.consumer_generation_id = 7 + generations
    await scheduler.on_assigned(None, {tp, leader} if after else {tp}, signal=None)
    assert scheduler.state._continued is continued


async def test_a_continued_leadership_is_not_remembered_past_the_next_rebalance() -> None:
    """Found by an audit: the flag set when leadership continued into generation 8 was
    left set when the next rebalance came before a leading tick and another replica led;
    leading again later, genuinely anew, this replica skipped the takeover wait. And a
    replica whose leader partition was revoked counted as leading until a tick said not."""
    scheduler = _scheduler(lambda topics, timeout_s: asyncio.sleep(0, True))
    app: Any = scheduler.app
    leader = TopicPartition(f"{scheduler.rt.app_id}-__assignor-__leader", 0)
    _, tp = _event(scheduler)
    state = scheduler.state
    app.consumer_generation_id = 7
    await scheduler.on_assigned(None, {tp, leader}, signal=None)
    state.tick(scheduler.clock())  # leads
    assert state.leading
    await scheduler.on_revoked(None, {tp, leader}, signal=None)
    assert not state.leading  # revoked: it leads no more until assigned again
    app.consumer_generation_id = 8
    await scheduler.on_assigned(None, {tp, leader}, signal=None)
    assert state._continued  # held through: no takeover wait
    await scheduler.on_revoked(None, {tp, leader}, signal=None)  # no tick in between
    app.consumer_generation_id = 9
    await scheduler.on_assigned(None, {tp}, signal=None)  # another replica leads now
    assert not state._continued


async def test_a_tick_during_a_rebalance_does_not_restart_a_continued_leaders_wait() -> None:
    """Found by a review of c21e40e: faust answers is_leader() from the old assignment
    until the new one, so a dispatch tick between the revoke of the leader partition and
    the next assignment still led, after leadership_lapsed, and restarted the takeover
    wait of a leadership that then continued (lost workers held 15 s at every rebalance)."""
    scheduler = _scheduler(lambda topics, timeout_s: asyncio.sleep(0, True))
    app: Any = scheduler.app
    app.is_leader = lambda: True  # faust's answer all along: the old assignment holds
    app.consumer = SimpleNamespace(assignment=set)  # nothing to pause
    leader = TopicPartition(f"{scheduler.rt.app_id}-__assignor-__leader", 0)
    _, tp = _event(scheduler)
    state = scheduler.state
    app.consumer_generation_id = 7
    await scheduler.on_assigned(None, {tp, leader}, signal=None)
    await scheduler._cycle(T, math.inf)
    since = state._leading_since
    await scheduler.on_revoked(None, {tp, leader}, signal=None)
    await scheduler._cycle(T + 5, math.inf)  # mid-rebalance
    assert not state.leading
    app.consumer_generation_id = 8
    await scheduler.on_assigned(None, {tp, leader}, signal=None)
    await scheduler._cycle(T + 6, math.inf)
    assert state.leading and state._leading_since == since  # continued: no new wait
