"""The scheduler service against the real broker, as a real subprocess.

The test plays ingest (it produces ``AdmittedRequest``s on the request topics and cancels on
the control topic) and the workers: :class:`FakeWorker` is a **fake** of services/worker —
it heartbeats with a given pool/KV/partition, reads the assignments of its partition and
answers with ``event.started`` / ``event.first_token`` / ``event.done`` (no engine, no
replies). Everything the scheduler writes is read back by :class:`Observer`. Each test
uses a unique topic prefix and a small number of worker slots; all traffic is on
127.0.0.1.

The harness (``SchedulerProcess``, ``Observer``, ``FakeWorker``) is shared with
``test_scheduler_restart.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas.codec import decode, encode
from schemas.common import Lane, Pool, Priority
from schemas.control import CancelRequest, LeaseAnswer
from schemas.messages import (
    ASSIGNMENT_ADAPTER,
    CONTROL_ADAPTER,
    EVENT_ADAPTER,
    REPLY_ADAPTER,
    STATUS_ADAPTER,
)
from schemas.replies import Error, Usage
from schemas.requests import AdmittedRequest, Assignment
from schemas.status import QueueStatus
from schemas.topics import (
    DEADLETTER_FIELD_HEADER,
    DEADLETTER_REASON_HEADER,
    catalog,
    reply_spec,
    reply_topic,
    request_topic,
)
from schemas.workers import (
    EventAborted,
    EventDone,
    EventFailed,
    EventFirstToken,
    EventStarted,
    LifecycleEvent,
)
from services.common.kafka import (
    TopicRequest,
    ensure_topics,
    key_partition,
    make_consumer,
    make_producer,
)
from services.common.replies import topic_partitions
from tests.builders_schemas import (
    make_admitted,
    make_done,
    make_error,
    make_heartbeat,
    make_request,
)
from tests.fakes import sender_fault

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-3.1-8b"
TENANT = "acme"
SCHEDULER_ID = "sched-test"
SLOTS = 4
HEARTBEAT_S = 0.4  # fake workers' interval: dead after 3 x 0.4 s


# -- the real scheduler process ---------------------------------------------------------


@dataclass
class SchedulerProcess:
    """``python -m services.scheduler`` in a subprocess; its output goes to ``log_path``."""

    prefix: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    _ready_seen: int = 0

    def start(self) -> None:
        env = {
            **os.environ,
            "LLMQ_TOPIC_PREFIX": self.prefix,
            "LLMQ_ASSIGNMENT_PARTITIONS": str(SLOTS),
            "LLMQ_SCHEDULER_SCHEDULER_ID": SCHEDULER_ID,
            "LLMQ_SCHEDULER_SEED": "7",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        env.pop("LLMQ_METRICS_PORT", None)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.scheduler"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()

    async def wait_ready(self, timeout_s: float = 90.0) -> None:
        """Until this start's "scheduler ready" line is in the log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.tail()
            count = self._text().count("scheduler ready:")
            if count > self._ready_seen:
                self._ready_seen = count
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"scheduler not ready in {timeout_s} s:\n{self.tail()}")

    def kill(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self._text().splitlines()[-lines:])

    def _text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


# -- what the scheduler writes, read back -------------------------------------------------


