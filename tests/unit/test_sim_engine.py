"""The sim engine core against hand-computed schedules (times in µs in the comments)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from services.worker.engines.sim.capacity import latency_alone, saturated_capacity
from services.worker.engines.sim.model import (
    EngineProfile,
    SeqEvent,
    SimEngineCore,
    SimRequest,
    to_ns,
)

US = 1e-6


def make_profile(**overrides: object) -> EngineProfile:
    """β0 = 1000 µs, β1 = 10 µs/prefill token, β2 = 2 µs/decode token, roomy KV."""
    base = EngineProfile(
        name="test",
        beta0_s=1000 * US,
        beta1_s_per_prefill_tok=10 * US,
        beta2_s_per_decode_tok=2 * US,
        num_blocks=10_000,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        kv_bytes_per_token=131_072,
        source="test",
    )
    return replace(base, **overrides)  # type: ignore[arg-type]  # test builder, kwargs vary


@dataclass
class Record:
    first_token_s: float | None = None
    finish_s: float | None = None
    preempted_at: list[float] | None = None
    preemptions: int = 0


def records(events: Sequence[SeqEvent]) -> dict[int, Record]:
    out: dict[int, Record] = {}
    for e in events:
        rec = out.setdefault(e.seq_id, Record(preempted_at=[]))
        if e.kind == "first_token":
            rec.first_token_s = e.time_s
        elif e.kind == "finished":
            rec.finish_s = e.time_s
            rec.preemptions = e.preemptions
        else:
            assert rec.preempted_at is not None
            rec.preempted_at.append(e.time_s)
    return out


def run(profile: EngineProfile, reqs: Sequence[SimRequest], mode: str) -> dict[int, Record]:
    """Add each request at its arrival; ``mode`` "step" steps one by one, "advance" jumps."""
    core = SimEngineCore(profile)
    events: list[SeqEvent] = []
    for req in sorted(reqs, key=lambda r: r.arrival_s):
        if mode == "advance":
            events += core.advance(req.arrival_s)
        else:
            while core.has_work and to_ns(core.next_step_s or 0.0) < to_ns(req.arrival_s):
                events += core.step(core.next_step_s or 0.0).events
        core.add(req, req.arrival_s)
    if mode == "advance":
        events += core.advance(None)
    else:
        while core.has_work:
            events += core.step(core.next_step_s or 0.0).events
    assert core.free_blocks == profile.num_blocks
    return records(events)


MODES = pytest.mark.parametrize("mode", ["step", "advance"])


def tiny_pool(max_num_seqs: int) -> EngineProfile:
    """The preemption cases: 4 blocks of 4 tokens, budget 64, β = 1000 / 10 / 1 µs."""
    return make_profile(num_blocks=4, block_size=4, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=64, beta2_s_per_decode_tok=1 * US)


def test_one_request_alone_step_by_step() -> None:
    core = SimEngineCore(make_profile())
    core.add(SimRequest(1, prompt_tokens=100, max_output_tokens=5), 0.0)
    first = core.step(0.0)  # prefill 100: 1000 + 10·100 = 2000 µs, samples token 1
    assert first.duration_s == pytest.approx(2000 * US)
    assert (first.prefill_tokens, first.decode_tokens) == (100, 0)
    assert first.first_tokens == (1,) and first.emitted == (1,)
    rest = [core.step(core.next_step_s or 0.0) for _ in range(4)]  # 4 decodes of 1002 µs
    assert [r.duration_s for r in rest] == pytest.approx([1002 * US] * 4)
    assert all(r.emitted == (1,) and r.decode_tokens == 1 for r in rest)
    assert rest[-1].finished == (1,) and not core.has_work
    assert rest[-1].start_s + rest[-1].duration_s == pytest.approx(6008 * US)
    assert core.steps == 5 and (core.prefill_tokens, core.decode_tokens) == (100, 4)
    assert latency_alone(make_profile(), 100, 5) == pytest.approx((2000 * US, 6008 * US))


@MODES
def test_chunked_prefill_spreads_over_steps(mode: str) -> None:
    # 20,000 prompt tokens, budget 8192: chunks 8192, 8192, 3616 → TTFT = 3·1000 + 200,000.
    rec = run(make_profile(), [SimRequest(1, 20_000, 2)], mode)[1]
    assert rec.first_token_s == pytest.approx(203_000 * US)
    assert rec.finish_s == pytest.approx(204_002 * US)
    assert latency_alone(make_profile(), 20_000, 2) == pytest.approx((203_000 * US, 204_002 * US))


def test_partial_prefill_emits_nothing() -> None:
    core = SimEngineCore(make_profile())
    core.add(SimRequest(1, 20_000, 2), 0.0)
    steps = [core.step(core.next_step_s or 0.0) for _ in range(3)]
    assert [s.prefill_tokens for s in steps] == [8192, 8192, 3616]
    assert [s.emitted for s in steps] == [(), (), (1,)]


@MODES
def test_two_requests_share_steps(mode: str) -> None:
    # Step 1: both prefill, 1000 + 10·400 = 5000. Step 2: two decodes, 1004 → seq 1 done.
    # Step 3: one decode, 1002 → seq 2 done at 7006.
    recs = run(make_profile(), [SimRequest(1, 100, 2), SimRequest(2, 300, 3)], mode)
    assert recs[1].first_token_s == recs[2].first_token_s == pytest.approx(5000 * US)
    assert recs[1].finish_s == pytest.approx(6004 * US)
    assert recs[2].finish_s == pytest.approx(7006 * US)


@MODES
def test_arrival_mid_step_joins_next_step_as_mixed_batch(mode: str) -> None:
    # Seq 1 runs steps [0, 2000) and [2000, 3002); seq 2 arrives at 2500 and is prefilled
    # in the step at 3002 beside seq 1's decode: 1000 + 10·50 + 2·1 = 1502 → 4504.
    reqs = [SimRequest(1, 100, 10), SimRequest(2, 50, 1, arrival_s=2500 * US)]
    recs = run(make_profile(), reqs, mode)
    assert recs[2].first_token_s == recs[2].finish_s == pytest.approx(4504 * US)
    # Seq 1 has 3 tokens at 4504, then 7 more decodes of 1002 = 11518.
    assert recs[1].finish_s == pytest.approx(11_518 * US)


@MODES
@pytest.mark.parametrize(("late_priority", "order"), [(0, (3, 2)), (2, (2, 3))])
def test_waiting_queue_is_served_by_priority_then_arrival(
    mode: str, late_priority: int, order: tuple[int, int]
) -> None:
    # One sequence slot. Seq 1 (10 in, 3 out) runs: prefill 1100, two decodes of 1002 →
    # done at 3104. Seqs 2 (priority 2, at 100) and 3 (at 200) wait; at 3104 the better
    # priority goes first (10 in, 1 out: 1100 → 4204), the other next (→ 5304). Equal
    # priorities are FCFS: vLLM's priority policy orders by (priority, arrival).
    profile = make_profile(max_num_seqs=1, max_num_batched_tokens=64)
    reqs = [
        SimRequest(1, 10, 3, priority=2),
        SimRequest(2, 10, 1, arrival_s=100 * US, priority=2),
        SimRequest(3, 10, 1, arrival_s=200 * US, priority=late_priority),
    ]
    recs = run(profile, reqs, mode)
    assert recs[1].finish_s == pytest.approx(3104 * US)
    first, second = order
    assert recs[first].finish_s == pytest.approx(4204 * US)
    assert recs[second].finish_s == pytest.approx(5304 * US)


@MODES
def test_preempted_sequence_keeps_its_priority_place(mode: str) -> None:
    # The preemption case below (A, B: 4 in, 9 out, priority 1; 4 blocks of 4; 2 slots)
    # with C (1 in, 1 out) arriving at 2000 with priority 0. B is preempted at 5088 and goes
    # back to waiting BEHIND C, which has the better priority (under FCFS it would block C
    # until A ends). The preempting step admits nobody: A alone, 1001 → 6089. Then C (its
    # one block is free) joins A: 1000 + 10·1 + 1·1 → C done at 7100; A's last two
    # decodes → 9102; B recomputes 9 tokens (1090 → 10_192) and decodes 3 more → 13_195.
    profile = tiny_pool(max_num_seqs=2)
    reqs = [SimRequest(1, 4, 9, priority=1), SimRequest(2, 4, 9, priority=1),
            SimRequest(3, 1, 1, arrival_s=2000 * US, priority=0)]
    recs = run(profile, reqs, mode)
    assert recs[2].preempted_at == pytest.approx([5088 * US])
    assert recs[3].first_token_s == recs[3].finish_s == pytest.approx(7100 * US)
    assert recs[1].finish_s == pytest.approx(9102 * US)
    assert recs[2].finish_s == pytest.approx(13_195 * US)


@MODES
def test_max_num_seqs_caps_the_batch(mode: str) -> None:
    # Two fit: prefill 20 (1200), two decode steps of 1004 → both done at 3208. Then the
    # third: prefill 10 (1100) → 4308, two decodes of 1002 → 6312.
    profile = make_profile(max_num_seqs=2, max_num_batched_tokens=64)
    recs = run(profile, [SimRequest(i, 10, 3) for i in (1, 2, 3)], mode)
    assert recs[1].finish_s == recs[2].finish_s == pytest.approx(3208 * US)
    assert recs[3].first_token_s == pytest.approx(4308 * US)
    assert recs[3].finish_s == pytest.approx(6312 * US)


@MODES
def test_kv_exhaustion_preempts_newest_which_recomputes_and_finishes(mode: str) -> None:
    # 4 blocks of 4 tokens, β = 1000 / 10 / 1 µs. A and B: 4-token prompts, 9 outputs.
    # Step 1 (0→1080): both prefill (1 block each), first tokens. Step 2 (→2082): both cross
    # into a 2nd block (pool empty). Steps 3-5 (→5088): no new blocks. Step 6 at 5088: both
    # need a 3rd block; A (oldest) gets B's 2 blocks: B preempted (5 tokens generated) to the
    # front of waiting. Steps 6-9 (1001 each) A alone, done at 9092 (3 blocks freed). Step
    # 10: B recomputes 4 + 5 = 9 tokens (1000 + 90 → 10182) and samples its 6th token;
    # 3 decodes of 1001 → 13185.
    profile = tiny_pool(max_num_seqs=8)
    recs = run(profile, [SimRequest(1, 4, 9), SimRequest(2, 4, 9)], mode)
    a, b = recs[1], recs[2]
    assert a.first_token_s == b.first_token_s == pytest.approx(1080 * US)
    assert a.preemptions == 0 and a.finish_s == pytest.approx(9092 * US)
    assert b.preempted_at == pytest.approx([5088 * US])
    assert b.preemptions == 1 and b.finish_s == pytest.approx(13_185 * US)


@MODES
def test_kv_exhaustion_preempts_the_lowest_class_not_the_newest(mode: str) -> None:
    # 4 blocks of 4. A (4 in, 9 out, priority 2) at 0: prefill → 1040. B (4 in, 9 out,
    # priority 1) arrives at 500 and joins step 2 (1000 + 40 + 1 → 2081). Steps 3-5 decode
    # both (1002 each → 5087); the pool is empty. At 5087 A needs its 3rd block. FCFS would
    # preempt B, the newest; vLLM's priority policy preempts the largest (priority,
    # arrival), A itself. B decodes alone, 5 → 9 tokens at 6088 … 10092; A recomputes
    # 4 + 5 tokens (1090 → 11182) and decodes 3 more → 14185.
    profile = tiny_pool(max_num_seqs=8)
    reqs = [SimRequest(1, 4, 9, priority=2), SimRequest(2, 4, 9, arrival_s=500 * US, priority=1)]
    recs = run(profile, reqs, mode)
    a, b = recs[1], recs[2]
    assert a.first_token_s == pytest.approx(1040 * US)
    assert b.first_token_s == pytest.approx(2081 * US)
    assert b.preemptions == 0 and b.finish_s == pytest.approx(10_092 * US)
    assert a.preempted_at == pytest.approx([5087 * US])
    assert a.preemptions == 1 and a.finish_s == pytest.approx(14_185 * US)


@MODES
def test_a_victim_given_its_block_in_the_same_step_hands_it_back(mode: str) -> None:
    # 5 blocks of 4. A (4 in, 9 out, priority 2) at 0: prefill → 1040. B (5 in, 9 out,
    # priority 0) arrives at 500 and joins step 2 (1000 + 50 + 1 → 2091; A holds 2 blocks,
    # B 2, 1 free). Steps 3-5 decode both (1002 each → 5097). At 5097 both need a 3rd
    # block: A, first in running order, gets the free one; B finds none, and the victim is
    # A (priority 2), which returns that block with its own 2. B decodes alone: 5 → 9
    # tokens at 6098 … 10102. A recomputes 4 + 5 tokens (1090 → 11192), 3 decodes → 14195.
    # A leaked block would leave the pool short at the end (``run`` checks it is whole).
    profile = replace(tiny_pool(max_num_seqs=8), num_blocks=5)
    reqs = [SimRequest(1, 4, 9, priority=2), SimRequest(2, 5, 9, arrival_s=500 * US)]
    recs = run(profile, reqs, mode)
    a, b = recs[1], recs[2]
    assert a.first_token_s == pytest.approx(1040 * US)
    assert b.first_token_s == pytest.approx(2091 * US)
    assert a.preempted_at == pytest.approx([5097 * US])
    assert b.preemptions == 0 and b.finish_s == pytest.approx(10_102 * US)
    assert a.finish_s == pytest.approx(14_195 * US)


def test_mixed_priorities_keep_the_block_pool_whole() -> None:
    # Random small workloads with classes 0-2 and a scarce pool (many preemptions, victims
    # anywhere in running order): after every call the blocks held + free = the pool, and
    # every sequence finishes exactly once.
    rng = random.Random(11)
    preempted = 0
    for _ in range(200):
        profile = make_profile(num_blocks=rng.randint(20, 120), block_size=rng.choice([4, 16]),
                               max_num_seqs=rng.choice([4, 8, 32]),
                               max_num_batched_tokens=rng.choice([32, 64, 256]))
        core = SimEngineCore(profile)
        events: list[SeqEvent] = []
        now, added = 0.0, set()
        for seq_id in range(rng.randint(5, 40)):
            prompt, output = rng.randint(1, 120), rng.randint(1, 80)
            if prompt + output > profile.kv_total_tokens:
                continue
            now += rng.expovariate(20)
            events += core.advance(now)
            core.add(SimRequest(seq_id, prompt, output, priority=rng.randint(0, 2)), now)
            added.add(seq_id)
            assert core.blocks_held() + core.free_blocks == profile.num_blocks
        while core.has_work:
            events += core.step(core.next_step_s or 0.0).events
            assert core.blocks_held() + core.free_blocks == profile.num_blocks
        finished = [e.seq_id for e in events if e.kind == "finished"]
        assert sorted(finished) == sorted(added)
        preempted += core.preemptions
    assert preempted > 1000  # the pools were scarce enough to exercise preemption


@MODES
def test_preempted_sequence_goes_back_to_the_front_of_the_queue(mode: str) -> None:
    # As above with max_num_seqs = 2 and C (1 token in, 1 out) queued behind A and B. B is
    # preempted at 5088 and queued AHEAD of C; B needs 3 blocks, 1 is free, and FCFS lets
    # nothing pass it, so C waits although its 1 block would fit. At 9092 (A done) B and
    # C are admitted together: 1000 + 10·(9 + 1) = 1100 → C done at 10192, B 3 decodes later.
    profile = tiny_pool(max_num_seqs=2)
    recs = run(profile, [SimRequest(1, 4, 9), SimRequest(2, 4, 9), SimRequest(3, 1, 1)], mode)
    assert recs[2].preempted_at == pytest.approx([5088 * US])
    assert recs[3].first_token_s == recs[3].finish_s == pytest.approx(10_192 * US)
    assert recs[2].finish_s == pytest.approx(13_195 * US)


@MODES
def test_a_step_that_preempts_admits_nobody(mode: str) -> None:
    # 2 blocks of 2, budget 3 tokens, β = 1000 / 10 / 1 µs. Step 1 (0→1030): seq 0 (1 in,
    # 2 out) prefills 1 token, seq 1 (3 in) a 2-token chunk; the pool is full. Step 2 at
    # 1030: seq 1's last prompt token needs a block: it is preempted, and (as in vLLM v1)
    # not re-admitted in the same step though a 2-token chunk would fit; seq 0 decodes
    # alone (1001 → 2031). Step 3: seq 1 prefills all 3 tokens (1030 → 3061).
    profile = make_profile(
        num_blocks=2,
        block_size=2,
        max_num_seqs=3,
        max_num_batched_tokens=3,
        beta2_s_per_decode_tok=1 * US,
    )
    recs = run(profile, [SimRequest(0, 1, 2), SimRequest(1, 3, 1)], mode)
    assert recs[1].preempted_at == pytest.approx([1030 * US])
    assert recs[0].finish_s == pytest.approx(2031 * US)
    assert recs[1].first_token_s == recs[1].finish_s == pytest.approx(3061 * US)


def test_preemption_counters_and_pool_accounting() -> None:
    profile = make_profile(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    core = SimEngineCore(profile)
    core.add(SimRequest(1, 4, 9), 0.0)
    core.add(SimRequest(2, 4, 9), 0.0)
    seen: list[int] = []
    while core.has_work:
        result = core.step(core.next_step_s or 0.0)
        seen += result.preempted
        assert core.free_blocks >= 0 and core.free_blocks + core.blocks_held() == 4
    assert seen == [2] and core.preemptions == 1


def test_add_validates_requests() -> None:
    core = SimEngineCore(make_profile(num_blocks=2, block_size=4))  # 8 tokens of KV
    core.add(SimRequest(1, 5, 4), 0.0)  # 5 + 4 − 1 = 8 computed tokens: fits exactly
    with pytest.raises(ValueError, match="already"):
        core.add(SimRequest(1, 1, 1), 0.0)
    with pytest.raises(ValueError, match="exceed the KV pool"):
        core.add(SimRequest(2, 5, 5), 0.0)
    with pytest.raises(ValueError, match=">= 1"):
        core.add(SimRequest(3, 0, 5), 0.0)
    assert records(core.advance(None))[1].finish_s is not None


def test_abort_frees_blocks_and_forgets_the_sequence() -> None:
    core = SimEngineCore(make_profile(max_num_seqs=1, max_num_batched_tokens=64))
    core.add(SimRequest(1, 40, 50), 0.0)
    core.add(SimRequest(2, 10, 5), 0.0)
    core.step(0.0)
    assert core.running == 1 and core.waiting == 1 and core.free_blocks == 10_000 - 3
    assert core.abort(2) and core.waiting == 0  # from the queue
    assert core.abort(1) and core.free_blocks == 10_000 and not core.has_work
    assert not core.abort(1) and not core.abort(99)
    assert core.advance(None) == []


def test_quiet_until_is_the_next_step_that_can_change_the_batch() -> None:
    core = SimEngineCore(make_profile())
    assert core.quiet_until_s() is None and core.next_step_s is None
    core.add(SimRequest(1, 100, 5), 0.0)
    assert core.quiet_until_s() == 0.0  # the prefill step
    core.step(0.0)
    # Decodes at 2000, 3002, 4004 are quiet; the one at 5006 finishes the sequence.
    assert core.quiet_until_s() == pytest.approx(5006 * US)
    assert core.advance(5006 * US) == [] and core.next_step_s == pytest.approx(5006 * US)


def test_clock_never_runs_backwards() -> None:
    core = SimEngineCore(make_profile())
    core.add(SimRequest(1, 100, 3), 0.0)
    core.step(0.0)
    late = core.step(1.0)  # a late caller starts the step when it calls
    early = core.step(0.5)  # an early one cannot start before the previous step ended
    assert late.start_s == 1.0 and early.start_s == pytest.approx(1.0 + 1002 * US)


@pytest.mark.parametrize(
    ("prompt", "output"), [(1, 1), (17, 1), (8192, 3), (8193, 40), (30_000, 7)]
)
def test_latency_alone_matches_the_core(prompt: int, output: int) -> None:
    profile = make_profile()
    rec = run(profile, [SimRequest(1, prompt, output)], "advance")[1]
    assert latency_alone(profile, prompt, output) == (rec.first_token_s, rec.finish_s)


def test_saturated_capacity_matches_decode_bound_estimate() -> None:
    # 1-token prompts, 200 outputs, 32 slots: each step decodes ~32 and admits ~32/200,
    # so μ ≈ 32 / (200 · (β0 + 32·β2 + β1·32/200)).
    profile = make_profile(max_num_seqs=32, max_num_batched_tokens=64)
    cap = saturated_capacity(profile, [(1, 200)])
    expected = 32 / (200 * (1000 + 32 * 2 + 10 * 32 / 200) * US)
    assert cap.requests_per_s == pytest.approx(expected, rel=0.03)
    assert cap.output_tokens_per_s == pytest.approx(200 * cap.requests_per_s)
    assert cap.preemptions == 0


def test_saturated_capacity_needs_a_backlog() -> None:
    with pytest.raises(ValueError, match="n_requests"):
        saturated_capacity(make_profile(), [(10, 10)], n_requests=100)


@pytest.mark.parametrize(
    ("field", "value"),
    [("beta0_s", 0.0), ("num_blocks", 0), ("block_size", -1), ("beta2_s_per_decode_tok", -1e-6)],
)
def test_profile_rejects_nonpositive_fields(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"EngineProfile.{field} must be > 0"):
        make_profile(**{field: value})


def test_profile_needs_a_budget_for_every_decode() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        make_profile(max_num_seqs=64, max_num_batched_tokens=32)


# ---- cached_tokens: a prompt whose KV was computed elsewhere (remote prefill) ---------------


def test_cached_prompt_computes_only_its_last_token() -> None:
    # Prompt 100 with 99 cached: step 1 computes 1 token (1000 + 10 = 1010 µs) and samples
    # token 1; two decodes of 1002 → 3014. Its blocks cover all 100 prompt tokens at once.
    core = SimEngineCore(make_profile())
    core.add(SimRequest(1, 100, 3, cached_tokens=99), 0.0)
    first = core.step(0.0)
    assert first.duration_s == pytest.approx(1010 * US)
    assert (first.prefill_tokens, first.first_tokens) == (1, (1,))
    assert core.free_blocks == 10_000 - 7 == 10_000 - core.blocks_held()  # ⌈100 / 16⌉
    rest = [core.step(core.next_step_s or 0.0) for _ in range(2)]
    assert rest[-1].finished == (1,) and not core.has_work
    assert rest[-1].start_s + rest[-1].duration_s == pytest.approx(3014 * US)
    assert core.prefill_tokens == 1 and core.free_blocks == 10_000


@MODES
def test_cached_tokens_take_no_step_budget_but_do_take_blocks(mode: str) -> None:
    # Budget 64. A (200 in, 199 cached) computes 1 token, so B (60 in) joins the same step:
    # 1000 + 10·61 = 1610 for both. Without the cache A's first chunk would fill the budget.
    profile = make_profile(max_num_batched_tokens=64, max_num_seqs=8)
    recs = run(profile, [SimRequest(1, 200, 1, cached_tokens=199), SimRequest(2, 60, 1)], mode)
    assert recs[1].finish_s == recs[2].finish_s == pytest.approx(1610 * US)
    # 4 blocks of 4: A (13 in, 12 cached) needs all 4 at admission, so B (1 in) waits for
    # A to finish: A 1000 + 10 → 1010, decode of token 14 (its 4th block) 1001 → 2011;
    # then B 1000 + 10 → 3021.
    tiny = tiny_pool(max_num_seqs=8)
    recs = run(tiny, [SimRequest(1, 13, 2, cached_tokens=12), SimRequest(2, 1, 1)], mode)
    assert recs[1].finish_s == pytest.approx(2011 * US)
    assert recs[2].first_token_s == recs[2].finish_s == pytest.approx(3021 * US)


@MODES
def test_a_preempted_cached_sequence_recomputes_its_whole_prompt(mode: str) -> None:
    # As the KV-exhaustion case above, but B's prompt (4) has 3 tokens cached: step 1 is
    # 1000 + 10·(4 + 1) = 1050, steps 2-5 two decodes of 1002 → 5058, where both need a 3rd
    # block and B, the newest, is preempted with 5 tokens generated. A decodes 4 more alone
    # (1001 each → 9062). B then recomputes 4 + 5 = 9 tokens, its cache gone with its
    # blocks (1000 + 90 → 10152; 6 tokens, 1060, had the cache survived), and decodes 3
    # more → 13155.
    profile = tiny_pool(max_num_seqs=8)
    recs = run(profile, [SimRequest(1, 4, 9), SimRequest(2, 4, 9, cached_tokens=3)], mode)
    a, b = recs[1], recs[2]
    assert a.first_token_s == b.first_token_s == pytest.approx(1050 * US)
    assert a.finish_s == pytest.approx(9062 * US)
    assert b.preempted_at == pytest.approx([5058 * US])
    assert b.preemptions == 1 and b.finish_s == pytest.approx(13_155 * US)


@pytest.mark.parametrize("cached", [-1, 5, 6])
def test_cached_tokens_leave_one_prompt_token_to_compute(cached: int) -> None:
    with pytest.raises(ValueError, match="cached_tokens must be in"):
        SimEngineCore(make_profile()).add(SimRequest(1, 5, 2, cached_tokens=cached), 0.0)


def test_a_cached_head_that_cannot_fit_does_not_stop_fast_forward() -> None:
    # 16 blocks of 16. A (192 in, 40 out) holds 12 after its prefill and 13 after its first
    # decode (token 193), so 3 are free; B (56 in, 55 cached) needs 4 at admission and
    # waits for A to finish. Until then every step is a quiet decode: the 37 before A's
    # last one (tokens 3..39; its blocks 14 and 15 fit in the 3 free) are skipped at once.
    # Counting B's chunk (1 token, 1 block) without its cached blocks saw it admitted next
    # step and stepped one by one (results unchanged, only slower).
    core = SimEngineCore(make_profile(num_blocks=16))
    core.add(SimRequest(1, 192, 40), 0.0)
    core.step(0.0)
    core.add(SimRequest(2, 56, 5, cached_tokens=55), 0.0)
    core.step(core.next_step_s or 0.0)
    assert (core.free_blocks, core.waiting) == (3, 1)
    quiet = 37 * (1000 + 2) * US  # decodes of one sequence
    assert core.quiet_until_s() == pytest.approx((core.next_step_s or 0.0) + quiet)
    finished = records(core.advance(None))
    assert finished[1].finish_s is not None and finished[2].finish_s is not None
