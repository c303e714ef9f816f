"""FleetView: newest heartbeat per worker, liveness by each worker's own interval."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.workers import WorkerHeartbeat
from services.scheduler.runtime.fleet import FleetView, worker_state
from tests.builders_schemas import make_heartbeat

T = 1_000.0


def hb(worker_id: str = "w0", **changes: Any) -> WorkerHeartbeat:
    fields: dict[str, Any] = {
        "worker_id": worker_id, "started_at": T - 100, "seq": 1, "ts": T, "interval_s": 1.0,
        "model": "m", "model_version": None,
    }
    fields.update(changes)
    return make_heartbeat(**fields)


@pytest.mark.parametrize(
    ("interval_s", "age_s", "staleness", "alive"),
    [
        (1.0, 0.0, 3.0, True),
        (1.0, 3.0, 3.0, True),  # exactly three intervals: still alive
        (1.0, 3.01, 3.0, False),
        (5.0, 14.0, 3.0, True),  # a slow heartbeat is judged by its own interval
        (5.0, 15.5, 3.0, False),
        (0.5, 1.6, 3.0, False),
        (1.0, 1.5, 1.0, False),  # a tighter staleness setting
        (1.0, -2.0, 3.0, True),  # a worker's clock a little ahead: a small skew is fine
        (1.0, -3600.0, 3.0, False),  # an hour ahead: not "fresh" for another hour
    ],
)
def test_liveness_is_three_of_the_workers_own_intervals(
    interval_s: float, age_s: float, staleness: float, alive: bool
) -> None:
    fleet = FleetView(staleness)
    fleet.observe(hb(interval_s=interval_s))
    now = T + age_s
    assert fleet.is_alive("w0", now) is alive
    assert ("w0" in fleet.snapshot(now).workers) is alive


@pytest.mark.parametrize(
    ("clock_offset", "read_after_s", "now_after_read", "placeable", "may_be_alive"),
    [
        (0.0, 0.05, 2.9, True, True),       # in sync: both fresh
        (0.0, 0.05, 3.1, False, False),     # in sync: both stale, dead
        (-1.0, 0.05, 2.5, False, True),     # clock 1 s behind: ts-stale at 2.5, not dead
        (-1.0, 0.05, 3.01, False, False),   # ... until three intervals after we read it
        (10.0, 0.05, 0.1, False, True),     # 10 s ahead: not placeable, but not dead
        (10.0, 0.05, 3.01, False, False),   # ... once it falls silent for the bound
        (0.0, 2.0, 0.5, True, True),        # read late (consumer lag): ts rules placement
        (0.0, 2.0, 2.5, False, True),       # ... and the read time defers the death
    ],
)
def test_a_worker_is_declared_dead_only_when_stale_by_its_ts_and_by_our_clock(
    clock_offset: float, read_after_s: float, now_after_read: float, placeable: bool,
    may_be_alive: bool,
) -> None:
    """Placement fails closed on ``ts`` alone; loss needs ``ts`` and the time since the
    scheduler read the beat to be stale both, so a skewed worker clock cannot get a worker
    declared dead while its lease (counted on its own clock) still holds."""
    fleet = FleetView(3.0)
    created = T  # on the scheduler's clock; the beat carries the worker's
    fleet.observe(hb(ts=created + clock_offset), read_at=created + read_after_s)
    now = created + read_after_s + now_after_read
    assert fleet.is_alive("w0", now) is placeable
    assert ("w0" in fleet.snapshot(now).workers) is placeable
    assert fleet.may_be_alive("w0", now) is may_be_alive


@pytest.mark.parametrize(("heard_at", "may_be_alive"), [
    (T + 0.5, True),   # the reader stalled after T + 0.5: a newer beat may be unread
    (T + 3.0, True),   # read up to the bound: not silent long enough yet
    (T + 3.1, False),  # read past it with nothing new: silent, dead
    (T + 10.0, False),
])
def test_a_worker_is_judged_dead_only_as_far_as_the_heartbeats_were_read(
    heard_at: float, may_be_alive: bool,
) -> None:
    # Its lease is renewed by the broker's acks, not by this scheduler reading the beats:
    # a reader that stalls must not see the fleet go silent (two runs of one attempt).
    fleet = FleetView(3.0)
    fleet.observe(hb(ts=T), read_at=T, source=2)  # read from heartbeats partition 2
    assert fleet.may_be_alive("w0", T + 10.0, {2: heard_at, 5: T + 10.0}) is may_be_alive
    assert fleet.may_be_alive("w0", T + 10.0) is False  # with no reader to wait for


def test_one_partition_read_no_further_holds_back_only_its_own_workers() -> None:
    # A review of the first cut, which took the oldest time of every partition: one
    # partition whose leader went offline stopped every loss in the fleet, for good.
    fleet = FleetView(3.0)
    fleet.observe(hb("w-frozen", ts=T), read_at=T, source=0)
    fleet.observe(hb("w-dead", ts=T), read_at=T, source=1)
    heard = {0: T + 0.5, 1: T + 3600.0}  # partition 0 not fetched since T + 0.5
    assert fleet.may_be_alive("w-frozen", T + 3600.0, heard)
    assert not fleet.may_be_alive("w-dead", T + 3600.0, heard)
    fleet.observe(hb("w-unknown", ts=T), read_at=T)  # its partition not known: now
    assert not fleet.may_be_alive("w-unknown", T + 3600.0, heard)


@pytest.mark.parametrize(
    ("first", "second", "kept_seq"),
    [
        ((T - 100, 1), (T - 100, 2), 2),  # newer beat of the same process
        ((T - 100, 5), (T - 100, 2), 5),  # a late duplicate never rolls back
        ((T - 100, 500), (T - 1, 0), 0),  # a restarted process wins from its first beat
        ((T - 1, 0), (T - 100, 500), 0),  # ... and the old process's last beat loses
    ],
)
def test_newest_heartbeat_wins_by_started_at_then_seq(
    first: tuple[float, int], second: tuple[float, int], kept_seq: int
) -> None:
    fleet = FleetView()
    fleet.observe(hb(started_at=first[0], seq=first[1]))
    fleet.observe(hb(started_at=second[0], seq=second[1]))
    beat = fleet.get("w0")
    assert beat is not None and beat.seq == kept_seq


def test_unknown_and_forgotten_workers_are_dead() -> None:
    fleet = FleetView()
    assert not fleet.is_alive("ghost", T)
    fleet.observe(hb())
    assert fleet.forget("w0") and not fleet.forget("w0")
    assert not fleet.is_alive("w0", T) and fleet.state("w0") is None


def test_snapshot_holds_only_live_workers_and_the_core_agrees() -> None:
    fleet = FleetView()
    fleet.observe(hb("fast", interval_s=0.5, ts=T - 1.0))  # alive: 1.0 <= 1.5
    fleet.observe(hb("slow", interval_s=5.0, ts=T - 12.0))  # alive: 12 <= 15
    fleet.observe(hb("gone", interval_s=1.0, ts=T - 10.0))  # dead
    snap = fleet.snapshot(T)
    assert sorted(snap.workers) == ["fast", "slow"]
    assert all(snap.is_fresh(w) for w in snap.workers.values())


def test_worker_state_copies_the_heartbeat() -> None:
    beat = hb(pool="long", partition=7, kv_total_tokens=9_000, kv_free_tokens=4_000,
              running=3, waiting=1, max_num_seqs=8, draining=True, tokens_per_s=12.5)
    state = worker_state(beat)
    assert (state.pool, state.partition, state.kv_total_tokens, state.kv_free_tokens) == (
        "long", 7, 9_000, 4_000)
    assert (state.running, state.waiting, state.max_num_seqs, state.draining) == (3, 1, 8, True)
    assert state.heartbeat_ts == T and state.tokens_per_s == 12.5


def test_block_size_of_a_model() -> None:
    fleet = FleetView()
    assert fleet.block_size("m") is None
    fleet.observe(hb("a", block_size=16))
    fleet.observe(hb("b", block_size=32))
    fleet.observe(hb("c", block_size=64, model="other"))
    assert fleet.block_size("m") == 32


def test_block_size_is_the_live_workers_when_any_is_live() -> None:
    # A worker long gone, replayed from the compacted heartbeats with an odd block size,
    # must not round every request of the model up to it.
    fleet = FleetView()
    fleet.observe(hb("gone", block_size=16_384, ts=T))
    fleet.observe(hb("live", block_size=16, ts=T + 3_600))
    assert fleet.block_size("m", T + 3_600) == 16
    assert fleet.block_size("m") == 16_384  # a restore: no clock, every known one
    assert fleet.block_size("m", T + 7_200) == 16_384  # none live: every known one


def test_workers_long_silent_and_holding_nothing_are_forgotten() -> None:
    # Nothing writes a heartbeat tombstone: every worker id ever seen (a pod name per
    # restart) stayed, and each dispatch cycle walked them all.
    fleet = FleetView(3.0, recent_s=300.0)
    for i in range(1_000):
        fleet.observe(hb(f"old{i}", ts=T), read_at=T)
    fleet.observe(hb("held", ts=T), read_at=T)  # the log still holds work of it
    fleet.observe(hb("live", ts=T + 400.0), read_at=T + 400.0)
    assert fleet.prune(T + 299.0, keep=set()) == []  # still "recent": kept
    gone = fleet.prune(T + 400.0, keep={"held"})
    assert len(gone) == 1_000 and set(fleet.workers()) == {"held", "live"}
    assert list(fleet.snapshot(T + 400.0).workers) == ["live"]
