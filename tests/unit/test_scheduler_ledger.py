"""The reservation ledger: never overcommit, idempotent releases, reconcile (core.ledger)."""

from __future__ import annotations

import pytest

from services.scheduler import ConfigError, Ledger, WorkerState
from tests.builders import make_request, make_worker

# total 100,000, margin 5 % → usable 95,000
WORKER = make_worker("w0", kv_total_tokens=100_000)


@pytest.mark.parametrize(
    ("total", "margin", "usable"),
    [(100_000, 0.05, 95_000), (100_000, 0.0, 100_000), (1_001, 0.1, 900), (0, 0.05, 0)],
)
def test_usable_is_total_less_the_safety_margin(total: int, margin: float, usable: int) -> None:
    ledger = Ledger(kv_safety_margin=margin)
    assert ledger.usable_kv(make_worker(kv_total_tokens=total)) == usable


@pytest.mark.parametrize("margin", [-0.1, 1.0, 1.5])
def test_margin_out_of_range_is_a_config_error(margin: float) -> None:
    with pytest.raises(ConfigError) as caught:
        Ledger(kv_safety_margin=margin)
    assert caught.value.setting == "ledger.kv_safety_margin"


def test_reserve_refuses_to_overcommit() -> None:
    ledger = Ledger()
    assert ledger.reserve(WORKER, make_request("a", kv_tokens=90_000))
    assert ledger.reserve(WORKER, make_request("b", kv_tokens=5_000))  # exactly usable
    assert not ledger.reserve(WORKER, make_request("c", kv_tokens=1))
    assert ledger.reserved_kv("w0") == 95_000
    assert ledger.free_kv(WORKER) == 0


def test_duplicate_reserve_is_a_no_op() -> None:
    ledger = Ledger()
    request = make_request("a", kv_tokens=1_000)
    assert ledger.reserve(WORKER, request)
    assert ledger.reserve(WORKER, request)  # same worker: fine, counted once
    assert not ledger.reserve(make_worker("w1"), request)  # elsewhere: refused
    assert ledger.reserved_kv("w0") == 1_000 and ledger.reserved_kv("w1") == 0
    assert len(ledger) == 1


def test_release_is_idempotent_and_per_attempt() -> None:
    ledger = Ledger()
    ledger.reserve(WORKER, make_request("a", kv_tokens=1_000, attempt=0))
    ledger.reserve(WORKER, make_request("a", kv_tokens=1_000, attempt=1))
    assert ledger.release("a", 0) == 1_000
    assert ledger.release("a", 0) == 0
    assert ledger.release("zzz", 0) == 0
    assert ledger.reserved_kv("w0") == 1_000
    assert ledger.worker_of("a", 1) == "w0" and ledger.worker_of("a", 0) is None
    assert ledger.release("a", 1) == 1_000
    assert ledger.reserved_kv("w0") == 0 and len(ledger) == 0


@pytest.mark.parametrize(
    ("kv_free", "reserved", "started", "free"),
    [
        (100_000, 0, False, 95_000),  # idle: usable
        (100_000, 10_000, False, 85_000),  # ledger and heartbeat agree
        (100_000, 10_000, True, 85_000),  # started: the heartbeat (lagging) is advisory
        (50_000, 0, False, 45_000),  # the heartbeat shows load the ledger does not know
        (50_000, 10_000, False, 35_000),  # ... plus our unstarted reservation
        (50_000, 10_000, True, 45_000),  # started: already inside kv_free
        (3_000, 0, False, 0),  # below the margin: never negative
    ],
)
def test_free_kv_is_the_tighter_of_ledger_and_heartbeat(
    kv_free: int, reserved: int, started: bool, free: int
) -> None:
    ledger = Ledger()
    worker = make_worker("w0", kv_total_tokens=100_000, kv_free_tokens=kv_free)
    if reserved:
        assert ledger.reserve(worker, make_request("a", kv_tokens=reserved))
        if started:
            assert ledger.mark_started("a", 0)
    assert ledger.free_kv(worker) == free


@pytest.mark.parametrize(
    ("running", "waiting", "placed", "started", "in_flight"),
    [
        (0, 0, 0, 0, 0),
        (3, 1, 0, 0, 4),
        (0, 0, 2, 0, 2),  # assignments still on their way
        (0, 0, 2, 2, 2),  # started, heartbeat not yet showing them
        (2, 0, 2, 2, 2),  # the heartbeat caught up: counted once
        (5, 0, 2, 1, 6),  # unknown work + one unstarted
    ],
)
def test_in_flight_counts_engine_and_ledger_once(
    running: int, waiting: int, placed: int, started: int, in_flight: int
) -> None:
    ledger = Ledger()
    worker = make_worker("w0", running=running, waiting=waiting)
    for i in range(placed):
        ledger.reserve(worker, make_request(f"r{i}", kv_tokens=16))
    for i in range(started):
        ledger.mark_started(f"r{i}", 0)
    assert ledger.in_flight(worker) == in_flight


