"""One worker per slot: the slot's Kafka consumer group is the lock.

Slot p (partition p of ``llmq.assignments``) has its own consumer group
``{prefix}-worker-slot-{p}``. A worker joins it with ``subscribe`` (not a bare ``assign``:
only members of a group show up in ``describe_consumer_groups`` and get fenced) and with
:func:`slot_assignor`, a partition assignor that gives partition p to exactly one member,
the one that started first, and nothing to anyone else. So:

1. At start, :func:`check_slot_free` describes the group. A live member means another
   worker holds the slot: refuse with a message that names it (its client id is its
   worker id). A member with *our own* worker id is our previous incarnation that died
   without leaving the group: wait up to the session timeout for the broker to expire it.
2. Two workers that pass the check at the same moment both join; the group leader runs the
   assignor, which keeps p with the member that already holds it (each member says so in
   its join metadata), else gives it to the one that started first; the other is assigned
   nothing and refuses. So a running worker never loses its slot to a newcomer.
3. Offsets are committed in the slot's group; a member that lost the slot in a rebalance
   is fenced by the generation check of its commits, so a zombie cannot move the offset.

:func:`committed_position` reads the committed offset *and its metadata* (the finished
offsets above it, ``services.worker.core.offsets``) with the admin client, which is the
only aiokafka API that returns commit metadata.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)

from services.common.groups import group_members

_log = logging.getLogger(__name__)

#: Group protocol name; every member of a slot group must speak it.
PROTOCOL = "llmq-slot"


class SlotRefused(Exception):
    """This worker must not run: its slot is held, or does not exist."""


def slot_group(prefix: str, slot: int) -> str:
    """The consumer group that locks slot ``slot``."""
    return f"{prefix}-worker-slot-{slot}"


async def check_slot_free(admin: AIOKafkaAdminClient, group: str, slot: int, worker_id: str,
                          own_wait_s: float) -> None:
    """Return when the slot group has no live member; raise :class:`SlotRefused` otherwise.

    Members that carry our own worker id are waited out for up to ``own_wait_s``.
    """
    deadline = time.monotonic() + own_wait_s
    waited = False
    while True:
        members = await group_members(admin, group)
        if not members:
            return
        others = [m for m in members if m.client_id != worker_id]
        if others or time.monotonic() >= deadline:
            holder = (others or members)[0]
            raise SlotRefused(
                f"slot {slot} is already held by worker {holder.client_id!r} (Kafka consumer "
                f"group {group!r}, member {holder.member_id} from {holder.host}); refusing to "
                "start a second worker on the same slot. Drain that worker first, or pick "
                "another --slot."
            )
        if not waited:
            _log.info("slot %d: waiting up to %.0f s for a previous incarnation of %s to "
                      "leave group %s", slot, own_wait_s, worker_id, group)
            waited = True
        await asyncio.sleep(0.5)


async def committed_position(admin: AIOKafkaAdminClient, group: str,
                             tp: TopicPartition) -> tuple[int | None, str]:
    """(committed offset or None, its metadata) of ``tp`` in ``group``."""
    offsets = await admin.list_consumer_group_offsets(group, partitions=[tp])
    found = offsets.get(tp)
    if found is None or found.offset < 0:
        return None, ""
    return found.offset, found.metadata or ""


def encode_claim(worker_id: str, started_at: float, holding: bool = False) -> bytes:
    """What a member tells the assignor about itself when it (re)joins."""
    return json.dumps(
        {"worker_id": worker_id, "started_at": started_at, "holding": holding}
    ).encode()


def _claim_rank(user_data: bytes | None) -> tuple[bool, float]:
    """(not holding, start time): smaller keeps the slot; members without a claim last.

    Two members can both claim to hold the slot only when one of them was expired from the
    group (paused past the session timeout: a SIGSTOP, a VM freeze, a long GC) and the slot
    was handed to a newer process meanwhile. The newer one keeps it: the paused one's work
    is already being requeued or ended by the scheduler (worker fencing), and its
    heartbeats, older by ``started_at``, are ignored by every fleet view — if it took the
    slot back, the slot would be served by a worker nobody sees.
    """
    try:
        claim = json.loads(user_data or b"")
        holding, started = bool(claim.get("holding", False)), float(claim["started_at"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return True, math.inf
    if not math.isfinite(started):
        return not holding, math.inf
    return not holding, -started if holding else started


def pick_holder(claims: Mapping[str, bytes | None]) -> str:
    """The member that gets the slot: its current holder (the latest started of two, see
    :func:`_claim_rank`), else the earliest started, then the smallest member id."""
    return min(claims, key=lambda member: (*_claim_rank(claims[member]), member))


def slot_assignor(slot: int, worker_id: str, started_at: float) -> type[SlotAssignorBase]:
    """An assignor class for one worker: partition ``slot`` to one member only.

    aiokafka calls assignors through class methods, so this worker's claim lives on a class
    made for it; set ``holding = True`` on it once the slot is assigned, so that later
    rebalances keep the slot here.
    """
    return type("SlotAssignor", (SlotAssignorBase,),
                {"slot": slot, "worker_id": worker_id, "started_at": started_at,
                 "holding": False})


# aiokafka is typed Any here (mypy override), hence the ignore.
class SlotAssignorBase(AbstractPartitionAssignor):  # type: ignore[misc]
    """The slot lock's assignor; :func:`slot_assignor` makes one subclass per worker."""

    name = PROTOCOL
    version = 0
    slot: int = 0
    worker_id: str = ""
    started_at: float = 0.0
    holding: bool = False

    @classmethod
    def metadata(cls, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        claim = encode_claim(cls.worker_id, cls.started_at, cls.holding)
        return ConsumerProtocolMemberMetadata(cls.version, sorted(topics), claim)

    @classmethod
    def assign(
        cls, cluster: Any, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        holder = pick_holder({m: meta.user_data for m, meta in members.items()})
        out: dict[str, ConsumerProtocolMemberAssignment] = {}
        for member, meta in members.items():
            parts = [
                (topic, [cls.slot]) for topic in sorted(meta.subscription)
                if cls.slot in (cluster.partitions_for_topic(topic) or ())
            ] if member == holder else []
            out[member] = ConsumerProtocolMemberAssignment(cls.version, parts, b"")
        return out

    @classmethod
    def on_assignment(cls, assignment: ConsumerProtocolMemberAssignment) -> None:
        """Nothing to remember: the worker's rebalance listener sees the assignment."""
