"""``llmq drain WORKER``: ask a worker to drain, and optionally wait until it has.

:func:`request_drain` reads ``llmq.heartbeats`` to its end (a worker never heard of is an
error: :class:`~services.ops.errors.UnknownWorker`), produces one ``DrainWorker`` on
``llmq.control`` keyed by the worker id (idempotent producer, acks=all; repeating the
command is harmless), and with ``wait`` follows the worker's heartbeats with
:class:`~services.ops.drain_progress.DrainProgress` until it stopped or ``timeout_s``
passed, calling ``on_progress`` whenever the phase or the in-flight count changes.

A worker already ``gone`` (tombstoned, or drained and silent) gets no command: there is
nothing to drain, and a restarted worker reads ``llmq.control`` from its end anyway.
A worker that is ``stale`` does get it (it may come back), but waiting ends at once with
``lost``: nothing says it drained.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka.errors import KafkaError

from schemas.codec import encode
from schemas.control import DrainWorker
from schemas.topics import message_key
from services.common.kafka import broker_answers, make_producer
from services.health.core import HealthPolicy, worker_state
from services.health.fleet import FleetFeed, FleetTracker
from services.ops.drain_progress import DrainProgress, DrainUpdate
from services.ops.errors import KafkaUnavailable, UnknownWorker

DrainOutcome = Literal["requested", "drained", "lost", "timeout", "already_gone"]

ProgressCallback = Callable[[DrainUpdate], None]


@dataclass(frozen=True, slots=True)
class DrainResult:
    """What ``request_drain`` achieved. ``ok``: the command did what was asked."""

    worker_id: str
    outcome: DrainOutcome
    #: A DrainWorker command was produced.
    sent: bool
    #: In flight on the last heartbeat read (None: no heartbeat).
    running: int | None
    waiting: int | None
    elapsed_s: float
    message: str

    @property
    def ok(self) -> bool:
        return self.outcome in ("requested", "drained", "already_gone")

    def as_dict(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "outcome": self.outcome, "ok": self.ok,
                "sent": self.sent, "running": self.running, "waiting": self.waiting,
                "elapsed_s": round(self.elapsed_s, 3), "message": self.message}


async def request_drain(
    bootstrap: str,
    prefix: str,
    worker_id: str,
    reason: str,
    wait: bool,
    timeout_s: float,
    *,
    on_progress: ProgressCallback | None = None,
    issued_by: str = "cli",
    policy: HealthPolicy | None = None,
    read_timeout_s: float = 15.0,
    clock: Callable[[], float] = time.time,
) -> DrainResult:
    """Drain ``worker_id`` (see the module docstring).

    Raises :class:`UnknownWorker` when no heartbeat of it was ever read,
    :class:`KafkaUnavailable` when the broker does not answer, and ValueError (before
    anything is read or sent) when ``timeout_s`` is not a positive finite number.
    """
    if not 0 < timeout_s < math.inf:  # nan fails too: it would never time out
        raise ValueError(f"timeout_s must be a positive number of seconds, not {timeout_s}")
    policy = policy or HealthPolicy()
    started = time.monotonic()
    if not await broker_answers(bootstrap, 3.0):
        raise KafkaUnavailable(f"no Kafka broker answers at {bootstrap}")
    tracker = FleetTracker()
    feed = FleetFeed(bootstrap, prefix, tracker, read_status=False, read_control=False)
    try:
        try:
            await feed.start(read_timeout_s)
            await feed.catch_up(read_timeout_s)
        except (KafkaError, OSError, TimeoutError) as exc:
            raise KafkaUnavailable(f"cannot read {feed.heartbeats_topic}: {exc!r}") from exc
        rec = tracker.record(worker_id)
        if rec is None and not tracker.tombstoned(worker_id):
            raise UnknownWorker(
                f"unknown worker {worker_id!r}: no heartbeat on {feed.heartbeats_topic} "
                "(`llmq status` lists the workers)"
            )
        if rec is None or worker_state(rec, clock(), policy) == "gone":
            running = None if rec is None else rec.heartbeat.running
            waiting = None if rec is None else rec.heartbeat.waiting
            return DrainResult(worker_id, "already_gone", False, running, waiting,
                               time.monotonic() - started,
                               f"{worker_id} is already gone; nothing to drain")
        cmd = DrainWorker(worker_id=worker_id, reason=reason, issued_by=issued_by,
                          issued_at=clock())
        await _send(bootstrap, f"{prefix}.control", cmd)
        hb = rec.heartbeat
        if not wait:
            return DrainResult(worker_id, "requested", True, hb.running, hb.waiting,
                               time.monotonic() - started,
                               f"drain requested for {worker_id}")
        return await _follow(feed, tracker, DrainProgress(hb, policy), started, timeout_s,
                             on_progress, clock)
    finally:
        await feed.stop()


async def _send(bootstrap: str, topic: str, cmd: DrainWorker) -> None:
    producer = make_producer(bootstrap)
    try:
        await producer.start()
        await producer.send_and_wait(topic, encode(cmd), key=message_key(cmd))
    except (KafkaError, OSError, TimeoutError) as exc:
        raise KafkaUnavailable(f"cannot send the drain command to {topic}: {exc!r}") from exc
    finally:
        await producer.stop()


async def _follow(
    feed: FleetFeed,
    tracker: FleetTracker,
    progress: DrainProgress,
    started: float,
    timeout_s: float,
    on_progress: ProgressCallback | None,
    clock: Callable[[], float],
) -> DrainResult:
    worker_id = progress.worker_id
    deadline = time.monotonic() + timeout_s
    last: DrainUpdate | None = None
    tracker.subscribe(progress.observe)  # every beat of it, not only the newest per poll
    while True:
        now = clock()
        update = progress.update(now)
        if on_progress is not None and (
            last is None or (update.phase, update.running, update.waiting)
            != (last.phase, last.running, last.waiting)
        ):
            on_progress(update)
        last = update
        outcome = progress.outcome(now)
        hb = progress.last
        elapsed = time.monotonic() - started
        if outcome == "drained":
            return DrainResult(worker_id, "drained", True, hb.running, hb.waiting, elapsed,
                               f"{worker_id} drained and stopped")
        if outcome == "lost":
            return DrainResult(
                worker_id, "lost", True, hb.running, hb.waiting, elapsed,
                f"{worker_id} stopped without draining cleanly ({hb.running} running, "
                f"{hb.waiting} waiting on its last heartbeat, {update.age_s:.1f}s ago)",
            )
        if time.monotonic() >= deadline:
            return DrainResult(
                worker_id, "timeout", True, hb.running, hb.waiting, elapsed,
                f"{worker_id} still {update.phase} after {timeout_s:g}s "
                f"({hb.running} running, {hb.waiting} waiting); the drain goes on",
            )
        try:
            await feed.poll(timeout_ms=200)
        except KafkaError:
            # Keep following: a broker hiccup is not the worker's fault; the deadline bounds it.
            await asyncio.sleep(0.2)
            continue
        if tracker.tombstoned(worker_id):
            progress.observe_tombstone()
