"""Test-only helpers for the worker integration tests: the REAL worker process, a FAKE
scheduler.

- :class:`WorkerProcess` runs the real ``python -m services.worker`` as a subprocess with a
  unique topic prefix, a small number of slots and a fast sim time scale; its output goes to
  a log file that :meth:`WorkerProcess.tail` shows when a test fails.
- :class:`FakeScheduler` is a **fake** of services/scheduler (the real one is not in these
  tests): it produces ``Assignment`` records straight to a worker's partition, sends
  control commands, and records everything that comes back on the reply topic, the events
  topic, the heartbeats topic and the dead-letter topic (read from the beginning, no
  consumer group), with helpers to wait for what a test expects.

Everything talks to the real broker on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiokafka import TopicPartition

from schemas.codec import decode, encode
from schemas.control import CancelRequest, DrainWorker, LeaseAnswer
from schemas.messages import EVENT_ADAPTER, HEARTBEAT_ADAPTER, REPLY_ADAPTER
from schemas.replies import Done, Error, TokenChunk
from schemas.requests import Assignment
from schemas.topics import message_key, reply_spec, reply_topic
from schemas.workers import WorkerHeartbeat
from services.common.kafka import TopicRequest, ensure_topics, make_consumer, make_producer
from services.common.replies import topic_partitions
from services.worker.kafka_io import WorkerTopics
from tests.builders_schemas import make_admitted, make_assignment, make_prompt_request

ROOT = Path(__file__).resolve().parents[2]
TENANT = "acme"
MODEL = "llama-3.1-8b"
T = TypeVar("T")


@dataclass
class WorkerProcess:
    """The real worker as a child process (see the module docstring)."""

    prefix: str
    slot: int
    worker_id: str
    pool: str = "short"
    partitions: int = 2
    time_scale: float = 0.01
    heartbeat_s: float = 0.2
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "LLMQ_TOPIC_PREFIX": self.prefix,
            "LLMQ_ASSIGNMENT_PARTITIONS": str(self.partitions),
            "LLMQ_WORKER_TIME_SCALE": str(self.time_scale),
            "LLMQ_WORKER_SESSION_TIMEOUT_MS": "6000",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        fd, name = tempfile.mkstemp(prefix=f"worker-{self.worker_id}-", suffix=".log")
        self.log_path = Path(name)
        argv = [
            sys.executable, "-m", "services.worker", "--slot", str(self.slot),
            "--pool", self.pool, "--engine", "sim", "--profile", "llama3-8b-h100",
            "--model", MODEL, "--worker-id", self.worker_id,
            "--heartbeat-interval", str(self.heartbeat_s), *self.extra_args,
        ]
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        """Kill it if still running (end of test); idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log_path is not None and self.proc is not None and self.proc.returncode == 0:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def tail(self, lines: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Seen:
    """Everything the fake scheduler read back, in arrival order."""

    replies: list[TokenChunk | Done | Error] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    heartbeats: list[WorkerHeartbeat] = field(default_factory=list)
    deadletters: list[Any] = field(default_factory=list)  # raw records


class FakeScheduler:
    """A FAKE scheduler for worker tests (see the module docstring)."""

    def __init__(self, bootstrap: str, prefix: str, partitions: int = 2) -> None:
        self.bootstrap = bootstrap
        self.prefix = prefix
        self.topics = WorkerTopics.of(prefix, partitions)
        self.reply_topic = reply_topic(prefix, TENANT)
        self.seen = Seen()
        self._producer: Any = None
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        spec = reply_spec(self.prefix, TENANT)
        await ensure_topics(self.bootstrap, [*self.topics.to_create(),
                                             TopicRequest(spec.name, spec.partitions,
                                                          spec.config)])
        self._producer = make_producer(self.bootstrap)
        await self._producer.start()
        tps = []
        for topic in (self.reply_topic, self.topics.events, self.topics.heartbeats,
                      self.topics.deadletter):
            tps += [TopicPartition(topic, p)
                    for p in await topic_partitions(self.bootstrap, topic)]
        self._consumer = make_consumer(self.bootstrap)
        await self._consumer.start()
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._read())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for client in (self._consumer, self._producer):
            if client is not None:
                await client.stop()

    async def _read(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            for tp, records in batches.items():
                for record in records:
                    self._take(tp.topic, record)
            if batches:
                self._changed.set()

    def _take(self, topic: str, record: Any) -> None:
        if topic == self.reply_topic:
            self.seen.replies.append(decode(record.value, REPLY_ADAPTER))
        elif topic == self.topics.events:
            self.seen.events.append(decode(record.value, EVENT_ADAPTER))
        elif topic == self.topics.heartbeats:
            self.seen.heartbeats.append(decode(record.value, HEARTBEAT_ADAPTER))
        else:
            self.seen.deadletters.append(record)

    # ---- playing the scheduler ---------------------------------------------------------
    def assignment(self, request_id: str, *, worker_id: str, slot: int, max_tokens: int = 20,
                   attempt: int = 1, timeout_s: float = 30.0, prompt_tokens: int = 50,
                   created_at: float | None = None, tenant: str = TENANT,
                   worker_started_at: float | None = None) -> Assignment:
        now = time.time() if created_at is None else created_at
        request = make_prompt_request("hello", request_id=request_id, tenant=tenant,
                                      model=MODEL, max_tokens=max_tokens, timeout_s=timeout_s,
                                      created_at=now)
        admitted = make_admitted(request=request, reply_topic=self.reply_topic,
                                 prompt_tokens=prompt_tokens, admitted_at=now, lane="short")
        return make_assignment(admitted=admitted, worker_id=worker_id, partition=slot,
                               attempt=attempt, kv_tokens=prompt_tokens + max_tokens,
                               deadline=now + timeout_s, assigned_at=now,
                               worker_started_at=worker_started_at)

    async def send(self, a: Assignment) -> None:
        await self._producer.send_and_wait(self.topics.assignments, encode(a),
                                           key=message_key(a), partition=a.partition)

    async def send_event(self, event: Any) -> None:
        """A lifecycle event, as the scheduler writes one when it ends an attempt itself."""
        await self._producer.send_and_wait(self.topics.events, encode(event),
                                           key=message_key(event))

    async def send_raw(self, value: bytes, slot: int) -> None:
        await self._producer.send_and_wait(self.topics.assignments, value, key=b"garbage",
                                           partition=slot)

    async def cancel(self, request_id: str, tenant: str = TENANT) -> None:
        msg = CancelRequest(request_id=request_id, tenant=tenant, reason="test",
                            issued_by="test", issued_at=time.time())
        await self._producer.send_and_wait(self.topics.control, encode(msg),
                                           key=message_key(msg))

    async def drain(self, worker_id: str) -> None:
        msg = DrainWorker(worker_id=worker_id, reason="test", issued_by="test",
                          issued_at=time.time())
        await self._producer.send_and_wait(self.topics.control, encode(msg),
                                           key=message_key(msg))

    async def answer_lease(self, hb: WorkerHeartbeat, granted: bool) -> None:
        """The scheduler's answer to a heartbeat that asked to renew a lapsed lease."""
        msg = LeaseAnswer(worker_id=hb.worker_id, started_at=hb.started_at, seq=hb.seq,
                          granted=granted, reason="" if granted else "test refused",
                          issued_by="test", issued_at=time.time())
        await self._producer.send_and_wait(self.topics.control, encode(msg),
                                           key=message_key(msg))

    # ---- reading back ------------------------------------------------------------------
    async def wait_until(self, probe: Callable[[], T | None], timeout_s: float = 45.0,
                         what: str = "condition") -> T:
        """Wait until ``probe()`` returns something truthy and return it."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = probe()
            if got:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))

    def replies_of(self, request_id: str) -> list[TokenChunk | Done | Error]:
        return [r for r in self.seen.replies if r.request_id == request_id]

    def terminals_of(self, request_id: str) -> list[Done | Error]:
        return [r for r in self.replies_of(request_id) if not isinstance(r, TokenChunk)]

    def events_of(self, request_id: str) -> list[Any]:
        return [e for e in self.seen.events if e.request_id == request_id]

    async def terminal(self, request_id: str, timeout_s: float = 45.0) -> Done | Error:
        found = await self.wait_until(lambda: self.terminals_of(request_id), timeout_s,
                                      f"the terminal of {request_id}")
        return found[0]

    async def heartbeat(self, worker_id: str, timeout_s: float = 20.0,
                        where: Callable[[WorkerHeartbeat], bool] = lambda hb: True
                        ) -> WorkerHeartbeat:
        found = await self.wait_until(
            lambda: [h for h in self.seen.heartbeats if h.worker_id == worker_id and where(h)],
            timeout_s, f"a heartbeat of {worker_id}",
        )
        return found[-1]
