"""Invariants of the scheduling loop over random fleets, request streams and clocks.

A little discrete-time loop drives the real core the way the service and the simulator do:
arrivals are pushed, ``schedule()`` runs, placed requests start on the next tick and end
after their service time (releasing the ledger), the clock advances. After every cycle:

(a) no worker's reservations exceed its usable KV, and nothing lands where it may not;
(c) within a class (lane, priority, model) placements follow arrival order;
(d) work-conserving: no class head fits a worker it may use that is not held for another;
and, once arrivals stop, the queue empties (everything is placed or rejected).
(b) is a targeted scenario below: a big request under a stream of small ones that would
starve it without holds is placed within its aging bound plus the longest service time.
(e) is in test_scheduler_ledger_props.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.common import Lane, Pool, Priority
from services.scheduler import (
    DEFAULT_PROFILE,
    Ledger,
    PendingQueue,
    Placement,
    PlacementContext,
    QueueConfig,
    QueuedRequest,
    Reject,
    Snapshot,
    WorkerState,
    build_pipeline,
    schedule,
)
from tests.builders import make_request, make_worker

PIPELINE = build_pipeline(DEFAULT_PROFILE)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Arrival:
    at: float
    request: QueuedRequest
    service_s: float


@dataclass
class Loop:
    """The owner's side: fleet, queue, ledger, clock, running requests."""

    fleet: list[WorkerState]
    stale: set[str]
    queue: PendingQueue
    ledger: Ledger = field(default_factory=Ledger)
    now: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    running: dict[tuple[str, int], tuple[float, str]] = field(default_factory=dict)
    placed: list[tuple[float, Placement]] = field(default_factory=list)
    rejected: list[Reject] = field(default_factory=list)
    arrival_index: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> Snapshot:
        workers = []
        for w in self.fleet:
            started = [
                r
                for r in self.ledger.reservations(w.worker_id)
                if r.key in self.running and self.running[r.key][0] < self.now
            ]
            workers.append(
                replace(
                    w,
                    heartbeat_ts=-100.0 if w.worker_id in self.stale else self.now,
                    running=len(started),
                    kv_free_tokens=w.kv_total_tokens - sum(r.kv_tokens for r in started),
                )
            )
        return Snapshot.of(workers, self.now)

    def step(self, arrivals: list[Arrival], service: dict[str, float]) -> Snapshot:
        for arrival in arrivals:
            self.arrival_index[arrival.request.request_id] = len(self.arrival_index)
            self.queue.push(arrival.request)
        snapshot = self.snapshot()
        for decision in schedule(snapshot, self.queue, self.ledger, PIPELINE, self.now, self.rng):
            if isinstance(decision, Placement):
                self.placed.append((self.now, decision))
                key = decision.request.key
                self.running[key] = (self.now, decision.worker_id)
                service[key[0]] = self.now + service[key[0]]  # now: its end time
            elif isinstance(decision, Reject):
                self.rejected.append(decision)
        return snapshot

    def finish_due(self, ends: dict[str, float]) -> None:
        for key, (start, _) in list(self.running.items()):
            if start < self.now:
                self.ledger.mark_started(*key)
            if ends[key[0]] <= self.now:
                del self.running[key]
                self.ledger.release(*key)


# -- strategies ---------------------------------------------------------------------------

POOLS: list[Pool] = ["any", "any", "short", "long"]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[WorkerState], set[str]]:
    n = draw(st.integers(1, 5))
    workers = [
        make_worker(
            f"w{i}",
            model=draw(st.sampled_from(["m1", "m1", "m2"])),
            pool=draw(st.sampled_from(POOLS)),
            kv_total_tokens=draw(st.sampled_from([2_000, 5_000, 20_000])),
            max_num_seqs=draw(st.integers(1, 6)),
            draining=draw(st.booleans()) and i > 0,
            partition=i,
        )
        for i in range(n)
    ]
    stale = {w.worker_id for w in workers[1:] if draw(st.integers(0, 9)) == 0}
    return workers, stale


