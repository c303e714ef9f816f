"""OrderedAcks (acks strictly in offset order) and PauseLadder (lowest topics pause first)."""

from __future__ import annotations

import pytest

from services.scheduler.runtime.flow import PAUSE_ORDER, OrderedAcks, PauseLadder


@pytest.mark.parametrize(
    ("received", "done", "released"),
    [
        ([0, 1, 2], [0, 1, 2], [0, 1, 2]),
        ([0, 1, 2], [2, 1], []),  # 0 still pending: nothing may be acked
        ([0, 1, 2], [2, 1, 0], [0, 1, 2]),  # the head finishing releases the run behind it
        ([0, 1, 2, 3], [1, 0, 3], [0, 1]),
        ([5, 9, 12], [9, 5], [5, 9]),  # gaps in offsets (compaction, retention) are fine
    ],
)
def test_acks_are_released_in_offset_order(
    received: list[int], done: list[int], released: list[int]
) -> None:
    acks: OrderedAcks[str] = OrderedAcks()
    for offset in received:
        assert acks.received("tp", offset, f"h{offset}")
    out: list[str] = []
    for offset in done:
        out.extend(acks.done("tp", offset))
    assert out == [f"h{o}" for o in released]
    assert acks.outstanding("tp") == len(received) - len(released)


def test_duplicates_and_forgotten_partitions() -> None:
    acks: OrderedAcks[str] = OrderedAcks()
    assert acks.next_offset("a") is None
    assert acks.received("a", 3, "x")
    assert not acks.received("a", 3, "again")  # redelivered after a seek
    assert not acks.received("a", 2, "older")
    assert acks.next_offset("a") == 4
    assert acks.received("b", 0, "y")
    acks.forget(["a"])  # revoked: its records go to the new owner
    assert acks.done("a", 3) == []
    assert acks.next_offset("a") is None
    assert acks.done("b", 0) == ["y"]
    assert acks.done("b", 0) == []  # done twice: nothing more
    assert acks.outstanding() == 0


def test_pause_thresholds_run_from_low_long_to_high_short() -> None:
    ladder = PauseLadder(1_000, band=0.1, hysteresis=0.05)
    assert [ladder.pause_at[k] for k in PAUSE_ORDER] == [900, 920, 940, 960, 980, 1000]
    assert [ladder.resume_below[k] for k in PAUSE_ORDER] == [850, 870, 890, 910, 930, 950]


@pytest.mark.parametrize(
    ("sizes", "paused"),
    [
        ([0], set()),
        ([899], set()),
        ([900], {("low", "long")}),
        ([945], {("low", "long"), ("low", "short"), ("normal", "long")}),
        ([1_000], set(PAUSE_ORDER)),
        ([1_000, 949], set(PAUSE_ORDER) - {("high", "short")}),  # hysteresis: 949 < 950
        ([1_000, 860], {("low", "long")}),
        ([1_000, 849], set()),
        ([900, 880], {("low", "long")}),  # below the pause point, above the resume point
    ],
)
def test_pause_ladder_with_hysteresis(sizes: list[int], paused: set[tuple[str, str]]) -> None:
    ladder = PauseLadder(1_000, band=0.1, hysteresis=0.05)
    for size in sizes:
        ladder.update(size)
    assert ladder.paused == paused


def test_pause_ladder_reports_transitions_in_pause_order() -> None:
    ladder = PauseLadder(10, band=0.0, hysteresis=0.1)
    paused, resumed = ladder.update(10)
    assert paused == list(PAUSE_ORDER) and resumed == []
    assert ladder.update(10) == ([], [])
    paused, resumed = ladder.update(0)
    assert paused == [] and resumed == list(PAUSE_ORDER)


def test_tiny_bounds_still_pause() -> None:
    ladder = PauseLadder(1, band=0.1, hysteresis=0.05)
    ladder.update(1)
    assert ladder.paused == set(PAUSE_ORDER)
    ladder.update(0)
    assert ladder.paused == set()


def test_a_partition_holding_too_many_records_behind_a_waiting_head_is_over_until_it_drains(
) -> None:
    acks: OrderedAcks[int] = OrderedAcks()
    for offset in range(10):  # offset 0 waits; 1..9 are done behind it, held
        acks.received("p0", offset, offset)
        if offset:
            assert acks.done("p0", offset) == []
    acks.received("p1", 0, 0)
    assert acks.over(limit=10, resume_below=5) == {"p0"}  # p1's one record is fine
    assert acks.outstanding("p0") == 10
    acks.received("p0", 10, 10)
    assert acks.done("p0", 0) == list(range(10))  # the head is done: they all go
    assert acks.over(limit=10, resume_below=5) == set()
    for offset in range(11, 20):
        acks.received("p0", offset, offset)
    assert acks.over(limit=10, resume_below=5) == {"p0"}  # 10 held again
    acks.done("p0", 10)
    acks.done("p0", 11)
    acks.done("p0", 12)
    acks.done("p0", 13)
    assert acks.outstanding("p0") == 6 and acks.over(limit=10, resume_below=5) == {"p0"}
    acks.done("p0", 14)
    assert acks.outstanding("p0") == 5 and acks.over(limit=10, resume_below=5) == {"p0"}
    acks.done("p0", 15)
    assert acks.over(limit=10, resume_below=5) == set()  # fewer than 5 at last
    acks.forget(["p0"])
    assert acks.over(limit=1, resume_below=1) == {"p1"}
