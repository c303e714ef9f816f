"""The topics one ingest instance uses, named once from the catalog (``schemas.topics``).

Besides catalog topics, ingest owns two of its own:

- its reply topic ``reply_topic(prefix, "ingest-<instance>")``, where the replies of the
  requests it took over HTTP arrive (a catalog reply spec);
- the internal settle topic ``<app id>-settle`` (named like Faust's own internal topics,
  ``<app id>-<table>-changelog``): terminal events re-keyed by tenant, so that the tenant's
  bucket is settled on the partition that owns it. It has as many partitions as
  ``llmq.intake``, which both tables share.

It also creates the changelogs of its two Faust tables (:data:`TABLES`) before Faust
starts, with the partitions Faust expects: Faust would create them too, but a consumer
that looks them up the same instant can see them without partitions, and Faust then
refuses every table write (``PartitionsMismatch``) until its next metadata refresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from schemas.topics import INSTANCE_REPLIES, TopicSpec, catalog, find_topic, reply_spec
from services.common.faust_app import leader_topic
from services.common.kafka import TopicRequest

#: Ingest's Faust tables; each has the changelog ``<app id>-<table>-changelog``.
TABLES: Final = ("buckets", "reservations")


@dataclass(frozen=True, slots=True)
class IngestTopics:
    """Names (and the partition count the tables follow) for one ingest instance."""

    prefix: str
    intake: str
    events: str
    heartbeats: str
    assignments: str
    status: str
    control: str
    deadletter: str
    settle: str
    reply: str
    changelogs: tuple[str, ...]
    #: Faust's leader-assignor topic of the app (created up front, like the changelogs).
    leader: TopicRequest
    #: Partitions of intake = of the settle topic = of both tables' changelogs.
    partitions: int
    assignment_partitions: int

    @classmethod
    def of(
        cls, prefix: str, app_id: str, instance_id: str, assignment_partitions: int = 16
    ) -> IngestTopics:
        def name(suffix: str) -> TopicSpec:
            return find_topic(f"{prefix}.{suffix}", prefix, assignment_partitions)

        intake = name("intake")
        return cls(
            prefix=prefix,
            intake=intake.name,
            events=name("events").name,
            heartbeats=name("heartbeats").name,
            assignments=name("assignments").name,
            status=name("status").name,
            control=name("control").name,
            deadletter=name("deadletter").name,
            settle=f"{app_id}-settle",
            reply=reply_spec(prefix, INSTANCE_REPLIES + instance_id).name,
            changelogs=tuple(f"{app_id}-{table}-changelog" for table in TABLES),
            leader=leader_topic(app_id),
            partitions=intake.partitions,
            assignment_partitions=assignment_partitions,
        )

    def to_create(self) -> list[TopicRequest]:
        """Every topic ingest needs before it starts: the catalog, its reply topic, the
        settle topic, the tables' changelogs and Faust's leader topic."""
        specs = [
            *catalog(self.prefix, self.assignment_partitions),
            find_topic(self.reply, self.prefix, self.assignment_partitions),
        ]
        # A tenant's intake and settle records, and its table rows, share one partition
        # number: those topics' counts must be exactly ingest's.
        requests = [TopicRequest(s.name, s.partitions, s.config, exact=s.name == self.intake)
                    for s in specs]
        requests.append(TopicRequest(self.settle, self.partitions, {"cleanup.policy": "delete"},
                                     exact=True))
        requests += [TopicRequest(name, self.partitions, {"cleanup.policy": "compact"},
                                  exact=True) for name in self.changelogs]
        requests.append(self.leader)
        return requests

    def reply_request(self, topic: str) -> TopicRequest:
        """What creating a reply topic (a tenant's default one) takes."""
        spec = find_topic(topic, self.prefix, self.assignment_partitions)
        return TopicRequest(spec.name, spec.partitions, spec.config)
