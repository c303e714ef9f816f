"""Intake records read a second time: was the request answered the first time?

Faust commits an intake partition's offset every 0.5 s, so after a crash (or a rebalance
whose commit failed) the records read since the last commit are read again by the
partition's next owner. A request admitted the first time is recognised by its
reservation (:class:`~services.ingest.intake.IntakeHandler` sends its admission again).
A refused one left nothing behind: ingest keeps no record of a refusal (a table row per
refusal would be a changelog write per refusal, in floods of them). So it was decided
afresh, and could then be admitted and run, charged to its tenant, after its client had
been told it was refused.

:class:`RedeliveryCheck` looks for the first answer on the request's reply topic instead,
only where a record may have been read before:

* Records at or past a partition's end offset when this process was assigned it are new:
  nobody read them before. The end is asked for at each assignment, in the background.
* Below it, the first record the handler asks about (the committed offset: where reading
  starts) begins a *batch*: up to ``batch`` records of the partition from there are read
  (their ids, reply topics and times), then their reply partitions are read back once
  (:func:`services.common.answered.answered`, newest records first) for a terminal of any
  attempt written at or after the record. The ids found are acked unanswered by the
  handler: their one terminal went out.
* The old owner read the partition in order from the same committed offset, so once a
  batch holds no request it answered or admitted (no terminal found, no reservation), it
  got no further: the rest of the partition is new and is not checked. A partition with a
  backlog (ingest down for an hour) so costs one batch, not a read of the whole backlog.

What it does not cover (docs/live-system.md, "Where a crash can still give a request a
second terminal"): a terminal written by a clock behind the record's producer (the
terminal looks older than its request; HTTP requests are stamped and answered by the same
ingest's clock), one the check did not find within ``timeout_s``, and a record moved here
from another partition (a redelivered original is moved again: the copy is new here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from aiokafka import TopicPartition

from schemas.codec import SchemaError, decode
from schemas.requests import InferenceRequest
from services.common.answered import ANY_ATTEMPT, answered
from services.common.kafka import make_consumer

_log = logging.getLogger(__name__)

#: Records of a partition read and checked together.
BATCH: Final = 2_000
#: The partition's end at an assignment is asked for this long; none: nothing is checked.
END_TIMEOUT_S: Final = 30.0
#: One batch (its records read, their reply partitions read back) is given this long; one
#: that fails or takes longer ends the checks of its partition until the next assignment.
BATCH_TIMEOUT_S: Final = 30.0

#: (topic, partition) -> end offset now, for the partitions asked about.
EndOffsets = Callable[[str, list[int]], Awaitable[dict[int, int]]]
#: (topic, partition, low, high) -> the records in [low, high): (offset, key, value, ts ms).
ReadRange = Callable[[str, int, int, int],
                     Awaitable[list[tuple[int, bytes | None, bytes | None, int]]]]
#: wanted {(request_id, ANY_ATTEMPT): (reply topic, key, produced at)} -> the answered ids.
FindAnswered = Callable[[dict[tuple[str, int], tuple[str, bytes, float]]], Awaitable[set[str]]]


@dataclass
class _Window:
    """One partition, one assignment: what below its end has been checked, and found."""

    end: asyncio.Future[int | None]
    checked_to: int = -1  # records below this offset were checked (from the first asked)
    done: bool = False  # no batch after the last: the rest of the partition is new
    found: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class RedeliveryCheck:
    """Answers "was this intake record answered before?" for the partitions owned now.

    ``target(request)``: the reply topic a refusal of ``request`` went to. ``reserved(id)``:
    whether the request holds a reservation here (the old owner admitted it). The Kafka
    reads are injected (:meth:`over_kafka` builds the real ones) so that the batching can
    be tested without a broker.
    """

    def __init__(
        self,
        topic: str,
        *,
        target: Callable[[InferenceRequest], str],
        reserved: Callable[[str], bool],
        end_offsets: EndOffsets,
        read_range: ReadRange,
        find_answered: FindAnswered,
        batch: int = BATCH,
        end_timeout_s: float = END_TIMEOUT_S,
        batch_timeout_s: float = BATCH_TIMEOUT_S,
    ) -> None:
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self._topic = topic
        self._target = target
        self._reserved = reserved
        self._end_offsets = end_offsets
        self._read_range = read_range
        self._find_answered = find_answered
        self._batch = batch
        self._end_timeout_s = end_timeout_s
        self._batch_timeout_s = batch_timeout_s
        self._windows: dict[int, _Window] = {}
        self.batches = 0  # batches checked since start (for tests and logs)

    @classmethod
    def over_kafka(
        cls, bootstrap: str, topic: str, *, target: Callable[[InferenceRequest], str],
        reserved: Callable[[str], bool], timeout_s: float, batch: int = BATCH,
    ) -> RedeliveryCheck:
        """The check against the broker at ``bootstrap``; a batch's reply-topic read stops
        after ``timeout_s`` (what it has not found by then counts as unanswered)."""

        async def find(wanted: dict[tuple[str, int], tuple[str, bytes, float]]) -> set[str]:
            result = await answered(bootstrap, wanted, timeout_s, any_attempt=True)
            if not result.complete:
                _log.warning("ingest: the reply-topic check of %d redelivered records "
                             "stopped before the end; %d found answered", len(wanted),
                             len(result.found))
            return {request_id for request_id, _ in result.found}

        return cls(topic, target=target, reserved=reserved,
                   end_offsets=kafka_end_offsets(bootstrap),
                   read_range=kafka_read_range(bootstrap), find_answered=find,
                   batch=batch)

    def assigned(self, partitions: Iterable[int]) -> None:
        """A new assignment (every partition of ``topic`` owned now): their ends are asked
        for in the background; what an earlier assignment checked is forgotten."""
        for window in self._windows.values():
            window.end.cancel()
        owned = sorted(set(partitions))
        self._windows = {}
        if not owned:
            return
        ends = asyncio.ensure_future(self._ends(owned))
        for p in owned:
            self._windows[p] = _Window(asyncio.ensure_future(_pick(ends, p)))

    async def _ends(self, partitions: list[int]) -> dict[int, int] | None:
        try:
            return await asyncio.wait_for(self._end_offsets(self._topic, partitions),
                                          self._end_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            _log.warning("ingest: could not read the end of %s partitions %s: records read "
                         "again after this assignment are decided afresh", self._topic,
                         partitions, exc_info=True)
            return None

    async def answered_before(self, partition: int, offset: int, request_id: str) -> bool:
        """Whether the intake record at ``offset`` of ``partition`` (of ``request_id``) was
        answered by an earlier reading of it (module docstring). Never raises: a failed
        check counts as unanswered, as before there was a check, and ends the checks of
        the partition until the next assignment (each record would wait for it again)."""
        window = self._windows.get(partition)
        if window is None:
            return False
        try:
            end = await window.end
            if end is None or offset >= end:
                return False
            async with window.lock:
                while not window.done and offset >= window.checked_to:
                    await asyncio.wait_for(self._check_batch(partition, window, offset, end),
                                           self._batch_timeout_s)
        except asyncio.CancelledError:
            if window.end.cancelled():
                return False  # a new assignment: this one's checks are void
            raise
        except Exception:
            window.done = True
            _log.warning("ingest: checking %s/%d/%d for an earlier answer failed; it and "
                         "the records after it are decided afresh", self._topic, partition,
                         offset, exc_info=True)
            return False
        return request_id in window.found

    async def _check_batch(self, partition: int, window: _Window, offset: int,
                           end: int) -> None:
        low = max(offset, window.checked_to)
        high = min(end, low + self._batch)
        wanted: dict[tuple[str, int], tuple[str, bytes, float]] = {}
        admitted = False
        for _, key, value, ts in await self._read_range(self._topic, partition, low, high):
            try:
                req = decode(value, InferenceRequest)
            except SchemaError:
                continue  # refused by its fields alone: the same answer again, or none
            if key != req.tenant.encode():
                continue  # moved to its tenant's partition, not decided here
            if self._reserved(req.request_id):
                admitted = True
                continue  # the handler sends its admission again
            wanted.setdefault((req.request_id, ANY_ATTEMPT),
                              (self._target(req), req.request_id.encode(), ts / 1000.0))
        found = await self._find_answered(wanted) if wanted else set()
        self.batches += 1
        window.found |= found
        window.checked_to = high
        window.done = high >= end or not (found or admitted)
        _log.info("ingest: %s/%d [%d, %d): %d of %d requests read again were answered "
                  "before%s", self._topic, partition, low, high, len(found), len(wanted),
                  "" if window.done else "; the next batch is checked too")


async def _pick(ends: asyncio.Future[dict[int, int] | None], partition: int) -> int | None:
    found = await asyncio.shield(ends)
    return None if found is None else found.get(partition)


def kafka_end_offsets(bootstrap: str) -> EndOffsets:
    """:data:`EndOffsets` over a short-lived consumer."""

    async def ends(topic: str, partitions: list[int]) -> dict[int, int]:
        consumer = make_consumer(bootstrap)
        await consumer.start()
        try:
            tps = [TopicPartition(topic, p) for p in partitions]
            found = await consumer.end_offsets(tps)
            return {tp.partition: offset for tp, offset in found.items()}
        finally:
            await consumer.stop()

    return ends


def kafka_read_range(bootstrap: str) -> ReadRange:
    """:data:`ReadRange` over a short-lived consumer."""

    async def read(topic: str, partition: int, low: int,
                   high: int) -> list[tuple[int, bytes | None, bytes | None, int]]:
        consumer = make_consumer(bootstrap)
        await consumer.start()
        tp = TopicPartition(topic, partition)
        records: list[tuple[int, bytes | None, bytes | None, int]] = []
        try:
            consumer.assign([tp])
            consumer.seek(tp, low)
            while await consumer.position(tp) < high:
                for record in (await consumer.getmany(tp, timeout_ms=500)).get(tp, []):
                    if record.offset >= high:
                        return records
                    records.append((record.offset, record.key, record.value,
                                    record.timestamp))
            return records
        finally:
            await consumer.stop()

    return read
