"""FAKE worker for the health / ops tests: heartbeats and the drain reaction, nothing else.

The real worker (services/worker) runs an engine; these tests only need what the health side
sees of a worker: ``WorkerHeartbeat`` records on ``<prefix>.heartbeats`` and the reaction to
``DrainWorker`` on ``<prefix>.control`` (docs/live-system.md, "Control"):

- :func:`heartbeat` builds a valid heartbeat with the fields a test cares about;
- :func:`publish` produces heartbeats (or a tombstone) as they are, e.g. stale ones;
- :class:`FakeHeartbeatWorker` beats every ``interval_s`` with ``running`` sequences; when a
  ``DrainWorker`` for its id arrives it beats ``draining=true``, finishes one sequence per
  beat, sends a last draining beat with nothing running, and stops — as the real worker
  does before exiting 0.

Everything talks to the real broker on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition

from schemas.codec import decode, encode
from schemas.control import DrainWorker
from schemas.messages import CONTROL_ADAPTER
from schemas.workers import WorkerHeartbeat
from services.common.kafka import make_consumer, make_producer
from services.common.replies import topic_partitions
from tests.builders_schemas import make_heartbeat


def heartbeat(worker_id: str, **changes: Any) -> WorkerHeartbeat:
    """A valid heartbeat of ``worker_id``, fresh now, with ``changes`` applied."""
    now = time.time()
    fields: dict[str, Any] = {
        "worker_id": worker_id, "ts": now, "started_at": now - 60.0, "seq": 1,
        "draining": False, "interval_s": 1.0,
    }
    fields.update(changes)
    return make_heartbeat(**fields)


async def publish(bootstrap: str, prefix: str, *beats: WorkerHeartbeat | str) -> None:
    """Produce heartbeats; a bare worker id produces that worker's tombstone."""
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        for beat in beats:
            if isinstance(beat, str):
                await producer.send_and_wait(f"{prefix}.heartbeats", None, key=beat.encode())
            else:
                await producer.send_and_wait(f"{prefix}.heartbeats", encode(beat),
                                             key=beat.worker_id.encode())
    finally:
        await producer.stop()


class FakeHeartbeatWorker:
    """FAKE worker process: heartbeats and drain (see the module docstring)."""

    def __init__(self, bootstrap: str, prefix: str, worker_id: str, *, slot: int = 0,
                 interval_s: float = 0.2, running: int = 3) -> None:
        self.bootstrap = bootstrap
        self.prefix = prefix
        self.worker_id = worker_id
        self.slot = slot
        self.interval_s = interval_s
        self.running = running
        self.draining = False
        self.drain_commands: list[DrainWorker] = []
        self.beats_sent = 0
        self.stopped = asyncio.Event()
        self._started_at = time.time()
        self._producer: AIOKafkaProducer | None = None
        self._control: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start beating; returns once the first heartbeat is acknowledged and the control
        reader sits at the end of the topic (so a drain sent afterwards is seen)."""
        self._producer = make_producer(self.bootstrap)
        await self._producer.start()
        self._control = make_consumer(self.bootstrap)
        await self._control.start()
        topic = f"{self.prefix}.control"
        tps = [TopicPartition(topic, p) for p in await topic_partitions(self.bootstrap, topic)]
        self._control.assign(tps)
        await self._control.seek_to_end(*tps)
        for tp in tps:
            await self._control.position(tp)
        await self._beat()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._control is not None:
            await self._control.stop()
        if self._producer is not None:
            await self._producer.stop()

    async def _beat(self) -> None:
        assert self._producer is not None
        hb = heartbeat(
            self.worker_id, partition=self.slot, running=self.running, waiting=0,
            draining=self.draining, interval_s=self.interval_s,
            started_at=self._started_at, seq=self.beats_sent, ts=time.time(),
        )
        await self._producer.send_and_wait(f"{self.prefix}.heartbeats", encode(hb),
                                           key=self.worker_id.encode())
        self.beats_sent += 1

    async def _run(self) -> None:
        while True:
            batches = await self._control.getmany(timeout_ms=int(self.interval_s * 1000))
            for records in batches.values():
                for record in records:
                    msg = decode(record.value, CONTROL_ADAPTER)
                    if isinstance(msg, DrainWorker) and msg.worker_id == self.worker_id:
                        self.drain_commands.append(msg)
                        self.draining = True
            if self.draining and self.running > 0:
                self.running -= 1  # one in-flight request finishes per beat
            await self._beat()
            if self.draining and self.running == 0:
                self.stopped.set()  # last beat said "draining, nothing running": exit
                return