def test_room_is_zero_without_a_sequence_slot() -> None:
    ledger = Ledger()
    worker = make_worker("w0", running=1, max_num_seqs=2)
    assert ledger.room(worker) == 95_000
    ledger.reserve(worker, make_request("a", kv_tokens=16))
    assert ledger.room(worker) == 0


def test_reconcile_releases_what_was_seen_and_is_gone() -> None:
    ledger = Ledger()
    for rid in ("a", "b", "c"):
        ledger.reserve(WORKER, make_request(rid, kv_tokens=100))
    assert ledger.reconcile("w0", {("a", 0), ("b", 0), ("ghost", 0)}) == []
    ended = ledger.reconcile("w0", {("b", 0)})  # a finished; c was never seen: in flight
    assert [r.key for r in ended] == [("a", 0)]
    assert ledger.worker_of("c", 0) == "w0" and ledger.reserved_kv("w0") == 200
    assert ledger.release("a", 0) == 0  # its terminal event arrives later: no double free
    assert ledger.reconcile("nobody", {("x", 0)}) == []


def test_drop_worker_releases_everything_and_its_hold() -> None:
    ledger = Ledger()
    ledger.reserve(WORKER, make_request("a", kv_tokens=100, prefix_hash="p"))
    ledger.hold("w0", "big")
    dropped = ledger.drop_worker("w0")
    assert [r.key for r in dropped] == [("a", 0)]
    assert len(ledger) == 0 and ledger.holder("w0") is None and ledger.hold_of("big") is None
    assert ledger.affinity.get("p") is None


def test_holds_are_one_per_worker_and_per_request() -> None:
    ledger = Ledger()
    ledger.hold("w0", "a")
    ledger.hold("w1", "a")  # moving a's hold frees w0
    assert ledger.holder("w0") is None and ledger.hold_of("a") == "w1"
    ledger.hold("w1", "b")  # b takes w1 over
    assert ledger.hold_of("a") is None and dict(ledger.holds()) == {"w1": "b"}
    ledger.reserve(make_worker("w2"), make_request("b"))  # placed anywhere: hold ends
    assert dict(ledger.holds()) == {}


def test_reserve_records_prefix_affinity_and_the_last_worker() -> None:
    ledger = Ledger(affinity_capacity=2)
    ledger.reserve(make_worker("w0"), make_request("a", prefix_hash="p1"))
    ledger.reserve(make_worker("w1"), make_request("b", prefix_hash="p2"))
    ledger.reserve(make_worker("w2"), make_request("c", prefix_hash="p3"))
    assert ledger.affinity.get("p1") is None  # least recently placed, evicted
    assert ledger.affinity.get("p3") == "w2" and ledger.last_worker_id == "w2"


def test_change_log_reports_touched_workers_until_trimmed() -> None:
    ledger = Ledger(log_limit=16)
    start = ledger.cursor
    ledger.reserve(WORKER, make_request("a"))
    assert list(ledger.changes_since(start) or []) == ["w0"]
    for i in range(40):
        ledger.reserve(make_worker(f"x{i}"), make_request(f"x{i}"))
    assert ledger.changes_since(start) is None  # too old: rescan
    assert ledger.changes_since(ledger.cursor) == []


# -- releases since the last heartbeat ------------------------------------------------------


def _busy_worker(heartbeat_ts: float) -> WorkerState:
    """A worker whose heartbeat at ``heartbeat_ts`` still counts request "a" (10k KV)."""
    return make_worker(
        "w0", kv_total_tokens=100_000, kv_free_tokens=90_000, running=1, heartbeat_ts=heartbeat_ts
    )


