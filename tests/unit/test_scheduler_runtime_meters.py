"""RecentCancels: cancels remembered until their request shows up."""

from __future__ import annotations

import pytest

from services.scheduler.runtime.meters import RecentCancels


@pytest.mark.parametrize(
    ("issued_at", "tenant", "now", "matches"),
    [
        (100.0, "acme", 100.0, True),
        (100.0, "other", 100.0, False),  # a tenant mismatch is ignored
        (100.0, "acme", 699.0, True),
        (100.0, "acme", 700.0, False),  # memory_s after issued_at: forgotten
    ],
)
def test_recent_cancels(issued_at: float, tenant: str, now: float, matches: bool) -> None:
    cancels = RecentCancels(memory_s=600.0)
    assert cancels.add("r1", "acme", issued_at, now=issued_at)
    assert cancels.matches("r1", tenant, now) is matches


def test_recent_cancels_refuse_stale_commands_and_stay_bounded() -> None:
    cancels = RecentCancels(memory_s=10.0, capacity=2)
    assert not cancels.add("old", "t", issued_at=0.0, now=50.0)
    for rid in ("a", "b", "c"):
        cancels.add(rid, "t", 50.0, 50.0)
    assert len(cancels) == 2 and not cancels.matches("a", "t", 50.0)
    cancels.prune(100.0)
    assert len(cancels) == 0


def test_a_cancel_naming_another_tenant_does_not_erase_the_right_one() -> None:
    cancels = RecentCancels(memory_s=600.0)
    cancels.add("r1", "acme", 100.0, 100.0)
    cancels.add("r1", "mallory", 101.0, 101.0)  # ignored where it matters, and harmless
    assert cancels.matches("r1", "acme", 102.0)
    cancels.discard("r1", "acme")
    assert not cancels.matches("r1", "acme", 102.0)


def test_prune_forgets_from_the_oldest_read_until_one_holds() -> None:
    cancels = RecentCancels(memory_s=100.0)
    for rid, issued_at in (("a", 0.0), ("b", 10.0), ("late", 5.0), ("c", 50.0)):
        cancels.add(rid, "t", issued_at, now=issued_at + 1)
    cancels.prune(111.0)  # a (100) and b (110) expired; "late" (105) too, read after b
    assert len(cancels) == 1 and cancels.matches("c", "t", 111.0)
    assert not cancels.matches("late", "t", 111.0)


def test_a_cancel_stamped_far_ahead_does_not_hold_the_others_in_memory() -> None:
    # At the head of the pruning order, one cancel issued "next year" held every cancel
    # read after it until the capacity pushed them out.
    cancels = RecentCancels(memory_s=100.0)
    cancels.add("ahead", "t", issued_at=1e9, now=0.0)
    for i in range(10):
        cancels.add(f"r{i}", "t", issued_at=float(i), now=float(i))
    cancels.prune(200.0)  # past every one's memory, the one ahead counted from now + 60 s
    assert len(cancels) == 0


def test_a_cancel_from_a_clock_ahead_still_matches_its_request() -> None:
    # The expiry is clamped, not the issued_at matches() compares with the request's
    # created_at: a client 200 s ahead stamps both alike (a review of the clamp).
    cancels = RecentCancels(memory_s=600.0)
    cancels.add("r1", "t", issued_at=1_210.0, now=1_000.0)
    assert cancels.matches("r1", "t", 1_005.0, created_at=1_200.0)
