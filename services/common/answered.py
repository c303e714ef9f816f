"""Whether a request already has a terminal reply: read back from its reply partition.

Two callers. The scheduler checks a lost attempt before it ends it ``worker_lost``
(below). Ingest checks an intake record it may be reading a second time
(:mod:`services.ingest.redelivery`): its answers carry the intake record they answer in a
header, and an ``identify`` function of its own reads it.

Lost attempts that were answered after all: a ``worker_lost`` ending is checked first.

A worker sends an attempt's terminal reply, waits for the broker's ack, and only then sends
the terminal event (``services.worker.runner``: ``event.done`` means "the reply is
durable"). A worker killed between the two leaves a durable terminal reply that the
scheduler never hears of: the attempt still looks active and streamed, and ending it
``worker_lost`` (dead worker, or a restarted one whose earlier process held it) gives the
client a second terminal. The same happens when a scheduler is killed between its own
``worker_lost`` reply and event: its successor ends the attempt again.

So before a ``worker_lost`` reply goes out, :func:`answered` reads the request's reply
partition from shortly before the attempt was assigned to its end; an attempt with a
terminal there (``done`` or ``error``, any sender) gets only its terminal event (the log,
the ledger and every replica learn that it ended), not a second reply.

How it reads, so that a busy partition costs as little as it can:

* Replies are keyed by request_id (that is how the partition is found), so only records
  under a wanted key are decoded: a busy tenant's partition is mostly other requests'
  chunks.
* Newest first: the partition is read in windows going back from its end (10,000 records,
  then 4× more each time). A terminal whose event went missing was written just before its
  sender died, a few seconds before the check, so it is in the first window however long
  the attempt ran; a partition is read no further back once all of its wanted attempts
  are found.
* The check stops after ``timeout_s`` (``send_timeout_s``, 10 s) and keeps what it found
  by then: those attempts are answered, the rest are treated as unanswered (which they
  are, unless their terminal lies further back than the check could read).
* The reply topics are described once, together, without waiting for any: a topic that
  cannot be described (deleted, refused) leaves its attempts unanswered and the others
  are read (waiting up to 30 s for such a topic, the lookup outlasted the whole check,
  and an answered attempt checked beside it got a second terminal).

Measured on this project's 2-core VM (one partition, 300,201 records, the wanted terminal
200 records from the end): the whole partition reads in 0.6–0.8 s; the terminal alone is
found in 0.03–0.06 s (10,000 records read); with a 0.4 s limit the old oldest-first read
found nothing, this one finds it with the partition two-thirds read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas.codec import SchemaError, decode
from schemas.messages import REPLY_ADAPTER
from schemas.replies import Done, Error
from services.common.kafka import key_partition, make_consumer

_log = logging.getLogger(__name__)

#: Read this far before the assignment time (record timestamps are the sender's clock).
CLOCK_MARGIN_S = 60.0
#: Records in the first window read back from a partition's end; each next one is 4× larger.
FIRST_WINDOW = 10_000

Attempt = tuple[str, int]  # (request_id, attempt)
#: The wanted key a terminal reply answers (None: none), from its record and its message.
Identify = Callable[["ConsumerRecord[Any, Any]", Done | Error], Attempt | None]


def by_attempt(record: ConsumerRecord[Any, Any], reply: Done | Error) -> Attempt:
    """The scheduler's keys: a terminal answers its own (request_id, attempt)."""
    return (reply.request_id, reply.attempt)


@dataclass
class Answered:
    """What a check found: ``found`` are answered; ``complete`` is False when the check
    stopped (time up, broker error) before it read every wanted partition back to the
    attempts' assignment."""

    found: set[Attempt] = field(default_factory=set)
    complete: bool = False
    records_read: int = 0


