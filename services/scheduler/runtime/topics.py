"""The topics the scheduler reads and writes, named once from the catalog (``schemas.topics``)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.common import Lane, Priority
from schemas.topics import catalog, find_topic, request_topic
from services.common.kafka import TopicRequest
from services.scheduler.runtime.flow import PAUSE_ORDER


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
