"""Several scheduler replicas: each worker takes new work from one replica at a time
(filter ``replica-turn``), so replicas that place at the same moment from their own
requests never overcommit a worker between reading each other's placements back.

The two replicas are two real :class:`SchedulerState` (the live scheduler's state, no
Kafka); "reading back" is what the app does with every record of ``llmq.assignments``:
``observe_assignment`` on every replica.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from schemas.codec import decode
from schemas.messages import ASSIGNMENT_ADAPTER
from schemas.requests import Assignment
from services.scheduler import Ledger, PlacementContext, QueueConfig, Snapshot, build_pipeline
from services.scheduler.core.errors import ConfigError
from services.scheduler.policies.filters.replica_turn import (
    ReplicaTurn,
    factory,
    turn_began,
    turn_of,
)
from services.scheduler.runtime.results import RuntimeConfig
from services.scheduler.runtime.state import SchedulerState
from services.scheduler.runtime.turns import shared, turns_of
from services.scheduler.settings import SchedulerSettings
from tests.builders import make_request, make_worker
from tests.unit.test_scheduler_runtime_state import SCHED, T, admitted, beat, done

WORKERS = [f"w{i}" for i in range(4)]


def test_mid_slot_every_worker_is_exactly_one_replicas_turn_and_turns_rotate() -> None:
    for replicas in (2, 3):
        for worker in WORKERS:
            began = turn_began(worker, 100.0, 0.5)
            assert began <= 100.0 < began + 0.5
            owners = [turn_of(worker, began + 0.25 + k * 0.5, replicas, 0.5, 0.05)
                      for k in range(2 * replicas)]
            assert all(o is not None for o in owners)
            # The worker moves to the next replica each slot: every replica gets it once
            # per rotation.
            assert owners == [(owners[0] + k) % replicas  # type: ignore[operator]
                              for k in range(2 * replicas)]


def test_the_ends_of_a_turn_are_nobodys() -> None:
    began = turn_began("w0", 10.0, 0.5)
    assert turn_of("w0", began + 0.001, 2, 0.5, 0.05) is None  # the first 50 ms of a slot
    assert turn_of("w0", began + 0.04, 2, 0.5, 0.05) is None
    assert turn_of("w0", began + 0.051, 2, 0.5, 0.05) is not None
    assert turn_of("w0", began + 0.449, 2, 0.5, 0.05) is not None
    assert turn_of("w0", began + 0.46, 2, 0.5, 0.05) is None  # the last 50 ms
    assert turn_began("w0", began + 0.499, 0.5) == pytest.approx(began)
    assert turn_began("w0", began + 0.501, 0.5) == pytest.approx(began + 0.5)


def test_over_a_fleet_each_replica_has_about_its_share_at_any_moment() -> None:
    fleet = [f"worker-{i}" for i in range(1_000)]
    for now in (100.0, 100.25, 100.4):
        shares = Counter(turn_of(w, now, 4, 0.5, 0.05) for w in fleet)
        # Turns begin at different moments on different workers: at no moment is the
        # whole fleet between turns (it was, at every slot boundary, for 2 x 50 ms).
        assert 150 <= shares.pop(None) <= 250, shares  # 2 x guard / slot = 20 %
        assert set(shares) == {0, 1, 2, 3}
        assert all(150 <= n <= 250 for n in shares.values()), shares


def test_a_small_fleet_is_shared_between_two_replicas_most_of_the_time() -> None:
    # crc32 is linear: fake-0 ... fake-3 all had the same turns, so each of two replicas
    # had none of them 60 % of the time, and every request waited for the next slot.
    for fleet in (["fake-0", "fake-1", "fake-2", "fake-3"], WORKERS):
        instants = [100 + i * 0.001 for i in range(5_000)]
        for index in (0, 1):
            without = sum(all(turn_of(w, t, 2, 0.5, 0.05) != index for w in fleet)
                          for t in instants) / len(instants)
            assert without < 0.15, (fleet, index, without)


def test_a_worker_takes_work_in_a_turn_only_once_the_log_is_read_up_to_its_start() -> None:
    turn = ReplicaTurn(replicas=2, index=0)
    worker = make_worker("w0", kv_total_tokens=10_000, kv_free_tokens=10_000)
    began = turn_began("w0", 100.0, 0.5)
    if turn_of("w0", began + 0.25, 2, 0.5, 0.05) != 0:
        began += 0.5  # the next slot is replica 0's
    now = began + 0.25
    request = make_request("r1")

    def verdict(log_read_at: float) -> bool:
        snapshot = Snapshot.of([worker], now, log_read_at=log_read_at)
        return turn.accepts(worker, request, PlacementContext(snapshot, Ledger(), now))

    # Read before the turn began, or less than a guard after: the last turn's placements
    # may be missing (clocks apart, a slow write, the fetch's round trip); a guard after:
    # they are in.
    assert not verdict(began - 0.01)
    assert not verdict(began + 0.04)
    assert verdict(began + 0.05)
    assert verdict(math.inf)  # alone, or the simulator
    assert ReplicaTurn(replicas=2, index=1).accepts(
        worker, request, PlacementContext(Snapshot.of([worker], now), Ledger(), now)) is False


@pytest.mark.parametrize(
    ("params", "setting"),
    [
        ({"replicas": 2, "index": 2}, "params.replica-turn.index"),
        ({"replicas": 2.5}, "params.replica-turn.replicas"),
        ({"replicas": 2, "slot_s": 0.1, "guard_s": 0.05}, "params.replica-turn.guard_s"),
        ({"replicas": 2, "slot_s": 0}, "params.replica-turn.slot_s"),
        ({"replicas": 2, "guard_s": 0}, "params.replica-turn.guard_s"),
        ({"replicas": 2, "turns": 1}, "params.replica-turn.turns"),
    ],
)
def test_bad_parameters_are_refused_by_name(params: dict[str, object], setting: str) -> None:
    with pytest.raises(ConfigError) as refused:
        factory(params)
    assert refused.value.setting == setting


def test_settings_add_the_filter_only_for_several_replicas() -> None:
    auto = SchedulerSettings()  # from the consumer group: alone until it says otherwise
    assert auto.static_turns() is None and "replica-turn" not in str(auto.profile())
    assert "replica-turn" not in str(auto.profile((1, 0)))
    for settings, turns in ((SchedulerSettings(replicas=3, replica_index=2), None),
                            (auto, (3, 2))):
        profile = settings.profile(turns)
        assert list(profile["filters"])[-1] == "replica-turn"  # type: ignore[call-overload]
        turn = build_pipeline(profile).room_filters[-1]
        assert isinstance(turn, ReplicaTurn) and (turn.replicas, turn.index) == (3, 2)
    assert SchedulerSettings(replicas=2).static_turns() == (2, 0)
    with pytest.raises(ValueError, match="LLMQ_SCHEDULER_REPLICA_INDEX"):
        SchedulerSettings(replicas=2, replica_index=2)
    with pytest.raises(ValueError, match="needs LLMQ_SCHEDULER_REPLICAS"):
        SchedulerSettings(replica_index=1)


def test_turns_come_from_the_groups_members_in_sorted_order() -> None:
    members = ["sched-c", "sched-a", "sched-b"]
    assert [turns_of(members, m) for m in ("sched-a", "sched-b", "sched-c")] == [
        (3, 0), (3, 1), (3, 2)]
    assert turns_of(["sched-a"], "sched-a") == (1, 0)
    assert turns_of(members, "sched-d") is None  # not joined yet: keep the turns as they are
    assert shared(members) == [] and shared([*members, "sched-a"]) == ["sched-a"]


# -- two replicas placing at once ---------------------------------------------------------


def replica(index: int, replicas: int) -> SchedulerState:
    cfg = RuntimeConfig(scheduler_id=f"{SCHED}-{index}", assignments_topic="p.assignments",
                        events_topic="p.events", status_topic="p.status")
    turns = (replicas, min(index, replicas - 1))
    pipeline = build_pipeline(SchedulerSettings().profile(turns))
    state = SchedulerState(cfg, QueueConfig(), pipeline, random.Random(index))
    state.set_turns(turns, pipeline, T)
    for i, worker_id in enumerate(WORKERS):
        state.observe_heartbeat(beat(worker_id, i, kv_total_tokens=4_000, kv_free_tokens=4_000))
    state.restore()
    return state


def burst(replicas: int) -> tuple[int, int]:
    """Two replicas, each with 30 requests of its own partitions, tick together every
    20 ms for 3 s and read each other's placements back after each tick (a 20 ms lag).
    Returns (the largest KV placed on one worker, its usable KV)."""
    states = [replica(0, replicas), replica(1, replicas)]
    for r, state in enumerate(states):
        for i in range(30):
            state.on_request(admitted(f"r{r}-{i}", prompt=1_000, max_tokens=24, timeout_s=600),
                             (f"tp{r}", i), T)
    placed: dict[str, list[Assignment]] = {w: [] for w in WORKERS}
    peak = 0
    for step in range(150):
        now = T + 0.013 + step * 0.02
        new = [decode(o.value, ASSIGNMENT_ADAPTER) for state in states
               for e in state.tick(now).effects for o in e.first if o.topic == "p.assignments"]
        for a in new:
            placed[a.worker_id].append(a)
        peak = max(peak, *(sum(a.kv_tokens for a in on) for on in placed.values()))
        for state in states:  # the log read back: every replica sees every placement
            for a in new:
                state.observe_assignment(a)
    usable = int(4_000 * 0.95)
    return peak, usable


def lagged_load(skew_s: float, write_s: float, read_s: float) -> tuple[int, int]:
    """Two replicas under a steady backlog, with time in it. Replica 1's clock runs
    ``skew_s`` ahead of replica 0's; a record (placement or ``done``) reaches the log
    ``write_s`` after it is made. Each replica's log reader fetches every 50 ms and reads
    what reached the log up to ``read_s`` before the moment it says (``caught_up_at`` is
    when a fetch's answer was read, not when the broker built it). A worker runs each
    request 0.1-0.39 s from the moment its assignment reaches the log, so room opens at
    every point of the turns. Both tick every 5 ms for 3 s (true time). Returns (the most
    KV any worker held at once, its usable KV)."""
    states = [replica(0, 2), replica(1, 2)]
    for r, state in enumerate(states):
        for i in range(150):
            state.on_request(admitted(f"r{r}-{i}", prompt=1_000, max_tokens=24, timeout_s=600),
                             (f"tp{r}", i), T)
    log: list[tuple[float, Any]] = []  # (true time it reached the log, record)
    read = [0, 0]  # how many log records each replica has read, in order of arrival
    read_at = [0.0, 0.0]  # each replica's LogReader.caught_up_at
    held: list[tuple[float, float, str, int]] = []  # on a worker: (from, to, worker, KV)
    peak = 0
    for step in range(600):
        true_now = T + 0.013 + step * 0.005
        if step % 100 == 0:  # the workers beat every 0.5 s
            for state in states:
                for i, worker_id in enumerate(WORKERS):
                    state.observe_heartbeat(beat(worker_id, i, ts=true_now, kv_total_tokens=4_000,
                                                 kv_free_tokens=4_000))
        for r, state in enumerate(states):
            now = true_now + (skew_s if r == 1 else 0.0)
            if step % 10 == 3 * r:  # the reader's fetch, every 50 ms (its poll)
                arrived = sorted((e for e in log if e[0] <= true_now - read_s),
                                 key=lambda e: e[0])
                for _, record in arrived[read[r]:]:
                    if isinstance(record, Assignment):
                        state.observe_assignment(record)
                    else:
                        state.observe_event(record)
                read[r] = len(arrived)
                read_at[r] = now  # caught_up_at: when the answer was read, on its clock
            for effect in state.tick(now, log_read_at=read_at[r]).effects:
                for out in effect.first:
                    if out.topic == "p.assignments":
                        a = decode(out.value, ASSIGNMENT_ADAPTER)
                        on_worker = true_now + write_s
                        run_s = 0.1 + 0.013 * (len(held) % 23)  # 0.1-0.39 s, spread
                        log.append((on_worker, a))
                        log.append((on_worker + run_s + write_s, done(a, a.worker_id)))
                        held.append((on_worker, on_worker + run_s, a.worker_id, a.kv_tokens))
        for worker_id in WORKERS:
            peak = max(peak, sum(kv for start, end, w, kv in held
                                 if w == worker_id and start <= true_now < end))
    return peak, int(4_000 * 0.95)


@pytest.mark.parametrize(("skew_s", "write_s", "read_s"),
                         [(0.0, 0.0, 0.0), (0.04, 0.04, 0.01), (0.0, 0.09, 0.005),
                          (0.09, 0.0, 0.0)])
def test_turns_hold_while_skew_write_and_read_lag_fit_in_two_guards(
        skew_s: float, write_s: float, read_s: float) -> None:
    # Clocks apart, a slow write and the reader's lag, within 2 x 50 ms together: no
    # worker past its usable KV, however busy. With one guard, as the staggered turns were
    # first written (a fetch answered any time after the turn began), (0, 90 ms, 5 ms) put
    # a worker at 6,144 tokens of 3,800.
    peak, usable = lagged_load(skew_s, write_s, read_s)
    assert 0 < peak <= usable


def test_turns_do_not_hold_when_the_lag_is_past_two_guards() -> None:
    # The documented limit (docs/live-system.md): a write slower than twice the guard (a
    # broker stall) lets the next turn's replica place on a worker it reads as emptier.
    peak, usable = lagged_load(0.0, 0.3, 0.0)
    assert peak > usable


def test_two_replicas_in_turns_never_overcommit_a_worker() -> None:
    peak, usable = burst(replicas=2)
    assert 0 < peak <= usable


def test_two_replicas_unaware_of_each_other_overcommit_one() -> None:
    # The same burst with each replica thinking it is alone: what the turns prevent.
    peak, usable = burst(replicas=1)
    assert peak > usable


def test_a_tick_whose_log_is_not_read_up_to_the_turns_places_nothing_but_rejects() -> None:
    state = replica(0, 2)
    state.on_request(admitted("r1", timeout_s=600), ("tp", 0), T)
    state.on_request(admitted("late", timeout_s=0.001), ("tp", 1), T)
    now = next(t for t in (T + 1 + k * 0.01 for k in range(100))
               if any(turn_of(w, t, 2, 0.5, 0.05) == 0 for w in WORKERS))
    held = state.tick(now, log_read_at=now - 1.0)  # read before any turn of now began
    # An expired request is refused all the same: that needs no other replica's record.
    assert (held.placed, held.rejected) == (0, {"queue_timeout": 1})
    done = state.tick(now, log_read_at=now)
    assert done.placed == 1
