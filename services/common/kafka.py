"""Kafka client factories and topic administration, one place for every service.

Producers are idempotent with ``acks=all`` (DESIGN.md, "Semantics"): a decision's output is
acknowledged by the broker before its input offset is committed. Importing this module makes
every consumer in the process, Faust's included, read a record whose header key is not UTF-8
instead of failing on it (:mod:`services.common.kafka_records`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
    TopicAlreadyExistsError,
    UnknownProducerId,
    for_code,
)
from aiokafka.partitioner import DefaultPartitioner

from services.common import kafka_records

log = logging.getLogger(__name__)
kafka_records.install()

#: Records may be as large as a 1 MiB-character prompt once encoded (schemas.topics).
MAX_RECORD_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class TopicRequest:
    """What ``ensure_topics`` needs to know of a topic."""

    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)
    #: The partition count must be exactly this (co-partitioned topics: a tenant's intake
    #: and settle records, a table and its changelog); otherwise at least this.
    exact: bool = False


class TopicMismatchError(KafkaError):  # type: ignore[misc]  # aiokafka ships no types
    """Topics that exist with a partition count llmq cannot work with."""


class ProducerFailed(KafkaError):  # type: ignore[misc]  # aiokafka ships no types
    """The producer can no longer send: its sequence or id is broken, or its sender task
    ended. Only a new producer (a restarted process) sends again."""


#: Delivery errors after which an idempotent producer sends nothing more to a partition:
#: the broker and the producer disagree on its sequence (records the broker acknowledged
#: and then lost, possible with one replica), or on the producer itself (its id expired,
#: or another one took its epoch). aiokafka 0.14 fails the batch and carries on, never
#: resetting the producer id, so every later batch to that partition fails the same way.
FATAL_DELIVERY_ERRORS: tuple[type[BaseException], ...] = (
    OutOfOrderSequenceNumber, UnknownProducerId, ProducerFenced)


class Producer(AIOKafkaProducer):  # type: ignore[misc]  # aiokafka ships no types
    """An ``AIOKafkaProducer`` that keeps every topic it sends to in its metadata, and
    fails loudly once it can no longer send.

    Works around aiokafka 0.14's client: it starts out tracking "all topics", and the
    first send to a topic its metadata lacks (a reply topic created after the producer
    started) narrows the tracked set to that one topic; the next metadata refresh then
    drops every other topic. A batch already waiting for one of those has no leader any
    more, and the refreshes it triggers never bring it back: seen as a worker's
    ``first_token`` event stuck behind the first reply to a new ingest reply topic, so the
    request's ``done`` event never went out and its KV reservation stayed booked.
    Tracking each topic on its first send keeps the set a superset of what is in flight.

    A producer that can no longer send: a delivery that fails with one of
    :data:`FATAL_DELIVERY_ERRORS` (after it, every later batch to that partition fails too)
    or aiokafka's sender task ending on an error (every later send then fails). A service
    would live on without a voice: a worker whose heartbeats fail, fenced by its own lease;
    a scheduler whose placements never leave; ingest answering 503 for ever. Here
    :attr:`failure` is set, ``on_failure`` is called once (services exit, so a restart gets
    a new producer id) and every later ``send`` raises :class:`ProducerFailed`.

    ``must_deliver``: topics whose every record must get through, so that any failed
    delivery to one of them (an error no retry mends: an ACL, a topic's smaller size limit)
    is the producer's failure too. For the Faust apps' producers: Faust commits an offset
    once its flush returns, and the flush returns when a delivery failed as when it
    succeeded, so such a record would be committed as handled and lost.
    """

    def __init__(self, *, on_failure: Callable[[ProducerFailed], None] | None = None,
                 must_deliver: Callable[[str], bool] | None = None,
                 **options: Any) -> None:
        super().__init__(**options)
        self._tracked: set[str] = set()
        self._on_failure = on_failure
        self._must_deliver = must_deliver
        #: Why it can no longer send (None while it can).
        self.failure: ProducerFailed | None = None

    async def start(self) -> None:
        await super().start()
        self._sender.sender_task.add_done_callback(self._sender_ended)

    def _sender_ended(self, task: asyncio.Task[None]) -> None:
        # stop() cancels it, and aiokafka's routine then returns normally (it waits for
        # the requests in flight instead of re-raising): only an error is a failure.
        cause = None if task.cancelled() else task.exception()
        if cause is not None:
            self._fail(cause)

    def _delivered(self, topic: str, delivery: asyncio.Future[Any]) -> None:
        cause = None if delivery.cancelled() else delivery.exception()
        if cause is None:
            return
        if isinstance(cause, FATAL_DELIVERY_ERRORS):
            self._fail(cause)
        elif self._must_deliver is not None and self._must_deliver(topic):
            self._fail(cause, f"a record to {topic}, which must get through, failed")

    def _fail(self, cause: BaseException,
              what: str = "the Kafka producer can no longer send") -> None:
        if self.failure is not None:
            return
        self.failure = ProducerFailed(f"{what}: {cause!r}")
        self.failure.__cause__ = cause
        log.error("%s; nothing more can be sent from this process until it restarts",
                  self.failure)
        if self._on_failure is not None:
            self._on_failure(self.failure)

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None:  # a new instance each time: no traceback piles up
            raise ProducerFailed(str(self.failure)) from self.failure.__cause__
        if topic not in self._tracked:
            track_topics(self, [topic])
        delivery = await super().send(topic, *args, **kwargs)
        delivery.add_done_callback(functools.partial(self._delivered, topic))
        return delivery


def exit_now(exc: ProducerFailed) -> None:
    """``on_failure`` of the Faust services' producers: exit at once, status 1, without
    the graceful stop. That stop commits the offsets of the records handled so far, and
    Faust's flush before a commit returns when a delivery *failed* as when it succeeded:
    an admission whose output never reached Kafka would be committed as done. Exiting
    here, everything not committed is redelivered to the restarted process (or another
    replica)."""
    log.critical("%s: exiting (status 1) so that a restart gets a producer that sends", exc)
    logging.shutdown()
    os._exit(1)


def track_topics(producer: AIOKafkaProducer, topics: Iterable[str]) -> None:
    """Add ``topics`` to the metadata ``producer``'s client keeps (see :class:`Producer`).

    For producers we do not build ourselves (Faust's), call it right after they start with
    every topic the service writes to; a topic added later is then added to the set, not
    swapped in for it.
    """
    tracked = getattr(producer, "_tracked", None)
    for topic in topics:
        producer.client.add_topic(topic)
        if tracked is not None:
            tracked.add(topic)


def make_producer(bootstrap: str, *,
                  on_failure: Callable[[ProducerFailed], None] | None = None,
                  **overrides: Any) -> Producer:
    """An idempotent producer, ``acks=all``, small linger so replies stream promptly.
    ``on_failure``: called once if it can no longer send (see :class:`Producer`)."""
    options: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": 2,
        "request_timeout_ms": 15_000,
        "max_request_size": MAX_RECORD_BYTES,
    }
    options.update(overrides)
    return Producer(on_failure=on_failure, **options)


def make_consumer(bootstrap: str, *topics: str, **overrides: Any) -> AIOKafkaConsumer:
    """A consumer that accepts the largest records the catalog allows; no auto commit."""
    options: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": MAX_RECORD_BYTES,
        "fetch_max_bytes": 2 * MAX_RECORD_BYTES,
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


Batches = dict[TopicPartition, list[ConsumerRecord[Any, Any]]]


def key_partition(key: bytes, partitions: Sequence[int]) -> int:
    """The partition our producers (aiokafka's default, Java-compatible murmur2) give
    ``key`` among ``partitions``."""
    chosen: int = DefaultPartitioner()(key, list(partitions), list(partitions))
    return chosen


async def fetch_forever(
    consumer: AIOKafkaConsumer, timeout_ms: int, what: str
) -> AsyncIterator[Batches]:
    """``consumer.getmany()`` in a loop, until the caller is cancelled. A failed fetch is
    logged and retried after 0.5 s: aiokafka reconnects by itself, so it is not fatal."""
    while True:
        try:
            batches = await consumer.getmany(timeout_ms=timeout_ms)
        except KafkaError:
            log.warning("%s: fetch failed", what, exc_info=True)
            await asyncio.sleep(0.5)
            continue
        yield batches


async def broker_answers(bootstrap: str, timeout_s: float = 3.0) -> bool:
    """True when a broker at ``bootstrap`` answers a metadata request within the timeout."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2_000)
    # A refused connection is the answer here, not an error worth a log line per retry.
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        await asyncio.wait_for(admin.list_topics(), timeout_s)
    except (KafkaError, OSError, TimeoutError, ValueError):  # ValueError: a bad address
        return False
    finally:
        await admin.close()
        quiet.setLevel(level)
    return True


async def wait_for_group_coordinator(bootstrap: str, timeout_s: float = 60.0) -> bool:
    """Wait until the broker can coordinate consumer groups; True when it can.

    A fresh broker creates ``__consumer_offsets`` on the first group lookup and answers
    "coordinator not available" meanwhile; asking once here, at start, spares every service
    that transient error (a worker's slot check would otherwise refuse to start).
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000)
    deadline = asyncio.get_running_loop().time() + timeout_s
    await asyncio.wait_for(admin.start(), timeout_s)
    try:
        while True:
            try:
                await admin.describe_consumer_groups(["llmq-coordinator-probe"])
                return True
            except KafkaError:
                if asyncio.get_running_loop().time() >= deadline:
                    return False
                await asyncio.sleep(0.5)
    finally:
        await admin.close()


async def ensure_topics(
    bootstrap: str, topics: Iterable[TopicRequest], timeout_s: float = 30.0, *,
    replication_factor: int = 1,
) -> list[str]:
    """Create the topics that do not exist yet; returns the names created. Idempotent.

    Returns once every requested topic has all its partitions led: a client that looks up
    a topic the moment it was created can get it without partitions, and Faust, for one,
    then refuses to write a table's changelog until its next metadata refresh (minutes).
    A topic that exists with fewer partitions than needed is refused
    (:class:`TopicMismatchError`); one with fewer replicas than ``replication_factor`` is
    only warned of (Kafka does not add replicas to a topic by itself; see
    :func:`_warn_replicas`).
    """
    wanted = list(topics)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15_000)
    await asyncio.wait_for(admin.start(), timeout_s)
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        existed: set[str] = set()  # made by another process between list and create
        if missing:
            new = [
                NewTopic(
                    name=t.name,
                    num_partitions=t.partitions,
                    replication_factor=replication_factor,
                    topic_configs=t.config,
                )
                for t in missing
            ]
            try:
                existed = _raise_topic_errors(
                    await asyncio.wait_for(admin.create_topics(new), timeout_s))
            except TopicAlreadyExistsError:
                existed = {t.name for t in missing}
            if existed:
                log.debug("topics created concurrently: %s", sorted(existed))
        created = [t for t in missing if t.name not in existed]
        await asyncio.wait_for(_until_led(admin, [t.name for t in wanted]), timeout_s)
        if missing:
            await asyncio.wait_for(
                _until_served(bootstrap, admin, [t.name for t in missing]), timeout_s)
        # Checked: what existed, and what another process made meanwhile (a broker that
        # creates topics on first use makes them with its own partition count: found by
        # an audit, such an intake topic of one partition passed as made by llmq).
        found = [t for t in wanted if t not in created]
        if found:
            described = await asyncio.wait_for(
                admin.describe_topics([t.name for t in found]), timeout_s)
            _check_partitions(found, described)
            _warn_replicas(described, replication_factor)
        return [t.name for t in created]
    finally:
        await admin.close()


def _check_partitions(wanted: Sequence[TopicRequest], described: Any) -> None:
    """Raise :class:`TopicMismatchError` for topics made (by something else, or with other
    settings) with fewer partitions than llmq needs, or another count where it must match:
    an intake topic of 1 partition had ingest move each record to its tenant's partition
    for ever."""
    have = {d["topic"]: len(d["partitions"]) for d in described if not d["error_code"]}
    wrong = [
        f"{t.name} has {have[t.name]} partition(s), llmq needs "
        f"{'' if t.exact else 'at least '}{t.partitions}"
        for t in wanted
        if t.name in have and (have[t.name] < t.partitions
                               or (t.exact and have[t.name] != t.partitions))
    ]
    if wrong:
        raise TopicMismatchError(
            "; ".join(wrong) + ". They were made by something else (a broker that creates "
            "topics on first use?) or with other settings (LLMQ_ASSIGNMENT_PARTITIONS): "
            "delete them and let llmq create them, or set llmq's settings to match")


def _warn_replicas(described: Any, replication_factor: int) -> None:
    """Log topics that exist with fewer replicas than ``replication_factor`` asks for: made
    before it was raised (LLMQ_REPLICATION_FACTOR defaults to 1), they keep one broker's
    copy, and ``acks=all`` then means that broker's disk only. Not an error: the service
    works as before, and raising the count is a reassignment the operator plans."""
    short = sorted(
        f"{d['topic']} ({min(len(p['replicas']) for p in d['partitions'])})"
        for d in described
        if not d["error_code"] and d["partitions"]
        and min(len(p["replicas"]) for p in d["partitions"]) < replication_factor
    )
    if short:
        log.warning(
            "%d topic(s) have fewer replicas than LLMQ_REPLICATION_FACTOR=%d: %s. They were "
            "made before it was set; raise them with kafka-reassign-partitions.sh "
            "(llmq does not change an existing topic)",
            len(short), replication_factor, ", ".join(short))


async def topic_exists(bootstrap: str, name: str, timeout_s: float = 10.0) -> bool:
    """Whether topic ``name`` exists (never creates it)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15_000)
    await asyncio.wait_for(admin.start(), timeout_s)
    try:
        return name in set(await asyncio.wait_for(admin.list_topics(), timeout_s))
    finally:
        await admin.close()


def _raise_topic_errors(response: Any) -> set[str]:
    """aiokafka returns CreateTopics' per-topic errors without raising them: a topic the
    broker refused (ACLs, a create policy) would only show as a timeout waiting for it.
    Raise the first one no retry mends, as its own error class; return the topics that
    already existed (made by someone else meanwhile)."""
    existed: set[str] = set()
    for entry in getattr(response, "topic_errors", ()):
        name, code = entry[0], entry[1]
        if code == TopicAlreadyExistsError.errno:
            existed.add(name)
            continue
        error = for_code(code)
        # A retriable one (the controller moved, a slow create) is left to the wait for
        # the topic's leaders that follows, as before.
        if code != 0 and not error.retriable:
            detail = entry[2] if len(entry) > 2 and entry[2] else "refused"
            raise error(f"creating topic {name!r}: {detail}")
    return existed


async def _until_served(bootstrap: str, admin: AIOKafkaAdminClient, names: list[str]) -> None:
    """Wait until the leader of every partition of topics ``names`` (led: ``_until_led``)
    answers for it. The broker names a new partition's leader in its metadata a moment
    before that leader serves it: services started then logged aiokafka's
    ``NotLeaderForPartitionError`` (as an error, retried) for their first offset lookups.
    aiokafka's ``end_offsets`` retries it quietly."""
    described = await admin.describe_topics(names)
    tps = [TopicPartition(d["topic"], p["partition"]) for d in described
           for p in d["partitions"]]
    consumer = make_consumer(bootstrap)
    try:
        await consumer.start()
        await consumer.end_offsets(tps)
    finally:
        await consumer.stop()


async def _until_led(admin: AIOKafkaAdminClient, names: list[str]) -> None:
    """Poll the broker until every topic in ``names`` exists and each partition has a leader."""
    while names:
        described = await admin.describe_topics(names)
        names = [
            d["topic"] for d in described
            if d["error_code"] != 0 or not d["partitions"]
            or any(p["error_code"] != 0 or p["leader"] < 0 for p in d["partitions"])
        ]
        if names:
            await asyncio.sleep(0.05)
