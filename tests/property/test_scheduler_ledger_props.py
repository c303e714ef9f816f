"""(e) The ledger under any order of reserves, releases, duplicates and heartbeats.

A hypothesis state machine drives a real :class:`Ledger` next to a plain model (a dict of
reservations). Whatever the order — duplicate or unknown releases, releases before or after
a heartbeat noticed the end, workers dropped — the ledger agrees with the model, never
goes negative, never frees a reservation twice and never holds more than usable KV.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.scheduler import Ledger, PlacementContext, WorkerState
from services.scheduler.policies.filters import kv_fits, seq_slots
from tests.builders import NOW, make_request, make_snapshot, make_worker

WORKERS = [make_worker(f"w{i}", kv_total_tokens=t) for i, t in enumerate([1_000, 4_000, 9_000])]
IDS = st.sampled_from([f"r{i}" for i in range(8)])
ATTEMPTS = st.integers(0, 1)
WORKER = st.sampled_from(WORKERS)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(kv_safety_margin=0.1)
        self.model: dict[tuple[str, int], tuple[str, int]] = {}  # key -> (worker, kv)
        self.seen: set[tuple[str, int]] = set()

    def on(self, worker: WorkerState) -> dict[tuple[str, int], int]:
        return {k: kv for k, (w, kv) in self.model.items() if w == worker.worker_id}

    @rule(worker=WORKER, rid=IDS, attempt=ATTEMPTS, kv=st.integers(1, 5_000))
    def reserve(self, worker: WorkerState, rid: str, attempt: int, kv: int) -> None:
        key = (rid, attempt)
        ok = self.ledger.reserve(worker, make_request(rid, attempt=attempt, kv_tokens=kv))
        if key in self.model:
            assert ok is (self.model[key][0] == worker.worker_id)
            return
        fits = sum(self.on(worker).values()) + kv <= self.ledger.usable_kv(worker)
        assert ok is fits
        if ok:
            self.model[key] = (worker.worker_id, kv)

    @rule(rid=IDS, attempt=ATTEMPTS)
    def release(self, rid: str, attempt: int) -> None:
        expected = self.model.pop((rid, attempt), (None, 0))[1]
        self.seen.discard((rid, attempt))
        assert self.ledger.release(rid, attempt) == expected

    @rule(rid=IDS, attempt=ATTEMPTS)
    def started(self, rid: str, attempt: int) -> None:
        assert self.ledger.mark_started(rid, attempt) is ((rid, attempt) in self.model)

    @rule(worker=WORKER, held=st.sets(st.tuples(IDS, ATTEMPTS), max_size=6))
    def heartbeat(self, worker: WorkerState, held: set[tuple[str, int]]) -> None:
        mine = self.on(worker)
        ended = {k for k in mine if k not in held and k in self.seen}
        self.seen |= {k for k in held if k in mine}
        released = self.ledger.reconcile(worker.worker_id, held)
        assert {r.key for r in released} == ended
        for key in ended:
            del self.model[key]
            self.seen.discard(key)

    @rule(worker=WORKER)
    def worker_dies(self, worker: WorkerState) -> None:
        mine = self.on(worker)
        assert {r.key for r in self.ledger.drop_worker(worker.worker_id)} == set(mine)
        for key in mine:
            del self.model[key]
            self.seen.discard(key)

    @invariant()
    def agrees_and_never_overcommits(self) -> None:
        assert len(self.ledger) == len(self.model)
        for worker in WORKERS:
            reserved = self.ledger.reserved_kv(worker.worker_id)
            assert reserved == sum(self.on(worker).values())
            assert 0 <= reserved <= self.ledger.usable_kv(worker)
            assert self.ledger.free_kv(worker) >= 0
            assert 0 <= self.ledger.in_flight(worker) <= len(self.on(worker))


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_ledger_state_machine = LedgerMachine.TestCase


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(0, 20_000),
    reported_free=st.integers(0, 20_000),
    running=st.integers(0, 6),
    waiting=st.integers(0, 3),
    max_num_seqs=st.integers(0, 8),
    placed=st.lists(st.tuples(st.integers(1, 4_000), st.booleans()), max_size=6),
    kv=st.integers(1, 20_000),
)
def test_index_room_is_exactly_kv_fits_and_seq_slots(
    total: int,
    reported_free: int,
    running: int,
    waiting: int,
    max_num_seqs: int,
    placed: list[tuple[int, bool]],
    kv: int,
) -> None:
    """The candidate index yields a worker iff both index-stage filters would accept it."""
    ledger = Ledger()
    worker = make_worker(
        kv_total_tokens=total,
        kv_free_tokens=reported_free,
        running=running,
        waiting=waiting,
        max_num_seqs=max_num_seqs,
    )
    for i, (tokens, started) in enumerate(placed):
        if ledger.reserve(worker, make_request(f"p{i}", kv_tokens=tokens)) and started:
            ledger.mark_started(f"p{i}", 0)
    ctx = PlacementContext(make_snapshot([worker]), ledger, NOW)
    request = make_request(kv_tokens=kv)
    both = all(
        f.accepts(worker, request, ctx) for f in (kv_fits.factory({}), seq_slots.factory({}))
    )
    assert (ledger.room(worker) >= kv) is both