@dataclass
class Observer:
    """Reads assignments, events, replies, status and dead letters from the beginning."""

    bootstrap: str
    prefix: str
    assignments: list[tuple[int, Assignment]] = field(default_factory=list)
    events: list[LifecycleEvent] = field(default_factory=list)
    replies: list[Any] = field(default_factory=list)
    statuses: list[QueueStatus] = field(default_factory=list)
    deadletters: list[Any] = field(default_factory=list)
    leases: list[LeaseAnswer] = field(default_factory=list)
    listeners: list[Callable[[int, Assignment], None]] = field(default_factory=list)
    _consumer: Any = None
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        topics = [
            f"{self.prefix}.assignments", f"{self.prefix}.events", f"{self.prefix}.status",
            f"{self.prefix}.deadletter", f"{self.prefix}.control",
            reply_topic(self.prefix, TENANT),
        ]
        tps = [TopicPartition(t, p) for t in topics for p in await topic_partitions(
            self.bootstrap, t)]
        self._consumer = make_consumer(self.bootstrap)
        await self._consumer.start()
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()

    async def _run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=50)
            for tp, records in batches.items():
                for record in records:
                    self._route(tp.topic, record)

    def _route(self, topic: str, record: Any) -> None:
        suffix = topic.removeprefix(self.prefix + ".")
        if suffix == "assignments":
            assignment = decode(record.value, ASSIGNMENT_ADAPTER)
            self.assignments.append((record.partition, assignment))
            for listener in list(self.listeners):
                listener(record.partition, assignment)
        elif suffix == "events":
            self.events.append(decode(record.value, EVENT_ADAPTER))
        elif suffix == "status":
            self.statuses.append(decode(record.value, STATUS_ADAPTER))
        elif suffix == "deadletter":
            self.deadletters.append(record)
        elif suffix == "control":
            command = decode(record.value, CONTROL_ADAPTER)
            if isinstance(command, LeaseAnswer):
                self.leases.append(command)
        else:
            self.replies.append(decode(record.value, REPLY_ADAPTER))

    # -- queries ------------------------------------------------------------------------

    def assigned(self, request_id: str) -> list[Assignment]:
        return [a for _, a in self.assignments if a.request_id == request_id]

    def errors(self, request_id: str) -> list[Error]:
        return [r for r in self.replies if isinstance(r, Error) and r.request_id == request_id]

    def terminal_events(self, request_id: str) -> list[EventFailed | EventAborted]:
        return [
            e for e in self.events
            if isinstance(e, EventFailed | EventAborted) and e.request_id == request_id
        ]

    def latest_status(self, model: str = MODEL) -> QueueStatus | None:
        mine = [s for s in self.statuses if s.model == model]
        return mine[-1] if mine else None


