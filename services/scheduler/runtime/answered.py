"""Lost attempts that were answered after all: a ``worker_lost`` ending is checked first.

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

Replies are keyed by request_id (that is how the partition is found), so only records under
a wanted key are decoded: a busy tenant's partition is mostly other requests' chunks. On
this project's 2-core VM, 300,000 such records are read in ~0.9 s (2.1–2.6 s decoding every
one); the check gives up after ``send_timeout_s`` (10 s) and the attempt is then treated
as unanswered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from aiokafka import TopicPartition

from schemas.codec import SchemaError, decode
from schemas.messages import REPLY_ADAPTER
from schemas.replies import Done, Error
from services.common.kafka import key_partition, make_consumer
from services.common.replies import topic_partitions

_log = logging.getLogger(__name__)

#: Read this far before the assignment time (record timestamps are the sender's clock).
CLOCK_MARGIN_S = 60.0

Attempt = tuple[str, int]  # (request_id, attempt)


async def answered(
    bootstrap: str, wanted: Mapping[Attempt, tuple[str, bytes, float]], timeout_s: float
) -> set[Attempt]:
    """Of ``wanted`` ((request_id, attempt) -> (reply topic, record key, assigned_at)), the
    attempts with a terminal reply on their reply topic. Raises on a broker error or when
    ``timeout_s`` is up (the caller then ends them as before)."""
    return await asyncio.wait_for(_answered(bootstrap, wanted), timeout_s)


async def _answered(
    bootstrap: str, wanted: Mapping[Attempt, tuple[str, bytes, float]]
) -> set[Attempt]:
    since: dict[TopicPartition, float] = {}
    partitions: dict[str, list[int]] = {}
    for topic, key, assigned_at in wanted.values():
        if topic not in partitions:
            partitions[topic] = await topic_partitions(bootstrap, topic)
        parts = partitions[topic]
        tp = TopicPartition(topic, key_partition(key, parts))
        since[tp] = min(since.get(tp, assigned_at), assigned_at) - CLOCK_MARGIN_S
    found: set[Attempt] = set()
    keys = {key for _, key, _ in wanted.values()}
    consumer = make_consumer(bootstrap)
    await consumer.start()
    try:
        tps = list(since)
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        starts = await consumer.offsets_for_times(
            {tp: max(0, int(ts * 1000)) for tp, ts in since.items()})
        for tp in tps:
            start = starts.get(tp)
            consumer.seek(tp, ends[tp] if start is None else start.offset)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(*tps, timeout_ms=500)).values():
                for record in records:
                    if record.key not in keys:
                        continue  # another request's reply (replies are keyed by request)
                    try:
                        reply = decode(record.value, REPLY_ADAPTER)
                    except SchemaError:
                        continue
                    if isinstance(reply, Done | Error) \
                            and (reply.request_id, reply.attempt) in wanted:
                        found.add((reply.request_id, reply.attempt))
    finally:
        await consumer.stop()
    return found