@st.composite
def streams(draw: st.DrawFn) -> list[Arrival]:
    n = draw(st.integers(0, 40))
    out = []
    for i in range(n):
        at = draw(st.floats(0, 40, allow_nan=False)) // 0.5 * 0.5
        lane: Lane = draw(st.sampled_from(["short", "short", "long"]))
        priority: Priority = draw(st.sampled_from(["high", "normal", "low"]))
        deadline = draw(st.one_of(st.none(), st.floats(1, 80)))
        request = make_request(
            f"q{i}",
            model=draw(st.sampled_from(["m1", "m1", "m1", "m2", "m3"])),
            priority=priority,
            lane=lane,
            kv_tokens=draw(st.integers(1, 400)) * 16,
            enqueued_at=at,
            deadline=None if deadline is None else at + deadline,
            prefix_hash=draw(st.sampled_from([None, "p1", "p2"])),
        )
        out.append(Arrival(at, request, draw(st.floats(0.5, 8.0))))
    out.sort(key=lambda a: a.at)
    return out


# -- the checks ---------------------------------------------------------------------------


def may_take(worker: WorkerState, request: QueuedRequest, snapshot: Snapshot) -> bool:
    return (
        snapshot.is_fresh(worker)
        and not worker.draining
        and worker.model == request.model
        and worker.pool in ("any", request.lane)
    )


def may_place(worker: WorkerState, request: QueuedRequest, snapshot: Snapshot) -> bool:
    """``may_take``, or a spill onto the other lane's dedicated pool (profile ``spill``)."""
    spills = request.lane in PIPELINE.spill and worker.pool not in ("any", request.lane)
    return may_take(worker, request, snapshot) or (
        spills
        and snapshot.is_fresh(worker)
        and not worker.draining
        and worker.model == request.model
    )


def check_capacity(loop: Loop, snapshot: Snapshot) -> None:
    for worker in snapshot.workers.values():
        reserved = loop.ledger.reserved_kv(worker.worker_id)
        assert 0 <= reserved <= loop.ledger.usable_kv(worker)
        assert reserved == sum(r.kv_tokens for r in loop.ledger.reservations(worker.worker_id))


def check_work_conserving(loop: Loop, snapshot: Snapshot) -> None:
    """No class head fits a worker it may use, apart from holds and the room filters
    (``class-reserve`` keeps room for the high class on purpose)."""
    ledger = loop.ledger
    ctx = PlacementContext(snapshot, ledger, loop.now)
    for head in loop.queue.heads():
        for worker in snapshot.workers.values():
            holder = ledger.holder(worker.worker_id)
            if holder not in (None, head.request_id) or not may_take(worker, head, snapshot):
                continue
            fits = (
                ledger.free_kv(worker) >= head.kv_tokens
                and ledger.in_flight(worker) < worker.max_num_seqs
                and all(f.accepts(worker, head, ctx) for f in PIPELINE.room_filters)
            )
            assert not fits, f"{head.request_id} fits idle-able {worker.worker_id}"


def check_fcfs(loop: Loop) -> None:
    last: dict[tuple[str, str, str], int] = {}
    for _, placement in loop.placed:
        request = placement.request
        klass = (request.lane, request.priority, request.model)
        index = loop.arrival_index[request.request_id]
        assert last.get(klass, -1) < index, f"{request.request_id} passed an earlier one"
        last[klass] = index


