"""Live members of a Kafka consumer group, as the group coordinator describes them.

Used where a group stands for something besides consuming: a worker's slot lock
(``services.worker.slot``) and the scheduler replicas' turns (``services.scheduler.app``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    CoordinatorLoadInProgressError,
    GroupCoordinatorNotAvailableError,
    NotCoordinatorError,
    for_code,
)


@dataclass(frozen=True, slots=True)
class GroupMember:
    """A live member of a consumer group, as the broker describes it."""

    member_id: str
    client_id: str
    host: str


async def group_members(
    admin: AIOKafkaAdminClient, group: str, retry_s: float = 60.0
) -> list[GroupMember]:
    """Live members of ``group`` (none when it is empty, dead or unknown).

    A fresh broker has no group coordinator until ``__consumer_offsets`` exists, and a
    coordinator may be loading: those answers are transient, so they are retried for up to
    ``retry_s`` before the error is raised.
    """
    deadline = time.monotonic() + retry_s
    while True:
        try:
            groups = await _describe(admin, group)
            break
        except _TRANSIENT:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)
    members: list[GroupMember] = []
    for desc in groups:
        if desc["state"] not in ("Dead", "Empty"):
            members += [
                GroupMember(m["member_id"], m["client_id"], m["client_host"])
                for m in desc["members"]
            ]
    return members


_TRANSIENT = (GroupCoordinatorNotAvailableError, CoordinatorLoadInProgressError,
              NotCoordinatorError)


async def _describe(admin: AIOKafkaAdminClient, group: str) -> list[dict[str, Any]]:
    """``group``'s descriptions. A coordinator that is loading or moved answers with an
    error code in the group's entry (aiokafka raises only for finding the coordinator),
    with no state and no members: read as "empty", a live holder's slot looked free. Such
    an entry raises its error here, like the others."""
    found = []
    for response in await admin.describe_consumer_groups([group]):
        for desc in response.to_object()["groups"]:
            if desc["group"] != group:
                continue
            if desc["error_code"]:
                raise for_code(desc["error_code"])(f"describing consumer group {group!r}")
            found.append(desc)
    return found
