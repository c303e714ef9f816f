"""The worker's pure core, table by table: batching, dedupe, deadlines, offsets, heartbeat
fields, throughput; and that the core imports no infrastructure."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

from services.worker.core import (
    AttemptLedger,
    ChunkBatcher,
    GpuSample,
    OffsetTracker,
    RateMeter,
    RecentCancels,
    deadline_of,
    decode_done,
    encode_done,
    heartbeat_fields,
    timing,
)
from services.worker.core.lease import Lease
from services.worker.engines.base import EngineCapacity

# ---- batching ------------------------------------------------------------------------------

# Each step: (text, tokens, now) → expected chunk as (seq, text, tokens) or None.
BATCH_CASES = {
    "flush at N tokens": (
        dict(max_tokens=3, max_delay_s=1.0),
        [("a", 1, 0.0, None), ("b", 1, 0.1, None), ("c", 1, 0.2, (0, "abc", 3)),
         ("d", 1, 0.3, None)],
    ),
    "flush when the oldest token waited M": (
        dict(max_tokens=100, max_delay_s=0.05),
        [("a", 1, 0.0, None), ("b", 1, 0.04, None), ("c", 1, 0.05, (0, "abc", 3)),
         ("d", 1, 0.2, None), ("e", 1, 0.26, (1, "de", 2))],
    ),
    "multi-token deltas count their tokens": (
        dict(max_tokens=4, max_delay_s=1.0),
        [("ab", 2, 0.0, None), ("cde", 3, 0.0, (0, "abcde", 5))],
    ),
    "text without tokens waits for the next token": (
        dict(max_tokens=2, max_delay_s=0.0),
        [("", 0, 0.0, None), ("x", 0, 0.0, None), ("y", 1, 0.0, (0, "xy", 1))],
    ),
    "overflowing max_chars flushes the pending text first": (
        dict(max_tokens=100, max_delay_s=1.0, max_chars=4),
        [("abc", 1, 0.0, None), ("de", 1, 0.0, (0, "abc", 1)), ("f", 1, 0.0, None)],
    ),
    "zero delay flushes every token": (
        dict(max_tokens=100, max_delay_s=0.0),
        [("a", 1, 0.0, (0, "a", 1)), ("b", 1, 0.0, (1, "b", 1))],
    ),
}


@pytest.mark.parametrize("options, steps", BATCH_CASES.values(), ids=BATCH_CASES.keys())
def test_batcher_add(options: dict[str, float], steps: list[tuple[object, ...]]) -> None:
    batcher = ChunkBatcher(**options)  # type: ignore[arg-type]  # table of kwargs
    for text, tokens, now, want in steps:
        chunk = batcher.add(str(text), int(str(tokens)), float(str(now)))
        got = None if chunk is None else (chunk.seq, chunk.text, chunk.tokens)
        assert got == want, (text, now)


def test_batcher_flush_and_due_at() -> None:
    batcher = ChunkBatcher(max_tokens=16, max_delay_s=0.05)
    assert batcher.due_at() is None
    assert batcher.add("a", 1, 10.0) is None
    assert batcher.due_at() == pytest.approx(10.05)
    assert batcher.flush(10.01) is None  # not due yet
    chunk = batcher.flush(10.05)
    assert chunk is not None and (chunk.seq, chunk.text, chunk.tokens) == (0, "a", 1)
    assert batcher.due_at() is None and batcher.flush(99.0, force=True) is None
    batcher.add("b", 1, 11.0)
    forced = batcher.flush(11.0, force=True)
    assert forced is not None and forced.seq == 1
    assert (batcher.chunks, batcher.total_tokens) == (2, 2)


def test_batcher_reduces_messages_16x_under_load() -> None:
    batcher = ChunkBatcher(max_tokens=16, max_delay_s=0.05)
    chunks = [c for i in range(1600) if (c := batcher.add("w", 1, i * 0.001)) is not None]
    assert len(chunks) == 100 and all(c.tokens == 16 for c in chunks)
    assert [c.seq for c in chunks] == list(range(100))


def test_batcher_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        ChunkBatcher(max_tokens=0)
    with pytest.raises(ValueError):
        ChunkBatcher().add("x", -1, 0.0)


# ---- dedupe --------------------------------------------------------------------------------

LEDGER_CASES = {
    "first sight runs": ([], ("r", 1), "new"),
    "same attempt is a duplicate": ([("r", 1)], ("r", 1), "duplicate"),
    "lower attempt is stale": ([("r", 3)], ("r", 2), "stale"),
    "higher attempt supersedes": ([("r", 1)], ("r", 2), "newer"),
    "other requests do not matter": ([("q", 5)], ("r", 1), "new"),
    "the highest attempt is kept": ([("r", 1), ("r", 3), ("r", 2)], ("r", 2), "stale"),
    # admitted_at tells another admission of the id from a redelivery or a requeue.
    "another admission is a reuse": ([("r", 1, 100.0)], ("r", 1, 200.0), "reused"),
    "a requeue of the same admission": ([("r", 1, 100.0)], ("r", 2, 100.0), "newer"),
    "a redelivery of the same admission": ([("r", 1, 100.0)], ("r", 1, 100.0), "duplicate"),
    "the first admission is kept": ([("r", 1, 100.0), ("r", 2, 300.0)], ("r", 3, 300.0),
                                    "reused"),
    "unknown admissions compare by attempt": ([("r", 1)], ("r", 1, 200.0), "duplicate"),
}


@pytest.mark.parametrize("seen, arrival, want", LEDGER_CASES.values(), ids=LEDGER_CASES.keys())
def test_ledger(seen: list[tuple[Any, ...]], arrival: tuple[Any, ...], want: str) -> None:
    ledger = AttemptLedger()
    for record in seen:
        ledger.record(*record)
    assert ledger.admit(*arrival) == want


def test_ledger_memory_is_bounded_and_forgets_oldest() -> None:
    ledger = AttemptLedger(capacity=2)
    ledger.admit("a", 1)
    ledger.admit("b", 1)
    ledger.classify("a", 1)  # classify does not refresh
    ledger.admit("c", 1)
    assert len(ledger) == 2
    assert ledger.classify("a", 1) == "new"  # forgotten
    assert ledger.classify("b", 1) == "duplicate"
    assert ledger.admit("b", 1) == "duplicate" and len(ledger) == 2


CANCEL_CASES = {
    "recent cancel matches": (("r", "acme", 100.0), ("r", "acme", 159.0), True),
    "expired after ttl": (("r", "acme", 100.0), ("r", "acme", 160.0), False),
    "tenant mismatch is ignored": (("r", "acme", 100.0), ("r", "evil", 101.0), False),
    "other request": (("r", "acme", 100.0), ("q", "acme", 101.0), False),
}


@pytest.mark.parametrize("cancel, probe, want", CANCEL_CASES.values(), ids=CANCEL_CASES.keys())
def test_recent_cancels(cancel: tuple[str, str, float], probe: tuple[str, str, float],
                        want: bool) -> None:
    cancels = RecentCancels(ttl_s=60.0)
    cancels.add(*cancel)
    assert cancels.matches(*probe) is want


def test_recent_cancels_are_bounded() -> None:
    cancels = RecentCancels(ttl_s=60.0, capacity=3)
    for i in range(10):
        cancels.add(f"r{i}", "acme", 100.0 + i)
    assert len(cancels) == 3
    assert cancels.matches("r9", "acme", 110.0) and not cancels.matches("r0", "acme", 110.0)


# ---- deadlines and timings -----------------------------------------------------------------

DEADLINE_CASES = {
    "own budget": (1000.0, 30.0, None, 1030.0),
    "assigned deadline earlier wins": (1000.0, 30.0, 1010.0, 1010.0),
    "assigned deadline later cannot extend the budget": (1000.0, 30.0, 2000.0, 1030.0),
}


@pytest.mark.parametrize("created, timeout, assigned, want", DEADLINE_CASES.values(),
                         ids=DEADLINE_CASES.keys())
def test_deadline_of(created: float, timeout: float, assigned: float | None,
                     want: float) -> None:
    assert deadline_of(created, timeout, assigned) == want


TIMING_CASES = {
    "normal": ((100.0, 100.5, 101.0, 103.0), (0.5, 1.0, 3.0)),
    "no token": ((100.0, 100.5, None, 103.0), (0.5, None, 3.0)),
    "clock skew clamps at zero": ((100.0, 99.0, 99.5, 99.9), (0.0, 0.0, 0.0)),
}


@pytest.mark.parametrize("args, want", TIMING_CASES.values(), ids=TIMING_CASES.keys())
def test_timing(args: tuple[float, float, float | None, float],
                want: tuple[float, float | None, float]) -> None:
    t = timing(*args)
    assert (t.queued_s, t.ttft_s, t.e2e_s) == pytest.approx(want)


# ---- offsets -------------------------------------------------------------------------------

# Operations: ("b", offset) begin → expect bool; ("f", offset) finish; ("m",) build commit
# metadata (done_above); ("c", offset) the commit succeeded. Then the commit point and the
# finished offsets above it.
OFFSET_CASES = {
    "nothing seen": ((None, None), [], None, []),
    "in order": ((None, None), [("b", 0, True), ("f", 0), ("b", 1, True), ("f", 1)], 2, []),
    "out of order holds at the lowest open": (
        (None, None), [("b", 5, True), ("b", 6, True), ("b", 7, True), ("f", 7), ("f", 6)],
        5, [6, 7],
    ),
    "gaps in offsets are fine": ((None, None), [("b", 3, True), ("b", 9, True), ("f", 3),
                                                ("f", 9)], 10, []),
    "redelivery is refused": ((None, None), [("b", 4, True), ("b", 4, False), ("f", 4),
                                             ("b", 4, False)], 5, []),
    "restart skips finished hints but re-reads the rest": (
        (10, {12, 13}),
        [("b", 10, True), ("b", 11, True), ("b", 12, False), ("b", 13, False), ("f", 10)],
        11, [12, 13],
    ),
    "restart hints do not advance the point alone": ((10, {12}), [], 10, [12]),
    "below the committed point is refused": ((10, None), [("b", 9, False)], 10, []),
    "a failed commit still refuses what finished": (
        (0, None), [("b", 0, True), ("b", 1, True), ("f", 0), ("f", 1), ("m",),
                    ("b", 1, False)],  # the commit failed; a rebalance redelivers 1
        2, [],
    ),
    "a commit covers what finished below it": (
        (0, None), [("b", 0, True), ("b", 1, True), ("b", 2, True), ("f", 0), ("f", 2),
                    ("m",), ("c", 1), ("b", 0, False), ("b", 2, False), ("f", 1)],
        3, [],
    ),
}


@pytest.mark.parametrize("start, ops, point, above", OFFSET_CASES.values(),
                         ids=OFFSET_CASES.keys())
def test_offset_tracker(start: tuple[int | None, set[int] | None],
                        ops: list[tuple[object, ...]], point: int | None,
                        above: list[int]) -> None:
    tracker = OffsetTracker(*start)
    for op in ops:
        if op[0] == "b":
            assert tracker.begin(int(str(op[1]))) is op[2], op
        elif op[0] == "f":
            tracker.finish(int(str(op[1])))
        elif op[0] == "m":
            tracker.done_above()
        else:
            tracker.committed(int(str(op[1])))
    assert tracker.commit_point() == point
    assert tracker.done_above() == above


def test_done_metadata_round_trip_and_bound() -> None:
    meta = encode_done(100, [101, 105, 250])
    assert decode_done(100, meta) == {101, 105, 250}
    short = encode_done(0, list(range(1, 10_000)), max_chars=100)
    kept = decode_done(0, short)
    assert len(short) <= 100 and kept == set(range(1, len(kept) + 1))  # a prefix of the list
    assert decode_done(0, "") == set() and decode_done(0, "foreign metadata") == set()
    assert decode_done(0, "llmq-done:1,x,-2,3") == {1, 3}


# ---- heartbeat fields ----------------------------------------------------------------------

CAP = EngineCapacity(
    kv_total_tokens=1000, kv_free_tokens=400, kv_total_bytes=1000 * 128,
    kv_free_bytes=400 * 128, block_size=16, running=3, waiting=2, max_num_seqs=8,
    vram_total_bytes=0, vram_used_bytes=0, gpu_util=None, tokens_per_s=12.5,
)

HB_CASES = {
    "engine figures without a GPU": (
        CAP, None, 0, None,
        dict(kv_free_tokens=400, vram_total_bytes=0, vram_used_bytes=0, gpu_util=None,
             waiting=2, tokens_per_s=12.5),
    ),
    "NVML wins for VRAM and utilisation": (
        CAP, GpuSample(80, 60, 0.5), 0, None,
        dict(vram_total_bytes=80, vram_used_bytes=60, gpu_util=0.5),
    ),
    "held-back assignments count as waiting": (CAP, None, 5, None, dict(waiting=7)),
    "measured rate overrides the engine's": (CAP, None, 0, 99.0, dict(tokens_per_s=99.0)),
    "free above total is clamped": (
        replace(CAP, kv_free_tokens=5000, kv_free_bytes=-1), GpuSample(10, 20, 1.5), 0, -1.0,
        dict(kv_free_tokens=1000, kv_free_bytes=0, vram_used_bytes=10, gpu_util=1.0,
             tokens_per_s=0.0),
    ),
    "degenerate engine still yields a valid heartbeat": (
        replace(CAP, block_size=0, max_num_seqs=0, running=-1), None, 0, None,
        dict(block_size=1, max_num_seqs=1, running=0),
    ),
    # Figures the wire cannot carry: the KV is unknown (no new work), the rest capped.
    "a block size the wire cannot carry makes the KV unknown": (
        replace(CAP, block_size=1 << 17), None, 0, None,
        dict(kv_total_tokens=0, kv_free_tokens=0, kv_total_bytes=0, block_size=1 << 16),
    ),
    "absurd counts are capped, not a number is none": (
        replace(CAP, running=10**19, waiting=10**19, max_num_seqs=10**9),
        GpuSample(10**20, 5, float("nan")), 0, float("nan"),
        dict(running=(1 << 63) - 1, waiting=(1 << 63) - 1, max_num_seqs=1 << 20,
             vram_total_bytes=(1 << 63) - 1, gpu_util=None, tokens_per_s=0.0),
    ),
}


@pytest.mark.parametrize("cap, gpu, held, rate, want", HB_CASES.values(), ids=HB_CASES.keys())
def test_heartbeat_fields(cap: EngineCapacity, gpu: GpuSample | None, held: int,
                          rate: float | None, want: dict[str, object]) -> None:
    fields = heartbeat_fields(cap, gpu, held_back=held, tokens_per_s=rate)
    for name, value in want.items():
        assert getattr(fields, name) == value, name


def test_heartbeat_fields_make_a_valid_wire_heartbeat() -> None:
    from dataclasses import asdict

    from tests.builders_schemas import make_heartbeat

    fields = heartbeat_fields(replace(CAP, kv_free_tokens=10**9), GpuSample(1, 5, 2.0))
    hb = make_heartbeat(**asdict(fields))
    assert hb.kv_free_tokens == hb.kv_total_tokens and hb.gpu_util == 1.0
    # A heartbeat that cannot be built stops the worker: none of these may stop it.
    for cap, gpu in HB_CASES_ABSURD:
        make_heartbeat(**asdict(heartbeat_fields(cap, gpu, tokens_per_s=float("inf"))))


HB_CASES_ABSURD = [
    (replace(CAP, block_size=1 << 20, kv_total_tokens=1 << 70, kv_free_tokens=1 << 70), None),
    (replace(CAP, running=1 << 64, max_num_seqs=1 << 30, kv_total_bytes=1 << 64),
     GpuSample(1 << 64, 1 << 64, float("inf"))),
]


# ---- throughput ----------------------------------------------------------------------------


def test_rate_meter_window() -> None:
    meter = RateMeter(window_s=10)
    assert meter.rate(0.0) == 0.0
    for t in range(20):
        meter.add(100, 1000.0 + t)
    assert meter.rate(1100.0) == 0.0  # all buckets aged out
    fresh = RateMeter(window_s=10)
    fresh.add(50, 5.0)
    fresh.add(50, 6.0)
    assert fresh.rate(7.0) == pytest.approx(50.0)  # over 2 s, not diluted over 10
    assert fresh.total == 100


@pytest.mark.parametrize("phase", [0.01, 0.25, 0.5, 0.75, 0.99])
def test_a_steady_rate_reads_the_same_at_any_phase_of_the_second(phase: float) -> None:
    """Found by an audit: dividing nine whole buckets and the current part of one by ten
    seconds read a steady 1,000 tokens/s as 901 … 999 by the phase of the read."""
    meter = RateMeter(window_s=10)
    now = 1019.0 + phase
    for i in range(1, 2000):  # 10 tokens every 10 ms (1,000 per second) until now
        if 1000.0 + i / 100 <= now:
            meter.add(10, 1000.0 + i / 100)
    assert meter.rate(now) == pytest.approx(1000.0, rel=0.012)


# ---- purity --------------------------------------------------------------------------------


def test_core_imports_no_infrastructure() -> None:
    forbidden = ("faust", "aiokafka", "consul", "vllm", "pynvml", "httpx")
    code = ("import services.worker.core, sys; "
            f"print([m for m in {forbidden!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_cancel_naming_another_tenant_does_not_erase_the_right_one() -> None:
    cancels = RecentCancels(ttl_s=60.0)
    cancels.add("r1", "acme", 100.0)
    cancels.add("r1", "mallory", 101.0)
    assert cancels.matches("r1", "acme", 102.0) and cancels.matches("r1", "mallory", 102.0)
    assert not cancels.matches("r1", "acme", 160.0)  # its own ttl, from its own add


# -- lease ------------------------------------------------------------------------------
def test_lease_holds_for_its_limit_after_the_newest_acknowledged_beat() -> None:
    lease = Lease(limit_s=2.75, beat_at=100.0)
    assert lease.valid(102.75) and not lease.valid(102.76)
    assert lease.acked(beat_at=101.0, acked_at=101.01) == "valid"  # a beat a second later
    assert lease.valid(103.75) and not lease.valid(103.76)  # counts from its creation
    assert lease.check(103.75) == "valid"


def test_lease_acknowledged_too_late_breaks_the_chain() -> None:
    """A beat that became visible after the previous one went stale: the scheduler may have
    declared the worker dead in between, however fresh this beat is. Without asking, that
    fences at once."""
    lease = Lease(limit_s=2.75, beat_at=100.0)
    assert lease.acked(beat_at=104.0, acked_at=104.01) == "fence"  # paused 4 s, one beat
    lease.restart(104.02)
    assert lease.valid(106.77) and not lease.valid(106.78)


def test_lease_ignores_an_older_beat_acknowledged_late() -> None:
    lease = Lease(limit_s=2.75, beat_at=100.0)
    lease.restart(110.0)  # fenced: a new incarnation
    assert lease.acked(beat_at=109.0, acked_at=110.5) == "valid"  # sent before the fence
    assert lease.beat_at == 110.0


def test_a_lapsed_lease_asks_once_then_holds_until_granted() -> None:
    lease = Lease(limit_s=2.75, beat_at=100.0, ask_s=2.0)
    assert lease.check(102.8) == "ask"  # the caller sends a renewing heartbeat now
    assert lease.asking and not lease.valid(102.8)
    assert lease.check(103.0) == "asking"
    # An ack while asking proves nothing: the scheduler may have decided in the gap.
    assert lease.acked(beat_at=102.85, acked_at=102.9) == "asking"
    assert not lease.valid(103.0)
    assert lease.granted(beat_at=102.85, now=103.1)
    assert lease.valid(103.1) and not lease.asking
    assert lease.valid(105.6) and not lease.valid(105.61)  # from the granted beat's creation


def test_a_lease_acknowledged_too_late_asks_when_it_may() -> None:
    lease = Lease(limit_s=2.75, beat_at=100.0, ask_s=2.0)
    assert lease.acked(beat_at=104.0, acked_at=104.01) == "ask"
    assert lease.beat_at == 100.0  # only a grant moves it now


def test_an_unanswered_ask_fences_after_ask_s() -> None:
    lease = Lease(limit_s=2.75, beat_at=100.0, ask_s=2.0)
    assert lease.check(103.0) == "ask"
    assert lease.check(105.0) == "asking"
    assert lease.check(105.01) == "fence"
    assert lease.acked(beat_at=104.0, acked_at=105.02) == "fence"


def test_a_grant_of_a_beat_already_stale_keeps_asking() -> None:
    """A grant that arrives after its own beat's lease would have run out renews nothing:
    the worker asks again with a newer beat, and the asking's deadline stands."""
    lease = Lease(limit_s=2.75, beat_at=100.0, ask_s=5.0)
    assert lease.check(103.0) == "ask"
    assert not lease.granted(beat_at=103.0, now=105.9)
    assert lease.asking and lease.check(105.9) == "asking"
    assert lease.check(108.01) == "fence"  # 5 s from the first lapse, not from the grant


def test_a_grant_without_asking_changes_nothing() -> None:
    lease = Lease(limit_s=2.75, beat_at=100.0, ask_s=2.0)
    assert not lease.granted(beat_at=101.0, now=101.1)
    assert lease.beat_at == 100.0


def test_a_restart_ends_the_asking() -> None:
    lease = Lease(limit_s=2.75, beat_at=100.0, ask_s=2.0)
    assert lease.check(103.0) == "ask"
    lease.restart(103.5)
    assert lease.check(103.6) == "valid"


def test_lease_rejects_a_non_positive_limit() -> None:
    with pytest.raises(ValueError, match="limit_s"):
        Lease(limit_s=0.0, beat_at=0.0)
    with pytest.raises(ValueError, match="ask_s"):
        Lease(limit_s=1.0, beat_at=0.0, ask_s=-1.0)