@pytest.mark.parametrize(
    ("started_at", "released_at", "heartbeat_ts", "free", "in_flight"),
    [
        (1.0, 3.0, 2.0, 95_000, 0),  # ended after the heartbeat: credited back
        (1.0, 2.0, 2.0, 85_000, 1),  # ended at the heartbeat's instant: not credited
        (2.0, 3.0, 2.0, 85_000, 1),  # started at the heartbeat's instant: maybe not in it
        (1.0, 3.0, 4.0, 85_000, 1),  # a later heartbeat already shows it gone
        (None, 3.0, 2.0, 85_000, 1),  # start time unknown: no credit
        (1.0, None, 2.0, 85_000, 1),  # release time unknown: no credit
    ],
)
def test_a_release_after_the_heartbeat_is_credited_to_the_heartbeat_view(
    started_at: float | None,
    released_at: float | None,
    heartbeat_ts: float,
    free: int,
    in_flight: int,
) -> None:
    ledger = Ledger()
    worker = _busy_worker(heartbeat_ts)
    assert ledger.reserve(worker, make_request("a", kv_tokens=10_000))
    assert ledger.mark_started("a", 0, at=started_at)
    assert ledger.free_kv(worker) == 85_000  # ledger and heartbeat agree while it runs
    assert ledger.release("a", 0, at=released_at) == 10_000
    assert ledger.free_kv(worker) == free
    assert ledger.in_flight(worker) == in_flight
    assert ledger.headroom(worker) == free / 95_000


@pytest.mark.parametrize(("held_tokens", "free"), [
    (1_250, 33_800 + 1_264),  # ended with 1,250 tokens: 79 blocks of 16 credited
    (20_000, 33_800 + 10_000),  # never more than its reservation
    (None, 33_800 + 10_000),  # usage unknown: its reservation, as before
])
def test_a_credit_is_what_the_request_can_have_held_not_its_whole_reservation(
    held_tokens: int | None, free: int,
) -> None:
    # Something outside llmq holds 60k of the engine's KV, so the heartbeat view is the
    # tighter one. Request "a" reserved 10k (prompt 1,000 + max_tokens 9,000) and held
    # 1,200 at the heartbeat; it stopped early, at 1,250. Crediting the 10k reservation
    # put 8.8k of KV the engine never freed back into the view (the code before did).
    ledger = Ledger()
    worker = make_worker("w0", kv_total_tokens=100_000, kv_free_tokens=100_000 - 60_000 - 1_200,
                         running=1, heartbeat_ts=2.0)
    assert ledger.reserve(worker, make_request("a", kv_tokens=10_000))
    assert ledger.mark_started("a", 0, at=1.0)
    assert ledger.free_kv(worker) == 33_800  # 38,800 free − 5,000 of safety margin
    assert ledger.release("a", 0, at=3.0, held_tokens=held_tokens) == 10_000
    assert ledger.free_kv(worker) == free
    assert ledger.in_flight(worker) == 0  # its sequence is credited whatever it held


def test_credits_never_loosen_the_ledger_view_and_are_dropped_by_newer_heartbeats() -> None:
    ledger = Ledger()
    old = _busy_worker(2.0)
    assert ledger.reserve(old, make_request("a", kv_tokens=10_000))
    assert ledger.mark_started("a", 0, at=1.0)
    assert ledger.reserve(old, make_request("b", kv_tokens=80_000))
    assert ledger.release("a", 0, at=3.0) == 10_000
    assert ledger.release("a", 0, at=3.0) == 0  # a duplicate credits nothing more
    # the ledger's own view (95k usable − 80k reserved) stays the bound
    assert ledger.free_kv(old) == 15_000
    assert not ledger.reserve(old, make_request("c", kv_tokens=15_001))
    # a newer heartbeat (after the release) has the freed KV in kv_free: no credit left
    newer = make_worker("w0", kv_total_tokens=100_000, kv_free_tokens=100_000, heartbeat_ts=5.0)
    assert ledger.free_kv(newer) == 15_000
    assert ledger.free_kv(old) == 5_000  # re-asked about the old heartbeat: credit forgotten
    assert ledger._credits == {}  # and not kept: a worker that left kept one for good


def test_reconcile_releases_are_never_credited() -> None:
    ledger = Ledger()
    worker = _busy_worker(2.0)
    assert ledger.reserve(worker, make_request("a", kv_tokens=10_000))
    assert ledger.mark_started("a", 0, at=1.0)
    ledger.reconcile("w0", {("a", 0)})
    assert [r.key for r in ledger.reconcile("w0", set())] == [("a", 0)]
    assert ledger.free_kv(worker) == 85_000


def test_lane_count_tracks_reservations_per_lane() -> None:
    ledger = Ledger()
    worker = make_worker("w0")
    assert ledger.reserve(worker, make_request("s", lane="short"))
    assert ledger.reserve(worker, make_request("l", lane="long"))
    assert (ledger.lane_count("w0", "short"), ledger.lane_count("w0", "long")) == (1, 1)
    ledger.release("l", 0)
    assert ledger.lane_count("w0", "long") == 0
    assert ledger.lane_count("nobody", "short") == 0