async def eventually(check: Callable[[], bool], timeout_s: float = 45.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


async def eventually_async(
    probe: Callable[[], Any], expected: object, timeout_s: float = 45.0, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout_s
    seen: object = None
    while time.monotonic() < deadline:
        seen = await probe()
        if seen == expected:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what} (last: {seen!r})")


async def committed(c: Cluster) -> int:
    """Request records the scheduler's group has committed, over the six topics."""
    admin = AIOKafkaAdminClient(bootstrap_servers=c.bootstrap, request_timeout_ms=5_000)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(f"{c.prefix}-scheduler")
    finally:
        await admin.close()
    return sum(meta.offset for tp, meta in offsets.items() if ".requests." in tp.topic)


# -- the FAKE worker ---------------------------------------------------------------------


@dataclass
class FakeWorker:
    """FAKE worker (test-only): heartbeats, takes its partition's assignments, answers with
    lifecycle events. ``hold``: keep every request until :meth:`finish`; otherwise finish
    each after ``run_s``. ``stream``: send ``event.first_token`` after ``started``."""

    cluster: Cluster
    worker_id: str
    partition: int
    pool: Pool = "any"
    kv_total_tokens: int = 100_000
    max_num_seqs: int = 256
    model: str = MODEL
    hold: bool = True
    run_s: float = 0.2
    stream: bool = False
    held: dict[tuple[str, int], int] = field(default_factory=dict)
    taken: list[Assignment] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    beating: bool = True
    _seq: int = 0
    _started_at: float = field(default_factory=time.time)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def usable(self) -> int:
        return int(self.kv_total_tokens * 0.95)  # the scheduler's default safety margin

    async def start(self) -> None:
        self.cluster.observer.listeners.append(self._on_assignment)
        await self.beat()
        self._tasks.append(asyncio.create_task(self._beats()))

    async def stop(self) -> None:
        self.beating = False
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(ValueError):
            self.cluster.observer.listeners.remove(self._on_assignment)

    async def beat(self, renew: bool = False) -> None:
        reserved = sum(self.held.values())
        free = max(0, self.kv_total_tokens - reserved)
        hb = make_heartbeat(
            worker_id=self.worker_id, model=self.model, model_version=None, pool=self.pool,
            partition=self.partition, kv_total_tokens=self.kv_total_tokens,
            kv_free_tokens=free, kv_total_bytes=self.kv_total_tokens * 1024,
            kv_free_bytes=free * 1024, running=len(self.held), waiting=0,
            max_num_seqs=self.max_num_seqs, draining=False, interval_s=HEARTBEAT_S,
            started_at=self._started_at, seq=self._seq, ts=time.time(), renew=renew,
        )
        self._seq += 1
        await self.cluster.produce(f"{self.cluster.prefix}.heartbeats", encode(hb),
                                   self.worker_id.encode())

    async def _beats(self) -> None:
        while self.beating:
            await asyncio.sleep(HEARTBEAT_S)
            if self.beating:
                await self.beat()

    def _on_assignment(self, partition: int, assignment: Assignment) -> None:
        if partition != self.partition or not self.beating:
            return
        key = (assignment.request_id, assignment.attempt)
        if key in self.held or any(a.request_id == key[0] and a.attempt == key[1]
                                   for a in self.taken):
            self.violations.append(f"duplicate assignment {key}")
            return
        if assignment.worker_id != self.worker_id:
            self.violations.append(f"{key} for {assignment.worker_id} on my partition")
        if sum(self.held.values()) + assignment.kv_tokens > self.usable:
            self.violations.append(
                f"{key}: {sum(self.held.values())} + {assignment.kv_tokens} > {self.usable}"
            )
        self.held[key] = assignment.kv_tokens
        self.taken.append(assignment)
        # ``stream`` as it is now, when the assignment is read: a test that flips it next
        # must not race the ``event.started`` send below.
        self._tasks.append(asyncio.create_task(self._run(assignment, self.stream)))

    async def _run(self, assignment: Assignment, stream: bool) -> None:
        await self._event(EventStarted, assignment)
        if stream:
            await self._event(EventFirstToken, assignment, ttft_s=0.01)
        if not self.hold:
            await asyncio.sleep(self.run_s)
            await self.finish(assignment.request_id)

    async def finish(self, request_id: str) -> None:
        """Send ``event.done`` for the held attempt of ``request_id``."""
        key = next(k for k in self.held if k[0] == request_id)
        assignment = next(a for a in self.taken if (a.request_id, a.attempt) == key)
        usage = Usage(prompt_tokens=assignment.admitted.prompt_tokens, completion_tokens=5)
        # Freed before the event goes, as an engine frees a finished request's KV: freed
        # after, the scheduler could read the event and its next placement could reach this
        # worker before send_and_wait returned here, a false "over usable KV" (seen once in
        # CI, 2026-12-01).
        del self.held[key]
        await self._event(EventDone, assignment, finish_reason="stop", usage=usage)

    def holding(self) -> list[str]:
        return [rid for rid, _ in self.held]

    async def _event(self, kind: type[LifecycleEvent], a: Assignment, **fields: Any) -> None:
        event = kind(request_id=a.request_id, tenant=a.request.tenant, attempt=a.attempt,
                     worker_id=self.worker_id, ts=time.time(), **fields)
        await self.cluster.produce(f"{self.cluster.prefix}.events", encode(event),
                                   a.request_id.encode())


# -- the test-side cluster: plays ingest, hosts the fakes ---------------------------------


@dataclass
class Cluster:
    bootstrap: str
    prefix: str
    tmp: Path
    producer: Any = None
    observer: Observer = field(init=False)
    scheduler: SchedulerProcess = field(init=False)
    workers: list[FakeWorker] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.observer = Observer(self.bootstrap, self.prefix)
        self.scheduler = SchedulerProcess(self.prefix, self.tmp / "scheduler.log")

    async def start(self, **scheduler_env: str) -> None:
        specs = [*catalog(self.prefix, SLOTS), reply_spec(self.prefix, TENANT)]
        await ensure_topics(self.bootstrap, [TopicRequest(s.name, s.partitions, s.config)
                                             for s in specs])
        self.producer = make_producer(self.bootstrap)
        await self.producer.start()
        await self.observer.start()
        self.scheduler.env.update(scheduler_env)
        self.scheduler.start()
        await self.scheduler.wait_ready()

    async def stop(self) -> None:
        for worker in self.workers:
            await worker.stop()
        self.scheduler.kill(signal.SIGTERM)
        await self.observer.stop()
        if self.producer is not None:
            await self.producer.stop()
        await delete_topics(self.bootstrap, self.prefix)

    async def produce(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        await self.producer.send_and_wait(topic, value, key=key)

    async def worker(self, worker_id: str, partition: int, **options: Any) -> FakeWorker:
        worker = FakeWorker(self, worker_id, partition, **options)
        self.workers.append(worker)
        await worker.start()
        return worker

    async def admit(
        self,
        request_id: str,
        *,
        priority: Priority = "normal",
        lane: Lane = "short",
        prompt_tokens: int = 500,
        max_tokens: int = 12,
        timeout_s: float = 60.0,
        model: str = MODEL,
        reply: str | None = None,
    ) -> AdmittedRequest:
        """Play ingest: produce an admitted request on its topic (answered on ``reply``,
        the tenant's reply topic by default)."""
        now = time.time()
        request = make_request(request_id=request_id, tenant=TENANT, model=model,
                               max_tokens=max_tokens, timeout_s=timeout_s, created_at=now,
                               priority=priority, prefix_hash=None)
        admitted = make_admitted(request=request, priority=priority, lane=lane,
                                 prompt_tokens=prompt_tokens,
                                 reply_topic=reply or reply_topic(self.prefix, TENANT),
                                 admitted_at=now)
        await self.produce(request_topic(self.prefix, priority, lane), encode(admitted),
                           request_id.encode())
        return admitted

    async def cancel(self, request_id: str) -> None:
        cancel = CancelRequest(request_id=request_id, tenant=TENANT, reason="test",
                               issued_by="test", issued_at=time.time())
        await self.produce(f"{self.prefix}.control", encode(cancel), request_id.encode())


async def delete_topics(bootstrap: str, prefix: str) -> None:
    """Drop the test's topics (the shared dev broker has a small heap; hundreds of
    leftover test partitions add up)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        mine = [t for t in await admin.list_topics() if t.startswith((f"{prefix}.", f"{prefix}-"))]
        if mine:
            await admin.delete_topics(mine)
    except KafkaError:
        pass  # best effort
    finally:
        await admin.close()


@pytest.fixture
async def cluster(bootstrap: str, topic_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    made = Cluster(bootstrap, topic_prefix, tmp_path)
    try:
        yield made
    finally:
        await made.stop()
        print(made.scheduler.tail(40))


def kv(prompt_tokens: int, max_tokens: int, block: int = 16) -> int:
    return -(-(prompt_tokens + max_tokens) // block) * block


# -- tests ------------------------------------------------------------------------------


async def test_admitted_requests_get_assignments_on_the_workers_partitions(
    cluster: Cluster,
) -> None:
    await cluster.start()
    a = await cluster.worker("fake-a", 0, hold=False)
    b = await cluster.worker("fake-b", 2, hold=False)
    ids = [f"r{i}" for i in range(12)]
    for i, rid in enumerate(ids):
        await cluster.admit(rid, priority=("high", "normal", "low")[i % 3])
    obs = cluster.observer
    await eventually(lambda: all(obs.assigned(r) for r in ids), what="every request assigned")
    for partition, assignment in obs.assignments:
        assert (partition, assignment.worker_id) in {(0, "fake-a"), (2, "fake-b")}
        assert assignment.partition == partition
        assert assignment.attempt == 1
        assert assignment.kv_tokens == kv(500, 12)
        assert assignment.deadline == pytest.approx(
            assignment.request.created_at + assignment.request.timeout_s
        )
    assert all(len(obs.assigned(r)) == 1 for r in ids)
    assert not a.violations and not b.violations
    # Every request record is acked once its assignment is durable: the group commits all.
    await eventually_async(lambda: committed(cluster), 12, what="all request offsets committed")


async def test_reservations_never_exceed_worker_kv_and_return_to_zero(cluster: Cluster) -> None:
    await cluster.start()
    # usable KV 3,800 tokens: three 1,024-token reservations fit, a fourth never does.
    workers = [
        await cluster.worker(f"fake-{p}", p, kv_total_tokens=4_000, hold=False, run_s=0.3)
        for p in (0, 1)
    ]
    ids = [f"r{i}" for i in range(16)]
    for rid in ids:
        await cluster.admit(rid, prompt_tokens=1_000, max_tokens=24)
    obs = cluster.observer
    await eventually(lambda: all(obs.assigned(r) for r in ids), timeout_s=25,
                     what="every request assigned")
    await eventually(lambda: not any(w.held for w in workers), what="workers idle")
    for worker in workers:
        assert not worker.violations, worker.violations
        # 3 at a time at most on each worker (Σ reservations <= usable KV).
        assert len(worker.taken) >= 1
    await eventually(
        lambda: (s := obs.latest_status()) is not None and s.running_tokens == 0
        and s.pending_requests == 0,
        what="QueueStatus running_tokens back to 0",
    )
    status = obs.latest_status()
    assert status is not None
    assert status.live_workers == 2
    assert status.max_usable_kv_tokens == 3_800
    assert status.drain_tokens_per_s > 0
    assert max(s.running_tokens for s in obs.statuses) <= 2 * 3_800


async def test_high_priority_overtakes_a_backlog_of_low(cluster: Cluster) -> None:
    await cluster.start()
    worker = await cluster.worker("fake-a", 0, max_num_seqs=1)  # one request at a time
    await cluster.admit("first", priority="low")
    obs = cluster.observer
    await eventually(lambda: bool(obs.assigned("first")), what="first assigned")
    for i in range(5):
        await cluster.admit(f"low{i}", priority="low")
    await cluster.admit("urgent", priority="high")
    await eventually(  # the scheduler holds all six; nothing fits yet
        lambda: (s := obs.latest_status()) is not None and s.pending_requests == 6,
        what="six requests pending",
    )
    assert [a.request_id for _, a in obs.assignments] == ["first"]
    await worker.finish("first")
    await eventually(lambda: len(obs.assignments) == 2, what="second assignment")
    assert obs.assignments[1][1].request_id == "urgent"


async def test_short_request_is_not_stuck_behind_long_ones(cluster: Cluster) -> None:
    await cluster.start()
    await cluster.worker("fake-long", 0, pool="long", max_num_seqs=1)
    await cluster.worker("fake-short", 1, pool="short")
    obs = cluster.observer
    for i in range(4):
        await cluster.admit(f"long{i}", lane="long", prompt_tokens=8_000, max_tokens=500)
    await eventually(lambda: bool(obs.assigned("long0")), what="a long one runs")
    await cluster.admit("short", lane="short")
    await eventually(lambda: bool(obs.assigned("short")), timeout_s=5, what="short placed")
    assert obs.assigned("short")[0].worker_id == "fake-short"
    assert [a.request_id for _, a in obs.assignments if a.request_id.startswith("long")] == [
        "long0"
    ]


async def test_queue_deadline_ends_with_queue_timeout(cluster: Cluster) -> None:
    await cluster.start()
    await cluster.admit("late", timeout_s=1.5)  # no worker at all: it waits, then expires
    obs = cluster.observer
    await eventually(lambda: bool(obs.errors("late")), what="queue_timeout reply")
    (error,) = obs.errors("late")
    assert error.code == "queue_timeout" and error.attempt == 0
    await eventually(lambda: bool(obs.terminal_events("late")), what="terminal event")
    (event,) = obs.terminal_events("late")
    assert isinstance(event, EventFailed) and event.code == "queue_timeout"
    assert event.worker_id == SCHEDULER_ID and event.attempt == 1 and event.tenant == TENANT
    assert not obs.assigned("late")


async def test_unknown_model_is_rejected_while_a_fleet_is_live(cluster: Cluster) -> None:
    await cluster.start()
    await cluster.worker("fake-a", 0)
    await cluster.admit("odd", model="no-such-model")
    obs = cluster.observer
    await eventually(lambda: bool(obs.errors("odd")), what="unknown_model reply")
    assert obs.errors("odd")[0].code == "unknown_model"
    await eventually(lambda: bool(obs.terminal_events("odd")), what="terminal event")


async def test_cancel_of_a_pending_request(cluster: Cluster) -> None:
    await cluster.start()
    await cluster.admit("doomed")  # no worker: stays pending
    await asyncio.sleep(0.5)
    await cluster.cancel("doomed")
    obs = cluster.observer
    await eventually(lambda: bool(obs.errors("doomed")), what="cancelled reply")
    (error,) = obs.errors("doomed")
    assert error.code == "cancelled"
    await eventually(lambda: bool(obs.terminal_events("doomed")), what="aborted event")
    (event,) = obs.terminal_events("doomed")
    assert isinstance(event, EventAborted) and event.code == "cancelled"
    # A worker arriving later gets nothing for it.
    await cluster.worker("fake-a", 0)
    await asyncio.sleep(0.5)
    assert not obs.assigned("doomed")


async def test_lost_worker_requeues_unstarted_work_and_fails_streamed(cluster: Cluster) -> None:
    await cluster.start()
    a = await cluster.worker("fake-a", 0, stream=False)
    await cluster.admit("quiet")
    obs = cluster.observer
    await eventually(lambda: bool(obs.assigned("quiet")), what="quiet on a")
    a.stream = True
    await cluster.admit("chatty")
    await eventually(lambda: bool(obs.assigned("chatty")), what="chatty on a")
    await eventually(lambda: any(isinstance(e, EventFirstToken) for e in obs.events),
                     what="first token of chatty")
    b = await cluster.worker("fake-b", 1)
    await a.stop()  # no more heartbeats: dead after 3 intervals
    await eventually(lambda: len(obs.assigned("quiet")) == 2, what="quiet requeued")
    first, second = obs.assigned("quiet")
    assert (first.worker_id, first.attempt) == ("fake-a", 1)
    assert (second.worker_id, second.attempt) == ("fake-b", 2)
    await eventually(lambda: bool(obs.errors("chatty")), what="worker_lost reply")
    (error,) = obs.errors("chatty")
    assert error.code == "worker_lost" and error.attempt == 1
    await eventually(lambda: bool(obs.terminal_events("chatty")), what="worker_lost event")
    lost = obs.terminal_events("chatty")
    assert [(e.code, e.worker_id, e.attempt) for e in lost] == [("worker_lost", SCHEDULER_ID, 1)]
    assert len(obs.assigned("chatty")) == 1
    assert "quiet" in b.holding()


async def _answered_and_unanswered_on(cluster: Cluster, *, stream: bool) -> FakeWorker:
    """Requests "answered" and "unanswered" placed on fake worker "fake-a" (returned)."""
    await cluster.start()
    a = await cluster.worker("fake-a", 0, stream=stream)
    for rid in ("answered", "unanswered"):
        await cluster.admit(rid)
        await eventually(lambda rid=rid: bool(cluster.observer.assigned(rid)),
                         what=f"{rid} on a")
    return a


async def test_a_lost_worker_that_had_answered_gets_no_second_terminal(
    cluster: Cluster,
) -> None:
    """A worker sends an attempt's terminal reply, then its terminal event. Killed between
    the two, it leaves a durable reply the scheduler never heard of: ending that attempt
    worker_lost would give the client two terminals. The scheduler reads the reply topic
    first: "answered" gets only its terminal event, "unanswered" its worker_lost reply."""
    a = await _answered_and_unanswered_on(cluster, stream=True)
    obs = cluster.observer
    await eventually(lambda: sum(isinstance(e, EventFirstToken) for e in obs.events) == 2,
                     what="first tokens")
    (placed,) = obs.assigned("answered")
    done = make_done(request_id="answered", attempt=placed.attempt, model=MODEL,
                     ts=time.time())
    await cluster.produce(reply_topic(cluster.prefix, TENANT), encode(done), b"answered")
    await a.stop()  # dies before its event.done: dead after 3 intervals
    await eventually(lambda: bool(obs.terminal_events("answered"))
                     and bool(obs.errors("unanswered")), what="both ended")
    (error,) = obs.errors("unanswered")
    assert error.code == "worker_lost"
    await asyncio.sleep(1.0)  # room for a second reply, were one coming
    assert obs.errors("answered") == []
    assert [e.code for e in obs.terminal_events("answered")] == ["worker_lost"]


async def test_a_lost_worker_that_had_answered_before_any_token_gets_no_requeue(
    cluster: Cluster,
) -> None:
    """The same death between reply and event, for an attempt that streamed nothing (a
    cancel or timeout during prefill, an empty completion): a requeue would run it again
    and answer it a second time. The scheduler checks the reply topic before requeueing:
    "answered" gets only its terminal event; "unanswered" is requeued on b."""
    a = await _answered_and_unanswered_on(cluster, stream=False)
    obs = cluster.observer
    (placed,) = obs.assigned("answered")
    error = make_error(request_id="answered", attempt=placed.attempt, code="cancelled",
                       message="cancelled during prefill", ts=time.time())
    await cluster.produce(reply_topic(cluster.prefix, TENANT), encode(error), b"answered")
    b = await cluster.worker("fake-b", 1)
    await a.stop()  # dies before its event.aborted: dead after 3 intervals
    await eventually(lambda: len(obs.assigned("unanswered")) == 2
                     and bool(obs.terminal_events("answered")), what="both decided")
    await asyncio.sleep(1.0)  # room for a requeue or a reply, were one coming
    assert [r.attempt for r in obs.assigned("answered")] == [placed.attempt]
    assert [e.code for e in obs.errors("answered")] == ["cancelled"]  # only the worker's
    assert [e.code for e in obs.terminal_events("answered")] == ["worker_lost"]
    assert "unanswered" in b.holding()


async def test_the_scheduler_renews_a_lapsed_lease_only_while_the_work_is_the_workers(
    cluster: Cluster,
) -> None:
    """A worker whose lease lapsed asks with a renewing heartbeat. Before the scheduler
    declared it dead, the answer on llmq.control is granted (and its work stays put); once
    its heartbeat went stale and its work was requeued, the same incarnation is refused.
    (A scheduler refuses every renewal for takeover_s after it begins to lead: 1 s here.)"""
    await cluster.start(LLMQ_SCHEDULER_TAKEOVER_S="1")
    a = await cluster.worker("fake-a", 0)
    await cluster.admit("r1")
    obs = cluster.observer
    await eventually(lambda: bool(obs.assigned("r1")), what="r1 on a")
    await asyncio.sleep(1.5)  # it led before it placed r1
    await a.beat(renew=True)
    await eventually(lambda: bool(obs.leases), what="an answer")
    (granted,) = obs.leases
    assert (granted.worker_id, granted.started_at, granted.granted) == (
        "fake-a", a._started_at, True)
    b = await cluster.worker("fake-b", 1)
    a.beating = False  # silent from now on: dead after 3 intervals
    await eventually(lambda: len(obs.assigned("r1")) == 2, what="r1 requeued")
    assert obs.assigned("r1")[1].worker_id == "fake-b"
    a.beating = True
    await a.beat(renew=True)  # the same incarnation comes back and asks
    await eventually(lambda: len(obs.leases) == 2, what="a second answer")
    refused = obs.leases[1]
    assert (refused.worker_id, refused.granted) == ("fake-a", False)
    assert "stale" in refused.reason
    assert "r1" in b.holding() and len(obs.assigned("r1")) == 2


async def test_a_reply_topic_the_broker_refuses_holds_back_nothing(cluster: Cluster) -> None:
    # Kafka refuses a topic whose name collides with an existing one ('.' and '_' are the
    # same to its metrics): the scheduler cannot make this request's reply topic. Before,
    # every later cycle failed on it and nothing the scheduler produced went out any more.
    await cluster.start(LLMQ_SCHEDULER_REPLY_GIVE_UP_S="2")
    await ensure_topics(cluster.bootstrap, [TopicRequest(f"{cluster.prefix}.replies.bad.x", 1)])
    refused = f"{cluster.prefix}.replies.bad_x"
    await cluster.admit("unanswerable", model="no-such-model", reply=refused)
    await cluster.worker("fake-a", 0)
    await cluster.admit("fine")
    obs = cluster.observer
    await eventually(lambda: bool(obs.assigned("fine")), what="the other request placed")
    # Its reply is given up after 2 s; its terminal event still goes (ingest settles on it).
    await eventually(lambda: bool(obs.terminal_events("unanswerable")), what="terminal event")
    (event,) = obs.terminal_events("unanswerable")
    assert isinstance(event, EventFailed) and event.code == "unknown_model"
    assert "gave up a record to " + refused in cluster.scheduler.tail(200)
    assert cluster.scheduler.alive()


async def test_a_partition_pauses_while_it_holds_too_many_records(cluster: Cluster) -> None:
    # Records not yet committed stay in memory (a head that waits keeps every record done
    # behind it): past max_held_per_partition its partition is paused, the rest stays in
    # Kafka, and it resumes once they are done.
    await cluster.start(LLMQ_SCHEDULER_MAX_HELD_PER_PARTITION="3")
    worker = await cluster.worker("fake-a", 0, max_num_seqs=1)  # one request at a time
    await cluster.admit("first", priority="low")
    obs = cluster.observer
    await eventually(lambda: bool(obs.assigned("first")), what="first assigned")
    partitions = range(6)  # of each request topic
    home = key_partition(b"held-0", partitions)
    same = [rid for rid in (f"held-{i}" for i in range(200))
            if key_partition(rid.encode(), partitions) == home][:6]
    for request_id in same:  # all on one partition, all waiting for the worker
        await cluster.admit(request_id)
    await eventually(lambda: (s := obs.latest_status()) is not None and s.pending_requests == 3,
                     what="three requests read")
    await asyncio.sleep(2.5)  # two more status periods: the other three were not read
    status = obs.latest_status()
    assert status is not None and status.pending_requests == 3
    await worker.finish("first")
    for _ in same:  # as each one ends, the next is placed: the partition resumed
        await eventually(lambda: bool(worker.holding()), what="the next one placed")
        await worker.finish(worker.holding()[0])
    assert all(obs.assigned(r) for r in same)
    assert "paused until it holds fewer" in cluster.scheduler.tail(200)


async def test_garbage_goes_to_the_dead_letter_and_scheduling_goes_on(cluster: Cluster) -> None:


    await cluster.start()
    await cluster.worker("fake-a", 0, hold=False)
    topic = request_topic(cluster.prefix, "normal", "short")
    await cluster.produce(topic, b"{not json", b"junk")
    await cluster.produce(topic, b'{"kind": "admitted"}', b"junk2")
    await cluster.admit("fine")
    obs = cluster.observer
    await eventually(lambda: bool(obs.assigned("fine")), what="a valid request still placed")
    await eventually(lambda: len(obs.deadletters) == 2, what="two dead letters")
    reasons = [dict(r.headers)[DEADLETTER_REASON_HEADER].decode() for r in obs.deadletters]
    assert all(reasons), reasons
    assert {r.value for r in obs.deadletters} == {b"{not json", b'{"kind": "admitted"}'}
    assert cluster.scheduler.alive()


async def test_a_heartbeat_naming_no_partition_of_the_topic_is_dead_lettered(
        cluster: Cluster) -> None:
    """A worker heartbeating a partition the assignments topic does not have (not a real
    llmq worker: those check their slot at start) is kept out of the fleet and its
    heartbeat dead-lettered, naming the field. Before, the scheduler placed requests on it
    whose assignments could never be sent: they waited there for as long as it beat."""
    await cluster.start()
    stray = await cluster.worker("stray", SLOTS + 3, hold=False)
    await cluster.admit("r-stray")
    obs = cluster.observer
    await eventually(lambda: bool(obs.deadletters), what="the stray heartbeat dead-lettered")
    record = obs.deadletters[0]
    headers = dict(record.headers)
    assert headers[DEADLETTER_FIELD_HEADER] == b"partition"
    assert f"{SLOTS + 3} is not a partition of".encode() in headers[DEADLETTER_REASON_HEADER]
    assert record.key == b"stray"
    good = await cluster.worker("fake-a", 1, hold=False)
    await eventually(lambda: bool(obs.assigned("r-stray")), what="placed on the real worker")
    assert [a.worker_id for a in obs.assigned("r-stray")] == ["fake-a"]
    await eventually(lambda: any(e.kind == "event.done" and e.request_id == "r-stray"
                                 for e in obs.events), what="r-stray done")
    assert stray.taken == [] and [a.request_id for a in good.taken] == ["r-stray"]
    assert cluster.scheduler.alive()


async def test_a_scheduler_whose_producer_can_no_longer_send_exits_1(cluster: Cluster) -> None:
    """The broker answers OUT_OF_ORDER_SEQUENCE_NUMBER (FAULT INJECTION on the answer:
    tests/fakes/sender_fault), after which aiokafka fails every later batch to the
    partition. Before, the scheduler lived on and placed requests whose assignments never
    left. Now it exits 1 at once, so a supervisor restarts it; what it had not acked is
    redelivered."""
    trigger = cluster.tmp / "sender-fault"
    await cluster.start(**sender_fault.env(trigger))
    await cluster.worker("fake-0", 0)
    trigger.touch()
    await cluster.admit("placed-by-a-dead-producer")  # its assignment's send fails
    proc = cluster.scheduler.proc
    assert proc is not None
    code = await asyncio.to_thread(proc.wait, 40)
    assert code == 1, cluster.scheduler.tail()
    assert "can no longer send" in cluster.scheduler.tail(400)
