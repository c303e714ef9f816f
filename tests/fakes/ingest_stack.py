"""Test-only helpers for the ingest integration tests: the real ingest process, a FAKE worker.

- :class:`IngestProcess` runs the real ``python -m services.ingest`` as a subprocess on a
  free loopback port, with a unique topic prefix, and waits until it is ready.
- :class:`FakeWorker` is a **fake** of services/worker (the real one does not exist in
  these tests): it heartbeats like a live worker, reads the six request topics directly
  (no scheduler), and for each admitted request produces token chunks and ``Done`` on the
  request's reply topic and ``event.done`` on ``llmq.events``. It records every admitted
  request it saw, so tests can check what was (not) queued.

Everything talks to the real broker on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiokafka import TopicPartition

from schemas.codec import decode, encode
from schemas.messages import REQUEST_ADAPTER
from schemas.replies import Done, Timings, TokenChunk, Usage
from schemas.requests import AdmittedRequest
from schemas.topics import request_topics
from schemas.workers import EventDone
from services.common.kafka import make_consumer, make_producer
from services.common.replies import topic_partitions
from tests.builders_schemas import make_heartbeat
from tests.fakes.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"


@dataclass
class IngestProcess:
    """The real ingest service in a subprocess (SIGTERM to stop, like ``llmq up`` would)."""

    prefix: str
    log_path: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {
            **os.environ,
            "LLMQ_TOPIC_PREFIX": self.prefix,
            "LLMQ_INGEST_INSTANCE_ID": f"t{self.port}",
            "LLMQ_INGEST_EXPIRY_SCAN_S": "1",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.ingest", "--port", str(self.port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()

    async def wait_ready(self, *, heartbeat: bool = True, timeout_s: float = 90.0) -> None:
        """Until /readyz passes (or all but the heartbeat check, when ``heartbeat`` is off)."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(base_url=self.base_url, timeout=2.0) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None and self.proc.poll() is None, self.tail()
                with contextlib.suppress(httpx.HTTPError):
                    body = (await client.get("/readyz")).json()
                    checks = dict(body["checks"])
                    if not heartbeat:
                        checks.pop("worker_heartbeat")
                    if all(checks.values()):
                        return
                await asyncio.sleep(0.2)
        raise AssertionError(f"ingest not ready in {timeout_s} s:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class FakeWorker:
    """FAKE worker (test-only): heartbeats, and answers every admitted request it reads."""

    bootstrap: str
    prefix: str
    model: str = MODEL
    worker_id: str = "fake-worker-0"
    chunks: Sequence[str] = ("Hello", ",", " world")
    chunk_delay_s: float = 0.0
    #: Send every chunk twice (at-least-once delivery): clients must drop the copy.
    duplicate_chunks: bool = False
    kv_total_tokens: int = 100_000
    #: The partition of the assignments topic its heartbeat names.
    partition: int = 0
    #: Send the terminal event after the reply (False: only expiry settles the request).
    send_events: bool = True
    admitted: list[AdmittedRequest] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _producer: Any = None
    _consumer: Any = None

    async def start(self) -> None:
        self._producer = make_producer(self.bootstrap)
        await self._producer.start()
        tps = [
            TopicPartition(topic, p)
            for topic in request_topics(self.prefix)
            for p in await topic_partitions(self.bootstrap, topic)
        ]
        self._consumer = make_consumer(self.bootstrap)
        await self._consumer.start()
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        await self.beat()
        self._tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._serve())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
        if self._producer is not None:
            await self._producer.stop()

    def seen(self, request_id: str) -> bool:
        return any(a.request_id == request_id for a in self.admitted)

    async def beat(self, seq: int = 0) -> None:
        hb = make_heartbeat(
            worker_id=self.worker_id, model=self.model, model_version=None,
            partition=self.partition,
            kv_total_tokens=self.kv_total_tokens, kv_free_tokens=self.kv_total_tokens,
            kv_total_bytes=self.kv_total_tokens * 23_040,
            kv_free_bytes=self.kv_total_tokens * 23_040, running=0, waiting=0,
            interval_s=1.0, started_at=time.time() - 1, seq=seq, ts=time.time(),
        )
        await self._producer.send_and_wait(
            f"{self.prefix}.heartbeats", encode(hb), key=self.worker_id.encode()
        )

    async def _heartbeats(self) -> None:
        seq = 1
        while True:
            await asyncio.sleep(0.5)
            await self.beat(seq)
            seq += 1

    async def _serve(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            for records in batches.values():
                for record in records:
                    admitted = decode(record.value, REQUEST_ADAPTER)
                    self.admitted.append(admitted)
                    await self._answer(admitted)

    async def _answer(self, admitted: AdmittedRequest) -> None:
        request, now = admitted.request, time.time()
        rid = request.request_id
        for seq, text in enumerate(self.chunks):
            chunk = TokenChunk(request_id=rid, attempt=1, seq=seq, text=text, tokens=1, ts=now)
            for _ in range(2 if self.duplicate_chunks else 1):
                await self._producer.send_and_wait(admitted.reply_topic, encode(chunk),
                                                   key=rid.encode())
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
        usage = Usage(prompt_tokens=admitted.prompt_tokens, completion_tokens=len(self.chunks))
        done = Done(request_id=rid, attempt=1, model=request.model, finish_reason="stop",
                    usage=usage, timings=Timings(queued_s=0.0, e2e_s=0.01), ts=time.time())
        await self._producer.send_and_wait(admitted.reply_topic, encode(done), key=rid.encode())
        if not self.send_events:
            return
        event = EventDone(request_id=rid, tenant=request.tenant, attempt=1,
                          worker_id=self.worker_id, ts=time.time(), finish_reason="stop",
                          usage=usage)
        await self._producer.send_and_wait(f"{self.prefix}.events", encode(event),
                                           key=rid.encode())
