"""One scheduling cycle: placement, rejection, deferral, backfill, holds, lanes (core.cycle)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from schemas.common import Lane, Pool
from services.scheduler import (
    BASELINE_PROFILES,
    DEFAULT_PROFILE,
    Decision,
    Defer,
    Ledger,
    PendingQueue,
    Pipeline,
    Placement,
    QueuedRequest,
    Reject,
    Snapshot,
    WorkerState,
    build_pipeline,
    schedule,
)
from services.scheduler.policies.profile import REQUIRED_FILTERS
from tests.builders import NOW, make_queue, make_request, make_snapshot, make_worker, seeded

PIPELINE = build_pipeline(DEFAULT_PROFILE)
STRICT = build_pipeline({"spill": {}})  # pools never lend


def run(
    workers: Sequence[WorkerState] | Snapshot,
    *requests: QueuedRequest,
    ledger: Ledger | None = None,
    queue: PendingQueue | None = None,
    now: float = NOW,
    pipeline: Pipeline = PIPELINE,
    max_placements: int | None = None,
) -> list[Decision]:
    snapshot = workers if isinstance(workers, Snapshot) else make_snapshot(workers, now=now)
    queue = queue if queue is not None else make_queue()
    for request in requests:
        queue.push(request)
    return schedule(
        snapshot,
        queue,
        ledger if ledger is not None else Ledger(),
        pipeline,
        now,
        seeded(),
        max_placements=max_placements,
    )


def placed(decisions: Sequence[Decision]) -> list[tuple[str, str]]:
    return [(d.request.request_id, d.worker_id) for d in decisions if isinstance(d, Placement)]


def kinds(decisions: Sequence[Decision]) -> dict[str, str]:
    out = {}
    for d in decisions:
        if isinstance(d, Placement):
            out[d.request.request_id] = "placed"
        elif isinstance(d, Reject):
            out[d.request_id] = d.code
        else:
            out[d.request_id] = "defer"
    return out


def test_a_placement_carries_worker_partition_reservation_and_attempt() -> None:
    ledger, queue = Ledger(), make_queue()
    request = make_request("a", kv_tokens=4_096, attempt=2)
    decisions = run([make_worker("w0", partition=7)], request, ledger=ledger, queue=queue)
    assert decisions == [Placement(request, "w0", 7, 4_096, 2)]
    assert ledger.worker_of("a", 2) == "w0" and ledger.reserved_kv("w0") == 4_096
    assert "a" not in queue


def test_the_roomiest_worker_wins_by_default() -> None:
    ledger = Ledger()
    busy, idle = make_worker("busy"), make_worker("idle")
    ledger.reserve(busy, make_request("x", kv_tokens=50_000))
    assert placed(run([busy, idle], make_request("a"), ledger=ledger)) == [("a", "idle")]


def test_an_idle_worker_beats_its_lightly_loaded_twin() -> None:
    """Two workers of one kind at low load: the idle one gets the next request. Scoring
    the idle one's throughput (0, it generates nothing) as slow gave its busy twin every
    such request (seen live: one of two workers got almost no work)."""
    ledger = Ledger()
    busy = make_worker("busy", running=2, tokens_per_s=600.0)
    idle = make_worker("idle", running=0, tokens_per_s=0.0)
    for i in range(2):
        ledger.reserve(busy, make_request(f"x{i}", kv_tokens=512))
    assert placed(run([busy, idle], make_request("a"), ledger=ledger)) == [("a", "idle")]


@pytest.mark.parametrize(
    ("worker", "why"),
    [
        (make_worker("w", heartbeat_ts=NOW - 10), "stale heartbeat"),
        (make_worker("w", draining=True), "draining"),
        (make_worker("w", model="other"), "other model"),
        (make_worker("w", pool="long"), "long pool, short request"),
        (make_worker("w", running=256), "no sequence slot"),
        (make_worker("w", kv_free_tokens=1_000), "heartbeat shows it full"),
    ],
)
def test_ineligible_workers_never_get_work(worker: WorkerState, why: str) -> None:
    # Alone, the ineligible worker gets nothing (STRICT: a short request may not spill to
    # the long pool); beside a busier eligible one, so that it would win on room were it a
    # candidate, the eligible one still gets the request.
    assert placed(run([worker], make_request("a"), pipeline=STRICT)) == [], why
    ledger, fine = Ledger(), make_worker("fine")
    ledger.reserve(fine, make_request("x", kv_tokens=60_000))
    assert placed(run([worker, fine], make_request("a"), ledger=ledger)) == [("a", "fine")], why


@pytest.mark.parametrize(
    ("workers", "request_", "outcome"),
    [
        ([make_worker(model="other")], make_request(), "unknown_model"),
        ([make_worker(model_version="v1")], make_request(model_version="v2"), "unknown_model"),
        # no pool for its lane, and it may not borrow another (no spill rule): never
        ([make_worker(pool="short")], make_request(lane="long"), "too_large"),
        ([make_worker(kv_total_tokens=10_000)], make_request(kv_tokens=9_600), "too_large"),
        # only a draining worker serves the route: wait for its replacement
        ([make_worker(draining=True)], make_request(), "defer"),
        # a draining worker could hold it, but no worker taking new work ever could
        (
            [make_worker(draining=True), make_worker("small", kv_total_tokens=1_000)],
            make_request(),
            "too_large",
        ),
        # the only worker serving it is stale: that worker is not live, so: unknown
        (
            [make_worker(heartbeat_ts=NOW - 10), make_worker("x", model="other")],
            make_request(),
            "unknown_model",
        ),
        # nothing fresh at all: the fleet is saturated, not wrong
        ([make_worker(heartbeat_ts=NOW - 10)], make_request(), "defer"),
        ([], make_request(), "defer"),
        # full now but could fit later: defer
        ([make_worker(kv_free_tokens=0)], make_request(), "defer"),
    ],
)
def test_reject_only_what_no_live_worker_could_ever_take(
    workers: list[WorkerState], request_: QueuedRequest, outcome: str
) -> None:
    queue = make_queue()
    decisions = run(workers, request_, queue=queue, pipeline=STRICT)
    assert kinds(decisions) == {request_.request_id: outcome}
    assert (request_.request_id in queue) is (outcome == "defer")


@pytest.mark.parametrize(("recent", "outcome"), [
    (make_worker("b", model="m2", heartbeat_ts=NOW - 10), "defer"),  # restarting: waits
    (make_worker("b", model="m2", kv_total_tokens=1_000, heartbeat_ts=NOW - 10),
     "unknown_model"),  # too small to take it even back: no reason to wait
    (None, "unknown_model"),
    (make_worker("b", model="m2", heartbeat_ts=NOW - 10, draining=True),
     "unknown_model"),  # it was on its way out: not coming back
])
def test_a_request_only_a_worker_heard_from_lately_could_take_waits_for_it(
    recent: WorkerState | None, outcome: str,
) -> None:
    """Found by an audit: a model's only worker restarting (another model's live), its
    requests, the requeue of its lost work included, were refused unknown_model (404,
    which clients do not retry)."""
    live = make_worker("a", model="m1")
    snapshot = Snapshot.of([live], NOW, recent=[recent] if recent is not None else [])
    request = make_request("r", model="m2", kv_tokens=2_048)
    queue = make_queue()
    decisions = run(snapshot, request, queue=queue, pipeline=STRICT)
    assert kinds(decisions) == {"r": outcome}
    assert ("r" in queue) is (outcome == "defer")


def test_a_head_too_large_for_the_live_workers_does_not_wait_for_a_recent_one() -> None:
    """Found by a review of f4d1301: deferred for a larger worker heard from lately, the
    head held its class's smaller requests back for minutes, though the live workers could
    run them. Refused too_large as before; the small ones are placed."""
    live = make_worker("small", kv_total_tokens=10_000)
    big = make_worker("big", kv_total_tokens=200_000, heartbeat_ts=NOW - 10)
    snapshot = Snapshot.of([live], NOW, recent=[big])
    requests = [make_request("huge", kv_tokens=100_000, enqueued_at=NOW - 5)]
    requests += [make_request(f"s{i}", kv_tokens=1_024) for i in range(3)]
    decisions = run(snapshot, *requests, pipeline=STRICT)
    assert kinds(decisions)["huge"] == "too_large"
    assert sorted(rid for rid, _ in placed(decisions)) == ["s0", "s1", "s2"]


def test_cancelled_and_expired_leave_before_anything_is_placed() -> None:
    queue = make_queue(make_request("c"), make_request("old", deadline=NOW - 1))
    queue.cancel("c")
    decisions = run([make_worker()], make_request("ok"), queue=queue)
    assert [(type(d).__name__, kinds([d])) for d in decisions] == [
        ("Reject", {"c": "cancelled"}),
        ("Reject", {"old": "queue_timeout"}),
        ("Placement", {"ok": "placed"}),
    ]


def test_higher_effective_priority_goes_first_when_one_fits() -> None:
    worker = make_worker(kv_total_tokens=2_000)  # usable 1,900: one request at a time
    decisions = run(
        [worker],
        make_request("low", priority="low"),
        make_request("high", priority="high"),
        make_request("normal"),
    )
    assert placed(decisions) == [("high", "w0")]


def test_aging_lets_an_old_low_request_overtake_a_fresh_high_one() -> None:
    worker = make_worker(kv_total_tokens=2_000)
    decisions = run(
        [worker],
        make_request("high", priority="high"),
        make_request("low", priority="low", enqueued_at=NOW - 61),
    )
    assert placed(decisions) == [("low", "w0")]


def test_a_blocked_head_blocks_its_class_but_other_classes_backfill() -> None:
    ledger = Ledger()
    worker = make_worker(kv_total_tokens=10_000)  # usable 9,500
    ledger.reserve(worker, make_request("running", kv_tokens=5_000))
    decisions = run(
        [worker],
        make_request("big", kv_tokens=8_000, enqueued_at=NOW - 1),
        make_request("small-same-class", kv_tokens=1_000),
        make_request("small-low", priority="low", kv_tokens=1_000),
        ledger=ledger,
    )
    assert kinds(decisions) == {"big": "defer", "small-low": "placed"}


def test_a_head_pinned_to_a_version_no_free_worker_serves_holds_back_no_other() -> None:
    # A rolling upgrade: the last v1 worker drains, a v2 worker is idle. The pinned-v1
    # head shared its FIFO with unpinned and v2 requests and held them all back.
    workers = [make_worker("old", model_version="v1", draining=True),
               make_worker("new", model_version="v2", partition=1)]
    decisions = run(
        workers,
        make_request("pinned-v1", model_version="v1", enqueued_at=NOW - 1),
        make_request("any", model_version=None),
        make_request("pinned-v2", model_version="v2"),
    )
    assert kinds(decisions) == {"pinned-v1": "defer", "any": "placed", "pinned-v2": "placed"}


def test_an_overdue_blocked_head_holds_its_best_worker() -> None:
    ledger, queue = Ledger(), make_queue()
    a, b = make_worker("a", kv_total_tokens=10_000), make_worker("b", kv_total_tokens=10_000)
    ledger.reserve(a, make_request("on-a", kv_tokens=6_000))
    ledger.reserve(b, make_request("on-b", kv_tokens=3_000))
    big = make_request("big", kv_tokens=8_000, enqueued_at=NOW - 31)  # normal: bound 30 s
    decisions = run([a, b], big, make_request("small", priority="low"), ledger=ledger, queue=queue)
    assert ledger.hold_of("big") == "b"  # most free KV: closest to fitting
    assert placed(decisions) == [("small", "a")]  # backfill only off the held worker
    assert "holding b" in next(d.reason for d in decisions if isinstance(d, Defer))
    # b drains: the next cycle places big there and ends the hold
    ledger.release("on-b", 0)
    assert placed(run([a, b], ledger=ledger, queue=queue)) == [("big", "b")]
    assert dict(ledger.holds()) == {}


@pytest.mark.parametrize("fleet", [
    # No worker of its lane at all (the long pool gone), or none that could ever hold it.
    [make_worker("s0", pool="short", kv_total_tokens=100_000)],
    [make_worker("s0", pool="short", kv_total_tokens=100_000),
     make_worker("l0", pool="long", kv_total_tokens=20_000, partition=1)],
], ids=["stranded", "own pool too small"])
def test_an_overdue_head_that_must_borrow_holds_a_worker_of_the_pool_it_borrows(
    fleet: list[WorkerState],
) -> None:
    # Short traffic kept refilling the borrowed worker's KV, and no hold was taken there:
    # the head waited without bound (400 s against a bound of aging + service, 62 s).
    ledger, queue = Ledger(kv_safety_margin=0.0), make_queue()
    ledger.reserve(fleet[0], make_request("busy", kv_tokens=64_000))  # 36,000 free
    big = make_request("big", priority="low", lane="long", kv_tokens=50_000,
                       enqueued_at=NOW - 61)  # low: overdue past 60 s
    decisions = run(fleet, big, ledger=ledger, queue=queue)
    assert ledger.hold_of("big") == "s0"
    assert "holding s0" in next(d.reason for d in decisions if isinstance(d, Defer))
    # Short traffic no longer refills the held worker ...
    assert placed(run(fleet, make_request("s-new", kv_tokens=8_000), ledger=ledger,
                      queue=queue)) == []
    ledger.release("busy", 0)  # ... so once it drains, the head runs there
    assert placed(run(fleet, ledger=ledger, queue=queue))[0] == ("big", "s0")


def test_no_hold_before_the_aging_bound() -> None:
    ledger = Ledger()
    worker = make_worker(kv_total_tokens=10_000)
    ledger.reserve(worker, make_request("on", kv_tokens=6_000))
    big = make_request("big", kv_tokens=8_000, enqueued_at=NOW - 29)
    decisions = run([worker], big, make_request("small", priority="low"), ledger=ledger)
    assert dict(ledger.holds()) == {}
    assert placed(decisions) == [("small", "w0")]


def test_holds_end_when_the_request_leaves_or_the_worker_goes() -> None:
    ledger, queue = Ledger(), make_queue()
    worker = make_worker(kv_total_tokens=10_000)
    ledger.reserve(worker, make_request("on", kv_tokens=6_000))
    run(
        [worker],
        make_request("big", kv_tokens=8_000, enqueued_at=NOW - 31),
        ledger=ledger,
        queue=queue,
    )
    assert ledger.hold_of("big") == "w0"
    run([make_worker(draining=True)], ledger=ledger, queue=queue)
    assert ledger.hold_of("big") is None
    run([worker], ledger=ledger, queue=queue)
    assert ledger.hold_of("big") == "w0"
    queue.cancel("big")
    run([worker], ledger=ledger, queue=queue)
    assert dict(ledger.holds()) == {}


def test_a_high_priority_head_that_does_not_fit_holds_at_once() -> None:
    ledger = Ledger()
    worker = make_worker(kv_total_tokens=10_000)
    ledger.reserve(worker, make_request("on", kv_tokens=6_000))
    run([worker], make_request("big", priority="high", kv_tokens=8_000), ledger=ledger)
    assert ledger.hold_of("big") == "w0"  # high: aging bound 0 s


def test_lanes_interleave_three_to_one_on_any_workers() -> None:
    worker = make_worker(kv_total_tokens=1_000_000)
    shorts = [make_request(f"s{i}", enqueued_at=NOW - 10 + i) for i in range(8)]
    longs = [make_request(f"l{i}", lane="long", enqueued_at=NOW - 100 + i) for i in range(6)]
    decisions = run([worker], *shorts, *longs, max_placements=10)
    order = "".join(rid[0].upper() for rid, _ in placed(decisions))
    assert order == "SLSSSLSSSL"


def test_dedicated_pools_take_only_their_lane() -> None:
    short_w, long_w = make_worker("sw", pool="short"), make_worker("lw", pool="long")
    decisions = run(
        [short_w, long_w], make_request("s"), make_request("l", lane="long", kv_tokens=8_192)
    )
    assert sorted(placed(decisions)) == [("l", "lw"), ("s", "sw")]


def test_max_placements_stops_early() -> None:
    queue = make_queue(*(make_request(f"r{i}", enqueued_at=NOW - i) for i in range(5)))
    decisions = run([make_worker()], queue=queue, max_placements=2)
    assert [rid for rid, _ in placed(decisions)] == ["r4", "r3"]
    assert len(queue) == 3
    assert run([make_worker()], queue=queue, max_placements=0) == []


def test_sequence_slots_cap_placements() -> None:
    worker = make_worker(max_num_seqs=3, running=1)
    decisions = run([worker], *(make_request(f"r{i}") for i in range(4)))
    assert len(placed(decisions)) == 2
    assert kinds(decisions)["r2"] == "defer"


def test_prefix_affinity_prefers_the_worker_that_served_the_prefix() -> None:
    ledger = Ledger()
    a, b = make_worker("a"), make_worker("b")
    ledger.reserve(b, make_request("earlier", kv_tokens=16, prefix_hash="sys-prompt"))
    ledger.release("earlier", 0)  # b is as empty as a again; only affinity differs
    decisions = run([a, b], make_request("next", prefix_hash="sys-prompt"), ledger=ledger)
    assert placed(decisions) == [("next", "b")]


def test_the_affinity_worker_is_a_candidate_even_outside_the_roomiest() -> None:
    ledger = Ledger()
    workers = [make_worker(f"w{i}") for i in range(20)]
    ledger.reserve(workers[0], make_request("x", kv_tokens=1_000, prefix_hash="p"))
    pipeline = build_pipeline(
        {**DEFAULT_PROFILE, "candidates": 1, "scorers": {"prefix-affinity": 1.0}}
    )
    decisions = run(workers, make_request("y", prefix_hash="p"), ledger=ledger, pipeline=pipeline)
    assert placed(decisions) == [("y", "w0")]


def test_same_seed_same_decisions() -> None:
    workers = [make_worker(f"w{i}") for i in range(5)]
    requests = [make_request(f"r{i}", priority="high" if i % 2 else "low") for i in range(20)]
    assert run(workers, *requests) == run(workers, *requests)


@pytest.mark.parametrize("name", sorted(BASELINE_PROFILES))
def test_baselines_place_only_on_feasible_workers(name: str) -> None:
    pipeline = build_pipeline(BASELINE_PROFILES[name])
    workers = [make_worker("full", kv_free_tokens=0), make_worker("a"), make_worker("b")]
    decisions = run(workers, *(make_request(f"r{i}") for i in range(6)), pipeline=pipeline)
    assert len(placed(decisions)) == 6
    assert {w for _, w in placed(decisions)} <= {"a", "b"}


def test_round_robin_baseline_alternates() -> None:
    pipeline = build_pipeline(BASELINE_PROFILES["round-robin"])
    workers = [make_worker("a"), make_worker("b"), make_worker("c")]
    decisions = run(
        workers, *(make_request(f"r{i}", enqueued_at=NOW + i) for i in range(5)), pipeline=pipeline
    )
    assert [w for _, w in placed(decisions)] == ["a", "b", "c", "a", "b"]


def test_reusing_a_snapshot_sees_releases_between_calls() -> None:
    ledger, queue = Ledger(), make_queue()
    snapshot = make_snapshot([make_worker(kv_total_tokens=2_000)])
    decisions = run(snapshot, make_request("a"), make_request("b"), ledger=ledger, queue=queue)
    assert kinds(decisions) == {"a": "placed", "b": "defer"}
    ledger.release("a", 0)
    assert placed(run(snapshot, ledger=ledger, queue=queue)) == [("b", "w0")]


def test_a_hold_goes_to_the_head_ahead_in_effective_priority() -> None:
    ledger, queue = Ledger(), make_queue()
    worker = make_worker(kv_total_tokens=10_000)
    ledger.reserve(worker, make_request("on", kv_tokens=6_000))
    later = make_request("later", priority="high", kv_tokens=8_000, enqueued_at=NOW - 1)
    run([worker], later, ledger=ledger, queue=queue)
    assert ledger.hold_of("later") == "w0"
    # A low request that has waited 70 s is ahead of a high one that waited 1 s.
    older = make_request(
        "older", priority="low", lane="long", kv_tokens=7_000, enqueued_at=NOW - 70
    )
    run([worker], older, ledger=ledger, queue=queue)
    assert ledger.hold_of("older") == "w0" and ledger.hold_of("later") is None
    # ... and the high one cannot take it back.
    run([worker], ledger=ledger, queue=queue)
    assert ledger.hold_of("older") == "w0"


def test_a_hold_that_ends_mid_cycle_frees_the_worker_for_the_rest() -> None:
    ledger, queue = Ledger(), make_queue()
    worker = make_worker(kv_total_tokens=10_000)
    ledger.reserve(worker, make_request("on", kv_tokens=6_000))
    run([worker], make_request("big", priority="high", kv_tokens=8_000), ledger=ledger, queue=queue)
    ledger.release("on", 0)
    # The long lane has the turn first: its head is refused by big's hold, then big is
    # placed (ending the hold) and the long head gets a second look in the same cycle.
    queue.lanes.charge("short")
    decisions = run(
        [worker], make_request("l", lane="long", kv_tokens=1_000), ledger=ledger, queue=queue
    )
    assert placed(decisions) == [("big", "w0"), ("l", "w0")]
    assert not [d for d in decisions if isinstance(d, Defer)]


def test_defers_come_after_placements_and_name_the_blocker() -> None:
    worker = make_worker(kv_total_tokens=2_000, max_num_seqs=1)
    decisions = run([worker], make_request("a", priority="high"), make_request("b"))
    assert [type(d).__name__ for d in decisions] == ["Placement", "Defer"]
    defer = decisions[1]
    assert isinstance(defer, Defer) and defer.request_id == "b"
    assert "largest free 0" in defer.reason


def test_one_placement_per_call_still_serves_both_dedicated_pools() -> None:
    ledger, queue = Ledger(), make_queue()
    workers = [make_worker("sw", pool="short"), make_worker("lw", pool="long")]
    for i in range(4):
        queue.push(make_request(f"s{i}", enqueued_at=NOW - 10 + i))
        queue.push(make_request(f"l{i}", lane="long", enqueued_at=NOW - 10 + i))
    queue.lanes.charge("long")  # long ahead in turns: short would win every call
    order = []
    for _ in range(6):
        order += [
            rid for rid, _ in placed(run(workers, ledger=ledger, queue=queue, max_placements=1))
        ]
    assert order == ["s0", "l0", "s1", "l1", "s2", "l2"]


# -- spill: dedicated pools lend idle capacity across lanes --------------------------------


def test_a_short_request_borrows_an_idle_long_worker() -> None:
    full = make_worker("sw", pool="short", running=256)
    long_w = make_worker("lw", pool="long")
    assert placed(run([full, long_w], make_request("s"))) == [("s", "lw")]


def test_no_spill_while_the_lending_lane_has_work_pending() -> None:
    full = make_worker("sw", pool="short", running=256)
    long_w = make_worker("lw", pool="long", kv_total_tokens=20_000)
    waiting = make_request("l", lane="long", kv_tokens=16_000)  # fits only after x ends
    ledger = Ledger()
    assert ledger.reserve(long_w, make_request("x", lane="long", kv_tokens=8_000))
    decisions = run([full, long_w], make_request("s"), waiting, ledger=ledger)
    assert placed(decisions) == []
    assert kinds(decisions) == {"l": "defer", "s": "defer"}


@pytest.mark.parametrize(("waited", "spilled"), [(9.9, False), (10.0, True)])
def test_a_long_request_borrows_a_short_worker_only_after_waiting(
    waited: float, spilled: bool
) -> None:
    long_full = make_worker("lw", pool="long", running=256)
    short_w = make_worker("sw", pool="short")
    request = make_request("l", lane="long", kv_tokens=8_192, enqueued_at=NOW - waited)
    assert placed(run([long_full, short_w], request)) == ([("l", "sw")] if spilled else [])


def test_borrowed_long_requests_are_bounded_per_short_worker() -> None:
    long_full = make_worker("lw", pool="long", running=256)
    shorts = [make_worker(f"sw{i}", pool="short") for i in range(2)]
    requests = [
        make_request(f"l{i}", lane="long", kv_tokens=8_192, enqueued_at=NOW - 20 + i)
        for i in range(3)
    ]
    decisions = run([long_full, *shorts], *requests)
    assert sorted(w for _, w in placed(decisions)) == ["sw0", "sw1"]  # one each, third waits
    assert kinds(decisions)["l2"] == "defer"


@pytest.mark.parametrize("pipeline", [
    PIPELINE,
    build_pipeline({"filters": list(REQUIRED_FILTERS), "candidates": 0}),
    build_pipeline(BASELINE_PROFILES["round-robin"]),
], ids=["default", "candidates-0", "baseline"])
def test_the_spill_bound_holds_whatever_the_candidate_count(pipeline: Pipeline) -> None:
    """Found by an audit: with candidates = 0 and no room filter the cycle's own checks
    were skipped, so three long requests borrowed one short worker (bound: one)."""
    short_w = make_worker("s0", pool="short", kv_total_tokens=100_000)
    requests = [make_request(f"l{i}", lane="long", priority="high", kv_tokens=4_000,
                             enqueued_at=NOW - 20) for i in range(3)]
    ledger = Ledger()
    decisions = run([short_w], *requests, ledger=ledger, pipeline=pipeline)
    assert ledger.lane_count("s0", "long") == 1
    assert len(placed(decisions)) == 1


def test_an_empty_spill_table_keeps_pools_strict() -> None:
    full = make_worker("sw", pool="short", running=256)
    long_w = make_worker("lw", pool="long")
    assert placed(run([full, long_w], make_request("s"), pipeline=STRICT)) == []


@pytest.mark.parametrize(("lane", "pool"), [("short", "long"), ("long", "short")])
def test_no_pool_of_its_own_but_one_it_may_borrow_is_a_wait_not_a_refusal(
    lane: Lane, pool: Pool
) -> None:
    # Only the other lane's pool is live, and busy for now (no slot), or the other lane
    # has work of its own, or the head has not waited long enough to borrow: it waits.
    busy = make_worker("o", pool=pool, running=256)
    request = make_request("r", lane=lane, kv_tokens=1_024)
    queue = make_queue()
    decisions = run([busy], request, queue=queue)
    assert kinds(decisions) == {"r": "defer"} and "r" in queue
    assert "waits to borrow" in next(d.reason for d in decisions if isinstance(d, Defer))
    # Once the worker has a slot (and a long head has waited spill.long.after_s), it
    # borrows it.
    later = NOW + 10.0
    idle = make_worker("o", pool=pool, heartbeat_ts=later)
    assert placed(run([idle], queue=queue, now=later)) == [("r", "o")]


def test_too_large_for_every_pool_it_may_use_is_refused() -> None:
    # Its own pool's KV is too small; the pool it may borrow is larger but still too small.
    workers = [make_worker("s", pool="short", kv_total_tokens=2_000),
               make_worker("l", pool="long", kv_total_tokens=4_000)]
    assert kinds(run(workers, make_request("r", kv_tokens=5_000))) == {"r": "too_large"}
    # One it fits only by borrowing is not refused: it borrows (nothing long is pending).
    assert placed(run(workers, make_request("r", kv_tokens=3_000))) == [("r", "l")]


def test_a_hold_on_a_worker_that_can_no_longer_take_it_is_let_go() -> None:
    # "big" holds b; then b shrinks (a smaller KV on its next heartbeat) below big's size,
    # and the only other worker that could take it is held for a request ahead of it.
    ledger, queue = Ledger(), make_queue()
    a, b = make_worker("a", kv_total_tokens=10_000), make_worker("b", kv_total_tokens=10_000)
    ledger.reserve(a, make_request("on-a", kv_tokens=6_000))
    ledger.reserve(b, make_request("on-b", kv_tokens=3_000))
    run([a, b], make_request("big", kv_tokens=8_000, enqueued_at=NOW - 31),
        ledger=ledger, queue=queue)
    assert ledger.hold_of("big") == "b"
    ahead = make_request("ahead", priority="high", kv_tokens=8_000, enqueued_at=NOW - 40)
    small_b = make_worker("b", kv_total_tokens=5_000)
    run([a, small_b], ahead, ledger=ledger, queue=queue)
    assert ledger.hold_of("ahead") == "a"
    assert ledger.hold_of("big") is None and ledger.holder("b") is None
    # b takes other work again
    assert placed(run([a, small_b], make_request("small", priority="low", kv_tokens=500),
                      ledger=ledger, queue=queue)) == [("small", "b")]


def test_a_request_only_a_borrowed_pool_can_serve_borrows_once_past_its_aging_bound() -> None:
    # No long worker at all, and short requests pending every cycle: spill lends only
    # when the other lane has nothing pending, so the long request waited without bound.
    ledger, queue = Ledger(), make_queue()
    queue.push(make_request("long", lane="long", kv_tokens=8_192, priority="low",
                            enqueued_at=NOW))
    bound = queue.aging_bound_s("low")
    placed_at = None
    for step in range(int(bound) + 5):
        now = NOW + step
        worker = make_worker("s0", pool="short", kv_total_tokens=20_000, heartbeat_ts=now,
                             max_num_seqs=4)
        for n in range(2):
            queue.push(make_request(f"s{step}-{n}", lane="short", kv_tokens=4_096,
                                    enqueued_at=now))
        for d in run(make_snapshot([worker], now=now), ledger=ledger, queue=queue, now=now):
            if isinstance(d, Placement) and d.request.request_id == "long":
                placed_at = step
        for r in list(ledger.reservations("s0")):  # short requests end within the second
            if r.request.request_id != "long":
                ledger.release(*r.key)
    assert placed_at == bound


def test_an_overdue_head_with_workers_of_its_own_still_lends_nothing_past_pending_work() -> None:
    # High requests are overdue at once (aging bound 0 s): borrowing whenever overdue let
    # every high short request take dedicated long workers while long work waited.
    full = make_worker("sw", pool="short", running=256)
    long_worker = make_worker("lw", pool="long", kv_total_tokens=20_000)
    ledger = Ledger()
    assert ledger.reserve(long_worker, make_request("x", lane="long", kv_tokens=8_000))
    shorts = [make_request(f"s{i}", priority="high") for i in range(3)]
    decisions = run([full, long_worker], *shorts,
                    make_request("l", lane="long", kv_tokens=16_000), ledger=ledger)
    assert placed(decisions) == []
