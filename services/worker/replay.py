"""After a restart: which of the slot's uncommitted assignments were already ended elsewhere.

A worker commits an assignment's offset only once its terminal is acknowledged, so a worker
killed mid-stream leaves its assignments uncommitted and its successor (same slot, same
worker id) reads them again. If the old process was down long enough for the scheduler to
declare it lost, the scheduler has already ended each of those attempts: ``worker_lost``
for one that streamed (a terminal event), a new attempt for one that had not (an
assignment with a higher attempt). Running them again would give the client a second
terminal for the same attempt, and use KV the scheduler has given to others.

Fencing settles this for every assignment a current scheduler writes: each is stamped with
the ``started_at`` of the worker process it was placed on, a new process drops those
stamped for another, and the scheduler, once it sees the new process's heartbeat, requeues
or ends whatever was placed on the old one (``services.scheduler.core.recovery``) — one
terminal whatever the timing. What follows is for unstamped assignments (written by a
scheduler from before the stamp), where only timing separated the two outcomes.

So, before it consumes, a worker with unstamped records to replay reads them (its
partition from the committed offset to the end), then reads ``llmq.events`` and
``llmq.assignments`` to their current end, and returns the replayed ``(request_id,
attempt)`` pairs that already ended or were superseded; the worker drops those. Only the
replayed request ids are kept, so memory is bounded by the replay, not by the topics. A
worker that restarts before the scheduler noticed (its new heartbeat arrives in time) finds
nothing and runs them, which is then the only run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from aiokafka import TopicPartition

from schemas.codec import SchemaError, decode
from schemas.messages import ASSIGNMENT_ADAPTER, EVENT_ADAPTER
from schemas.workers import EventAborted, EventDone, EventFailed, EventPrefilled
from services.common.guard import Guard
from services.common.kafka import make_consumer
from services.common.log_reader import LogReader

_log = logging.getLogger(__name__)

Attempt = tuple[str, int]


async def replayed_attempts(
    bootstrap: str, tp: TopicPartition, start: int | None, skip: Iterable[int],
    timeout_s: float = 60.0,
) -> list[Attempt]:
    """``(request_id, attempt)`` of the assignments in ``tp`` from ``start`` (None: the
    beginning) to its current end, except the offsets in ``skip`` (finished already).
    TimeoutError if that is not read within ``timeout_s``."""
    return await asyncio.wait_for(_replayed(bootstrap, tp, start, set(skip)), timeout_s)


async def _replayed(
    bootstrap: str, tp: TopicPartition, start: int | None, skipped: set[int]
) -> list[Attempt]:
    consumer = make_consumer(bootstrap)
    await consumer.start()
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        if start is None:
            await consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, start)
        found: list[Attempt] = []
        while await consumer.position(tp) < end:
            batches = await consumer.getmany(tp, timeout_ms=500)
            for record in batches.get(tp, []):
                if record.offset >= end:
                    break
                if record.offset in skipped:
                    continue
                try:
                    a = decode(record.value, ASSIGNMENT_ADAPTER)
                except SchemaError:
                    continue  # the consume loop dead-letters it
                if a.worker_started_at is None:  # stamped ones are fenced (module doc)
                    found.append((a.request_id, a.attempt))
        return found
    finally:
        await consumer.stop()


async def already_ended(
    bootstrap: str, events_topic: str, assignments_topic: str, replayed: Iterable[Attempt],
    guard: Guard, timeout_s: float = 60.0,
) -> set[Attempt]:
    """The ``replayed`` attempts that have a terminal event, an ``event.prefilled`` (a
    prefill stage's end on its worker) or a later attempt."""
    replayed = list(replayed)
    wanted = {rid for rid, _ in replayed}
    if not wanted:
        return set()
    ended: set[Attempt] = set()
    latest: dict[str, int] = {}

    def on_event(record: Any) -> None:
        event = decode(record.value, EVENT_ADAPTER)
        if event.request_id in wanted and isinstance(
                event, EventDone | EventFailed | EventAborted | EventPrefilled):
            ended.add((event.request_id, event.attempt))

    def on_assignment(record: Any) -> None:
        a = decode(record.value, ASSIGNMENT_ADAPTER)
        if a.request_id in wanted:
            latest[a.request_id] = max(latest.get(a.request_id, 0), a.attempt)

    reader = LogReader(bootstrap, {events_topic: on_event, assignments_topic: on_assignment},
                       guard, poll_ms=100, name="worker-replay-check")
    await reader.start()
    try:
        await asyncio.wait_for(reader.caught_up.wait(), timeout_s)
    finally:
        await reader.stop()
    superseded = {(rid, a) for rid, a in replayed if latest.get(rid, a) > a}
    return {pair for pair in replayed if pair in ended} | superseded
