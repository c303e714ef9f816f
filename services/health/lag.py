"""Queue depth and consumer lag per topic, from the broker's offsets (DESIGN.md: health reads
consumer lag).

Figures, per topic of the catalog:

- ``depth``: records retained, Σ over partitions of ``end - beginning`` offset;
- ``lag``: records the owning consumer group has not consumed, Σ ``end - max(beginning,
  committed)``; a partition without a committed offset counts whole (the group would
  start at its beginning). None when no group owns the topic (or none was found).

Owning groups (found by what they committed, not by name, so renamed apps are still found):

- request topics → the scheduler's group: ``--group`` if given, else the group with
  commits on the request topics (several: a name containing "scheduler" first, then the
  most consumed);
- ``<prefix>.intake`` → the ingest group, the same way with "ingest";
- ``<prefix>.assignments`` → per partition p, the group that committed on p (the worker
  slot groups ``<prefix>-worker-slot-<p>`` commit only their own partition); the topic's
  lag is the sum over partitions that have one.

Groups are listed once; those named after the prefix are read first and the rest only if a
role is still unresolved, which keeps a broker shared by many deployments (or tests) cheap.

The pure part (:func:`partition_lag`, :func:`pick_group`, :func:`topic_figures`) takes plain
offsets; :class:`LagInspector` gathers them with one admin client and one consumer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas.topics import catalog, request_topics
from services.common.kafka import make_consumer

_log = logging.getLogger(__name__)

#: {group: {TopicPartition: committed offset}} — only partitions with a commit.
Commits = Mapping[str, Mapping[TopicPartition, int]]


@dataclass(frozen=True, slots=True)
class Span:
    """Offsets of one partition: first retained, and next to be written."""

    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class SlotLag:
    """Lag of one partition of the assignments topic (one worker slot)."""

    partition: int
    group: str
    committed: int | None
    end: int
    lag: int

    def as_dict(self) -> dict[str, Any]:
        return {"partition": self.partition, "group": self.group,
                "committed": self.committed, "end": self.end, "lag": self.lag}


@dataclass(frozen=True, slots=True)
class TopicFigures:
    """Depth and lag of one topic (see the module docstring)."""

    topic: str
    role: str
    partitions: int
    depth: int
    end: int
    group: str | None
    lag: int | None
    slots: tuple[SlotLag, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic, "role": self.role, "partitions": self.partitions,
            "depth": self.depth, "end_offset": self.end, "group": self.group, "lag": self.lag,
            "slots": [s.as_dict() for s in self.slots],
        }


def partition_lag(span: Span, committed: int | None) -> int:
    """Records of the partition the group has not consumed (never negative)."""
    position = span.begin if committed is None else max(span.begin, committed)
    return max(0, span.end - position)


def pick_group(commits: Commits, topics: Iterable[str], hint: str) -> str | None:
    """The group that owns ``topics`` (see the module docstring), or None."""
    wanted = set(topics)
    progress: dict[str, int] = {}
    for group, offsets in commits.items():
        done = [off for tp, off in offsets.items() if tp.topic in wanted]
        if done:
            progress[group] = sum(done)
    if not progress:
        return None
    return min(progress, key=lambda g: (hint not in g, -progress[g], g))


def topic_figures(
    topic: str,
    role: str,
    spans: Mapping[TopicPartition, Span],
    group: str | None,
    commits: Commits,
) -> TopicFigures:
    """Depth and lag of ``topic`` from its partitions' spans and ``group``'s commits."""
    mine = sorted((tp, s) for tp, s in spans.items() if tp.topic == topic)
    depth = sum(s.end - s.begin for _, s in mine)
    end = sum(s.end for _, s in mine)
    lag: int | None = None
    if group is not None:
        offsets = commits.get(group, {})
        lag = sum(partition_lag(s, offsets.get(tp)) for tp, s in mine)
    return TopicFigures(topic, role, len(mine), depth, end, group, lag)


def slot_figures(
    topic: str, spans: Mapping[TopicPartition, Span], commits: Commits
) -> TopicFigures:
    """The assignments topic: lag per partition of the group that committed on it."""
    slots: list[SlotLag] = []
    mine = sorted((tp, s) for tp, s in spans.items() if tp.topic == topic)
    for tp, span in mine:
        owners = {g: offs[tp] for g, offs in commits.items() if tp in offs}
        if not owners:
            continue
        # Two groups on one slot (a renamed prefix?): the one that consumed most owns it.
        group = min(owners, key=lambda g: (-owners[g], g))
        slots.append(SlotLag(tp.partition, group, owners[group], span.end,
                             partition_lag(span, owners[group])))
    return TopicFigures(
        topic, "assignments", len(mine), sum(s.end - s.begin for _, s in mine),
        sum(s.end for _, s in mine), None,
        sum(s.lag for s in slots) if slots else None, tuple(slots),
    )


def assignment_slots(topics: Iterable[TopicFigures]) -> int | None:
    """Partitions of the assignments topic among ``topics``; None when it is not there."""
    return next((t.partitions for t in topics if t.role == "assignments"), None)


def topic_role(prefix: str, topic: str) -> str:
    """``<prefix>.requests.high.short`` → ``requests``; ``<prefix>.intake`` → ``intake``."""
    return topic.removeprefix(prefix + ".").split(".", 1)[0]


async def describe_partitions(
    admin: AIOKafkaAdminClient, topics: Sequence[str]
) -> dict[str, list[int]]:
    """Partition ids of those ``topics`` that exist.

    Lists first and describes only what exists: a metadata request naming a topic creates
    it on a broker with ``auto.create.topics.enable`` (the embedded dev broker has it), and
    a read-only caller must not create topics, least of all with default partitions.
    """
    existing = set(await admin.list_topics())
    wanted = [t for t in topics if t in existing]
    if not wanted:
        return {}
    described = await admin.describe_topics(wanted)
    return {
        t["topic"]: sorted(p["partition"] for p in t["partitions"])
        for t in described
        if not t["error_code"] and t["partitions"]
    }


async def offsets_by_topic(
    consumer: AIOKafkaConsumer, tps: Sequence[TopicPartition], *, end: bool
) -> dict[TopicPartition, int]:
    """Beginning (or end) offsets of ``tps``, one request per topic, all at once.

    One call over many topics new to the consumer learns their metadata one topic per
    retry (≈0.1 s each); concurrent calls per topic learn it in one round.
    """
    by_topic: dict[str, list[TopicPartition]] = {}
    for tp in tps:
        by_topic.setdefault(tp.topic, []).append(tp)
    ask = consumer.end_offsets if end else consumer.beginning_offsets
    found: dict[TopicPartition, int] = {}
    for offsets in await asyncio.gather(*(ask(group) for group in by_topic.values())):
        found.update(offsets)
    return found


class LagInspector:
    """Gathers offsets for :func:`topic_figures`; keep one open to ask repeatedly."""

    def __init__(self, bootstrap: str, prefix: str, assignment_partitions: int = 16) -> None:
        self.prefix = prefix
        self._bootstrap = bootstrap
        self._topics = [s.name for s in catalog(prefix, assignment_partitions)]
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None

    async def start(self, timeout_s: float = 10.0) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self._bootstrap, request_timeout_ms=5_000)
        consumer = make_consumer(self._bootstrap, request_timeout_ms=5_000)
        try:
            await asyncio.wait_for(admin.start(), timeout_s)
            await asyncio.wait_for(consumer.start(), timeout_s)
        except BaseException:
            await admin.close()
            await consumer.stop()
            raise
        self._admin, self._consumer = admin, consumer

    async def stop(self) -> None:
        admin, consumer, self._admin, self._consumer = self._admin, self._consumer, None, None
        if consumer is not None:
            await consumer.stop()
        if admin is not None:
            await admin.close()

    async def figures(
        self, scheduler_group: str | None = None
    ) -> tuple[list[TopicFigures], dict[str, str | None], list[str]]:
        """(figures per existing catalog topic, owning group per role, missing topics)."""
        if self._admin is None or self._consumer is None:
            raise RuntimeError("LagInspector.figures before start")
        parts = await describe_partitions(self._admin, self._topics)
        tps = [TopicPartition(t, p) for t in self._topics for p in parts.get(t, [])]
        begins = await offsets_by_topic(self._consumer, tps, end=False)
        ends = await offsets_by_topic(self._consumer, tps, end=True)
        spans = {tp: Span(begins[tp], ends[tp]) for tp in tps}
        requests = [t for t in request_topics(self.prefix) if t in parts]
        intake = f"{self.prefix}.intake"
        commits = await self._discover(requests, intake, scheduler_group)
        groups: dict[str, str | None] = {
            "scheduler": scheduler_group or pick_group(commits, requests, "scheduler"),
            "ingest": pick_group(commits, [intake], "ingest"),
        }
        out: list[TopicFigures] = []
        for topic in self._topics:
            if topic not in parts:
                continue
            role = topic_role(self.prefix, topic)
            if role == "assignments":
                out.append(slot_figures(topic, spans, commits))
                continue
            group = {"requests": groups["scheduler"], "intake": groups["ingest"]}.get(role)
            out.append(topic_figures(topic, role, spans, group, commits))
        return out, groups, [t for t in self._topics if t not in parts]

    async def _discover(
        self, requests: Sequence[str], intake: str, scheduler_group: str | None
    ) -> dict[str, dict[TopicPartition, int]]:
        assert self._admin is not None
        listed = sorted({g[0] for g in await self._admin.list_consumer_groups()
                         if len(g) < 2 or g[1] in ("consumer", "")})
        own = [g for g in listed if g.startswith((self.prefix + "-", self.prefix + "."))]
        if scheduler_group is not None and scheduler_group not in own:
            own.append(scheduler_group)
        commits = await self._commits(own)
        unresolved = (scheduler_group is None and requests
                      and pick_group(commits, requests, "") is None) or (
            pick_group(commits, [intake], "") is None)
        if unresolved:
            commits |= await self._commits([g for g in listed if g not in own])
        return commits

    async def _commits(self, groups: Sequence[str]) -> dict[str, dict[TopicPartition, int]]:
        assert self._admin is not None
        admin = self._admin
        gate = asyncio.Semaphore(16)

        async def one(group: str) -> tuple[str, dict[TopicPartition, int]]:
            async with gate:
                try:
                    offsets = await admin.list_consumer_group_offsets(group)
                except (KafkaError, TimeoutError) as exc:
                    # A group being deleted or rebalancing: skip it, the figures say None.
                    _log.debug("offsets of group %s unavailable: %r", group, exc)
                    return group, {}
            return group, {tp: om.offset for tp, om in offsets.items() if om.offset >= 0}

        found = await asyncio.gather(*(one(g) for g in groups))
        return {g: offs for g, offs in found if offs}
