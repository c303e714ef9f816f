"""``group_members`` against a stand-in admin client: a coordinator that answers with an
error code in the group's entry (loading, or moved) is not read as an empty group."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.errors import CoordinatorLoadInProgressError, GroupAuthorizationFailedError

from services.common.groups import GroupMember, group_members

GROUP = "llmq-worker-slot-0"
LOADING, AUTH = 14, 30  # COORDINATOR_LOAD_IN_PROGRESS, GROUP_AUTHORIZATION_FAILED


def _entry(error_code: int = 0, members: int = 0) -> dict[str, Any]:
    return {
        "error_code": error_code, "group": GROUP, "state": "Stable" if members else "",
        "members": [{"member_id": f"m{i}", "client_id": "w0", "client_host": "/127.0.0.1"}
                    for i in range(members)],
    }


class _Response:
    def __init__(self, entry: dict[str, Any]) -> None:
        self._entry = entry

    def to_object(self) -> dict[str, Any]:
        return {"groups": [self._entry]}


class _Admin:
    """Answers DescribeGroups with ``entries`` in turn (the last one from then on)."""

    def __init__(self, *entries: dict[str, Any]) -> None:
        self.entries, self.calls = list(entries), 0

    async def describe_consumer_groups(self, groups: list[str]) -> list[_Response]:
        self.calls += 1
        entry = self.entries.pop(0) if len(self.entries) > 1 else self.entries[0]
        return [_Response(entry)]


async def test_a_loading_coordinator_is_asked_again_not_read_as_an_empty_group() -> None:
    # The entry said COORDINATOR_LOAD_IN_PROGRESS with no state and no members: read as
    # "no live member", a live holder's slot looked free to a newcomer.
    admin = _Admin(_entry(LOADING), _entry(members=1))
    members = await group_members(admin, GROUP, retry_s=5.0)  # type: ignore[arg-type]
    assert members == [GroupMember("m0", "w0", "/127.0.0.1")] and admin.calls == 2


async def test_a_coordinator_loading_for_too_long_raises() -> None:
    with pytest.raises(CoordinatorLoadInProgressError):
        await group_members(_Admin(_entry(LOADING)), GROUP, retry_s=0.0)  # type: ignore[arg-type]


async def test_an_error_no_retry_mends_raises_at_once() -> None:
    admin = _Admin(_entry(AUTH))
    with pytest.raises(GroupAuthorizationFailedError):
        await group_members(admin, GROUP, retry_s=5.0)  # type: ignore[arg-type]
    assert admin.calls == 1


async def test_an_empty_group_has_no_members() -> None:
    empty = {**_entry(), "state": "Empty"}
    assert await group_members(_Admin(empty), GROUP) == []  # type: ignore[arg-type]