async def answered(
    bootstrap: str,
    wanted: Mapping[Attempt, tuple[str, bytes, float]],
    timeout_s: float,
    first_window: int = FIRST_WINDOW,
    *,
    identify: Identify = by_attempt,
    margin_s: float = CLOCK_MARGIN_S,
) -> Answered:
    """Of ``wanted`` ((request_id, attempt) -> (reply topic, record key, assigned_at)), the
    attempts with a terminal reply on their reply topic, as far as ``timeout_s`` allowed.
    ``identify`` names the key a terminal answers (:func:`by_attempt`: its attempt); each
    partition is read back to ``margin_s`` before the earliest time of its keys. Never
    raises: a broker error is logged and ends the check where it stands."""
    result = Answered()
    try:
        await asyncio.wait_for(
            _read(bootstrap, wanted, first_window, result, identify, margin_s), timeout_s)
    except TimeoutError:
        pass
    except Exception:
        _log.warning("the reply-topic check failed", exc_info=True)
    return result


async def _read(bootstrap: str, wanted: Mapping[Attempt, tuple[str, bytes, float]],
                first_window: int, result: Answered, identify: Identify,
                margin_s: float) -> None:
    since: dict[TopicPartition, float] = {}
    todo: dict[TopicPartition, set[Attempt]] = {}
    partitions = await _partitions(bootstrap, {topic for topic, _, _ in wanted.values()})
    for attempt, (topic, key, assigned_at) in wanted.items():
        if not partitions.get(topic):
            continue  # not described: unanswered, as far as this check can tell
        tp = TopicPartition(topic, key_partition(key, partitions[topic]))
        since[tp] = min(since.get(tp, assigned_at), assigned_at - margin_s)
        todo.setdefault(tp, set()).add(attempt)
    keys = {key for _, key, _ in wanted.values()}
    consumer = make_consumer(bootstrap)
    await consumer.start()
    try:
        tps = list(since)  # assigned one at a time below: no fetch before its seek
        ends = await consumer.end_offsets(tps)
        starts = await consumer.offsets_for_times(
            {tp: max(0, int(ts * 1000)) for tp, ts in since.items()})
        for tp in tps:
            start = starts.get(tp)
            low = ends[tp] if start is None else start.offset
            consumer.assign([tp])
            await _read_back(consumer, tp, low, ends[tp], first_window, keys, todo[tp], result,
                             identify)
        result.complete = all(partitions.get(topic) for topic, _, _ in wanted.values())
    finally:
        await consumer.stop()


async def _partitions(bootstrap: str, topics: set[str]) -> dict[str, list[int]]:
    """Partition ids of each of ``topics`` that the broker describes (a topic it does not
    know, or refuses, is left out). Listed first, and only what exists is described: a
    metadata request naming a topic creates it on a broker with
    ``auto.create.topics.enable``, and a reply topic can be a name a tenant chose."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        described = await admin.describe_topics(sorted(topics & existing)) \
            if topics & existing else []
    finally:
        await admin.close()
    found: dict[str, list[int]] = {}
    for t in described:
        if t["topic"] in topics and not t["error_code"] and t["partitions"]:
            found[t["topic"]] = sorted(p["partition"] for p in t["partitions"])
    missing = topics - found.keys()
    if missing:
        _log.warning("reply topic(s) %s could not be described: their requests count as "
                     "unanswered", ", ".join(sorted(missing)))
    return found


async def _read_back(consumer: AIOKafkaConsumer, tp: TopicPartition, low: int, high: int,
                     window: int, keys: set[bytes], todo: set[Attempt],
                     result: Answered, identify: Identify = by_attempt) -> None:
    """Terminals of ``todo`` in offsets [low, high) of ``tp``, newest window first; found
    attempts move from ``todo`` to ``result.found`` as they are seen."""
    top = high
    while todo and top > low:
        bottom = max(low, top - window)
        consumer.seek(tp, bottom)
        while todo and await consumer.position(tp) < top:
            for record in (await consumer.getmany(tp, timeout_ms=500)).get(tp, []):
                if record.offset >= top:
                    break  # the window above, already read
                result.records_read += 1
                if record.key not in keys:
                    continue  # another request's reply (replies are keyed by request)
                try:
                    reply = decode(record.value, REPLY_ADAPTER)
                except SchemaError:
                    continue
                if not isinstance(reply, Done | Error):
                    continue
                attempt = identify(record, reply)
                if attempt in todo:
                    todo.discard(attempt)
                    result.found.add(attempt)
        top, window = bottom, window * 4