@SETTINGS
@given(
    fleet=fleets(),
    arrivals=streams(),
    aging=st.sampled_from([1.0, 5.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_loop_invariants(
    fleet: tuple[list[WorkerState], set[str]], arrivals: list[Arrival], aging: float, seed: int
) -> None:
    workers, stale = fleet
    loop = Loop(
        workers, stale, PendingQueue(QueueConfig(aging_s_per_class=aging)), rng=random.Random(seed)
    )
    ends = {a.request.request_id: a.service_s for a in arrivals}
    pending_arrivals = list(arrivals)
    horizon = 40.0 + 3 * aging + sum(a.service_s for a in arrivals) + 10
    while loop.now <= horizon:
        due = [a for a in pending_arrivals if a.at <= loop.now]
        pending_arrivals = pending_arrivals[len(due) :]
        placed_before = len(loop.placed)
        snapshot = loop.step(due, ends)
        # Every placement this step made, against the snapshot it was made from.
        for _, placement in loop.placed[placed_before:]:
            assert may_place(snapshot.workers[placement.worker_id], placement.request, snapshot)
        check_capacity(loop, snapshot)
        check_work_conserving(loop, snapshot)
        loop.now += 0.5
        loop.finish_due(ends)
        if not pending_arrivals and not loop.queue and not loop.running:
            break
    check_fcfs(loop)
    # Liveness: whatever a worker that takes work could ever hold left the queue. (What only
    # a draining worker could hold waits for the fleet to change, or for its deadline.)
    snapshot = loop.snapshot()
    for request in loop.queue.ordered():
        assert not any(
            may_take(w, request, snapshot) and loop.ledger.usable_kv(w) >= request.kv_tokens
            for w in snapshot.workers.values()
        ), f"{request.request_id} starved"


# -- (b) no starvation --------------------------------------------------------------------


@SETTINGS
@given(
    n_workers=st.integers(1, 3),
    aging=st.sampled_from([1.0, 2.0, 5.0]),
    victim_priority=st.sampled_from(["normal", "low"]),
    stream_priority=st.sampled_from(["normal", "low"]),
    victim_kv=st.integers(5_000, 9_500),
    gaps=st.lists(st.floats(0.2, 1.0), min_size=80, max_size=80),
    services=st.lists(st.floats(0.5, 3.0), min_size=80, max_size=80),
    kvs=st.lists(st.integers(200, 1_500), min_size=80, max_size=80),
    seed=st.integers(0, 2**16),
)
def test_a_big_request_is_not_starved_by_a_stream_of_small_ones(
    n_workers: int,
    aging: float,
    victim_priority: Priority,
    stream_priority: Priority,
    victim_kv: int,
    gaps: list[float],
    services: list[float],
    kvs: list[int],
    seed: int,
) -> None:
    # Workers of 10,000 KV (usable 9,500): the small stream alone always fits, so without
    # holds it would keep every worker partly busy forever and the victim would starve.
    workers = [
        make_worker(f"w{i}", pool="any", kv_total_tokens=10_000, partition=i)
        for i in range(n_workers)
    ]
    loop = Loop(
        workers, set(), PendingQueue(QueueConfig(aging_s_per_class=aging)), rng=random.Random(seed)
    )
    arrivals, at = [], 0.0
    for i, (gap, service, kv) in enumerate(zip(gaps, services, kvs, strict=True)):
        at += gap
        small = make_request(f"s{i}", priority=stream_priority, kv_tokens=kv, enqueued_at=at)
        arrivals.append(Arrival(at, small, service))
    victim_at = 2.0
    victim = make_request(
        "victim", priority=victim_priority, lane="long", kv_tokens=victim_kv, enqueued_at=victim_at
    )
    arrivals.append(Arrival(victim_at, victim, 1.0))
    arrivals.sort(key=lambda a: a.at)
    ends = {a.request.request_id: a.service_s for a in arrivals}
    longest, dt = max([*services, 1.0]), 0.25
    bound = loop.queue.aging_bound_s(victim_priority) + longest + 2 * dt
    while loop.now <= victim_at + bound + 1:
        due = [a for a in arrivals if a.at <= loop.now]
        arrivals = arrivals[len(due) :]
        loop.step(due, ends)
        if any(p.request.request_id == "victim" for _, p in loop.placed):
            break
        loop.now += dt
        loop.finish_due(ends)
    placed_at = next(t for t, p in loop.placed if p.request.request_id == "victim")
    assert placed_at - victim_at <= bound
