"""The topics the scheduler reads and writes, named once from the catalog (``schemas.topics``),
and the reply topics it makes on first use (:class:`ReplyTopics`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from schemas.common import Lane, Priority
from schemas.topics import catalog, find_topic, request_topic
from services.common.kafka import TopicRequest
from services.scheduler.runtime.flow import PAUSE_ORDER

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerTopics:
    """Names for one deployment (``prefix``) with ``assignment_partitions`` worker slots."""

    prefix: str
    assignment_partitions: int
    #: (priority, lane) -> request topic, in pause order (low.long first).
    requests: tuple[tuple[tuple[Priority, Lane], str], ...]
    heartbeats: str
    assignments: str
    events: str
    control: str
    status: str
    deadletter: str

    @classmethod
    def of(cls, prefix: str, assignment_partitions: int = 16) -> SchedulerTopics:
        def name(suffix: str) -> str:
            return find_topic(f"{prefix}.{suffix}", prefix, assignment_partitions).name

        return cls(
            prefix=prefix,
            assignment_partitions=assignment_partitions,
            requests=tuple((key, request_topic(prefix, *key)) for key in PAUSE_ORDER),
            heartbeats=name("heartbeats"),
            assignments=name("assignments"),
            events=name("events"),
            control=name("control"),
            status=name("status"),
            deadletter=name("deadletter"),
        )

    @property
    def request_names(self) -> list[str]:
        return [topic for _, topic in self.requests]

    def to_create(self) -> list[TopicRequest]:
        """The catalog (the service adds Faust's leader topic: ``leader_topic``)."""
        return [
            TopicRequest(s.name, s.partitions, s.config)
            for s in catalog(self.prefix, self.assignment_partitions)
        ]

    def reply_request(self, topic: str) -> TopicRequest | None:
        """What creating a reply topic takes; None for a name outside this prefix."""
        try:
            spec = find_topic(topic, self.prefix, self.assignment_partitions)
        except ValueError:
            return None
        return TopicRequest(spec.name, spec.partitions, spec.config)

    def own(self) -> frozenset[str]:
        """The topics of llmq's own records the scheduler writes (never given up: without
        them work runs twice or bookings leak); every other one it writes is a reply topic
        a client named."""
        return frozenset((self.assignments, self.events, self.control, self.status,
                          self.deadletter))


class ReplyTopics:
    """Reply topics are created on first use, in the background: a dispatch cycle never
    waits for it. :meth:`held` names the topics whose records must wait in the outbox
    meanwhile (the rest go on); a creation that failed is tried again, backing off to
    ``max_backoff_s`` (well within the outbox's time to give a reply up, so a broker back
    from an outage gets them made again in time). A topic a record to failed (deleted
    since?) is checked again (:meth:`recheck`). ``ensure`` makes one topic
    (``services.common.kafka.ensure_topics``).
    """

    def __init__(
        self,
        topics: SchedulerTopics,
        ensure: Callable[[TopicRequest], Awaitable[object]],
        on_ready: Callable[[], None],
        *,
        backoff_s: float = 1.0,
        max_backoff_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._topics = topics
        self._ensure = ensure
        self._on_ready = on_ready
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._own = {t.name for t in topics.to_create()}
        self._known = set(self._own)
        self._creating: dict[str, asyncio.Task[None]] = {}
        self._retry: dict[str, tuple[float, float]] = {}  # topic -> (not before, backoff)

    def held(self, wanted: Iterable[str]) -> set[str]:
        """The topics of ``wanted`` not known to exist yet; starts making them."""
        now = self._clock()
        held: set[str] = set()
        for topic in set(wanted) - self._known:
            request = self._topics.reply_request(topic)
            if request is None:  # not under llmq's prefix: someone else's to make
                self._known.add(topic)
                continue
            held.add(topic)
            if topic not in self._creating and now >= self._retry.get(topic, (0.0, 0.0))[0]:
                task = asyncio.create_task(self._create(topic, request),
                                           name=f"create-topic-{topic}")
                self._creating[topic] = task
        return held

    def recheck(self, topics: Iterable[str]) -> None:
        """Make sure these exist before their next record (llmq's own are made at start)."""
        self._known -= set(topics) - self._own

    async def stop(self) -> None:
        tasks = list(self._creating.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _create(self, topic: str, request: TopicRequest) -> None:
        try:
            await self._ensure(request)
        except Exception as exc:
            backoff = min(self._max_backoff_s, 2 * self._retry.get(topic, (0.0, 0.0))[1]
                          or self._backoff_s)
            self._retry[topic] = (self._clock() + backoff, backoff)
            _log.warning("scheduler: could not make reply topic %s (%s); its records wait, "
                         "and are given up after LLMQ_SCHEDULER_REPLY_GIVE_UP_S; trying "
                         "again in %.0f s", topic, exc, backoff)
        else:
            self._known.add(topic)
            self._retry.pop(topic, None)
        finally:
            self._creating.pop(topic, None)
            self._on_ready()
