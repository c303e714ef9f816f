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
  (:func:`services.common.answered.answered`, newest records first) for ingest's answers
  to them: each refusal names the intake record it answers (header
  ``llmq-intake-record``, ``<partition>/<offset>``), so an answer is matched to its own
  record, never to another request under the same id (a client retrying a refused id).
  The records found answered are acked unanswered by the handler: their one terminal
  went out.
* The old owner read the partition in order from the same committed offset, so once a
  batch holds no request it answered or admitted (no terminal found, no reservation), it
  got no further: the rest of the partition is new and is not checked. A partition with a
  backlog (ingest down for an hour) so costs one batch, not a read of the whole backlog.

What it does not cover (docs/live-system.md, "Where a crash can still give a request a
second terminal"): an answer stamped more than :data:`REPLY_MARGIN_S` before its record
(a producer's clock that far ahead of ingest's: its partition is not read back that far),
one the check did not find within ``timeout_s``, a record moved here from another
partition (a redelivered original is moved again: the copy is new here), the two
refusals sent to the tenant's topic where the request named another (an id scoped to
another tenant, a missing instance topic: looked for where the request asked; decided
again, they are refused again), and a request admitted, ended and settled before the
crash (no reservation is left: admitted again, the scheduler acks it as a finished
request, and its reservation waits for expiry).

Cost: a batch is three short-lived Kafka clients, the batch's records (up to ``batch`` of
them, in memory at once), and a read back of each reply partition its requests touch, to
:data:`REPLY_MARGIN_S` before the earliest record (records never read have no answer, so
that read is not cut short): after each assignment, the admission agent waits for one
batch per partition with a record below its end, at most ``timeout_s`` each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

from aiokafka import ConsumerRecord, TopicPartition

from schemas.codec import SchemaError, decode
from schemas.replies import Done, Error
from schemas.requests import InferenceRequest
from schemas.topics import INTAKE_RECORD_HEADER
from services.common.answered import Attempt, answered
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
#: A partition's records: {(request_id, offset): (reply topic, key, produced at)} -> the
#: offsets of those with an answer naming them.
FindAnswered = Callable[[int, dict[Attempt, tuple[str, bytes, float]]], Awaitable[set[int]]]
#: A reply partition is read back this far before the earliest record's time (its
#: producer's clock; the answer has ingest's).
REPLY_MARGIN_S: Final = 15.0


@dataclass
class _Window:
    """One partition, one assignment: what below its end has been checked, and found."""

    end: asyncio.Future[int | None]
    checked_to: int = -1  # records below this offset were checked (from the first asked)
    done: bool = False  # no batch after the last: the rest of the partition is new
    found: dict[int, str] = field(default_factory=dict)  # offset -> request_id, answered
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

        async def find(partition: int,
                       wanted: dict[Attempt, tuple[str, bytes, float]]) -> set[int]:
            result = await answered(bootstrap, wanted, timeout_s, margin_s=REPLY_MARGIN_S,
                                    identify=partial(answered_record, partition))
            if not result.complete:
                _log.warning("ingest: the reply-topic check of %d records read again "
                             "stopped before the end; %d found answered", len(wanted),
                             len(result.found))
            return {offset for _, offset in result.found}

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
            end = await asyncio.shield(window.end)  # shared: a waiter's cancel is its own
            if end is None or offset >= end:
                return False
            async with window.lock:
                while not window.done and offset >= window.checked_to:
                    await asyncio.wait_for(self._check_batch(partition, window, offset, end),
                                           self._batch_timeout_s)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if window.end.cancelled() and (task is None or not task.cancelling()):
                return False  # a new assignment: this one's checks are void
            raise
        except Exception:
            window.done = True
            _log.warning("ingest: checking %s/%d/%d for an earlier answer failed; it and "
                         "the records after it are decided afresh", self._topic, partition,
                         offset, exc_info=True)
            return False
        return window.found.get(offset) == request_id

    async def _check_batch(self, partition: int, window: _Window, offset: int,
                           end: int) -> None:
        low = max(offset, window.checked_to)
        high = min(end, low + self._batch)
        wanted: dict[Attempt, tuple[str, bytes, float]] = {}
        admitted = False
        for offset, key, value, ts in await self._read_range(self._topic, partition, low, high):
            try:
                req = decode(value, InferenceRequest)
            except SchemaError:
                continue  # refused by its fields alone: the same answer again, or none
            if key != req.tenant.encode():
                continue  # moved to its tenant's partition, not decided here
            if self._reserved(req.request_id):
                admitted = True
                continue  # the handler sends its admission again
            wanted[(req.request_id, offset)] = (self._target(req), req.request_id.encode(),
                                                ts / 1000.0)
        found = await self._find_answered(partition, wanted) if wanted else set()
        self.batches += 1
        window.found.update((offset, rid) for rid, offset in wanted if offset in found)
        window.checked_to = high
        window.done = high >= end or not (found or admitted)
        _log.info("ingest: %s/%d [%d, %d): %d of %d requests read again were answered "
                  "before%s", self._topic, partition, low, high, len(found), len(wanted),
                  "" if window.done else "; the next batch is checked too")


def answered_record(partition: int, record: ConsumerRecord[Any, Any],
                    reply: Done | Error) -> Attempt | None:
    """The (request_id, intake offset) a reply answers, by its ``llmq-intake-record``
    header, when that names ``partition`` (an ``Identify`` of
    :func:`services.common.answered.answered`)."""
    for name, value in record.headers or ():
        if name != INTAKE_RECORD_HEADER:
            continue
        try:
            where, _, offset = bytes(value).decode().partition("/")
            if int(where) == partition:
                return reply.request_id, int(offset)
        except (TypeError, ValueError, UnicodeDecodeError):
            return None  # a header no ingest wrote (a value of None, not a number)
    return None


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
