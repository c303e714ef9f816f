"""Prefill and decode apart (core.cycle step 6): stages, hand-offs, the overflow rule, and
the prompt work the ledger counts. Hand-computed cases on small fleets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemas.common import MAX_ATTEMPT, engine_rank
from services.scheduler import (
    DEFAULT_PROFILE,
    ConfigError,
    Defer,
    Ledger,
    Placement,
    Reject,
    build_pipeline,
    schedule,
)
from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.profile import REQUIRED_FILTERS
from tests.builders import NOW, make_queue, make_request, make_snapshot, make_worker, seeded

PIPELINE = build_pipeline(DEFAULT_PROFILE)


def fleet(prefill: int = 1, decode: int = 1, mixed: int = 0, **kw: object) -> list[WorkerState]:
    workers = [make_worker(f"p{i}", role="prefill", partition=i, **kw)  # type: ignore[arg-type]
               for i in range(prefill)]
    workers += [make_worker(f"d{i}", role="decode", partition=10 + i, **kw)  # type: ignore[arg-type]
                for i in range(decode)]
    workers += [make_worker(f"m{i}", role="mixed", partition=20 + i, **kw)  # type: ignore[arg-type]
                for i in range(mixed)]
    return workers


def cycle(workers: list[WorkerState], *requests: QueuedRequest, ledger: Ledger | None = None,
          pipeline: object = PIPELINE, now: float = NOW) -> tuple[list[object], Ledger]:
    ledger = ledger if ledger is not None else Ledger(kv_safety_margin=0.0)
    queue = make_queue(*requests)
    decisions = schedule(make_snapshot(workers, now=now), queue, ledger, pipeline, now,  # type: ignore[arg-type]
                         seeded())
    return list(decisions), ledger


def test_a_new_request_is_placed_as_its_prefill_stage_on_a_prefill_worker() -> None:
    request = make_request("r1", prompt_tokens=1000, max_tokens=500, kv_tokens=1504)
    decisions, ledger = cycle(fleet(), request)
    [placement] = decisions
    assert isinstance(placement, Placement)
    assert placement.worker_id == "p0" and placement.phase == "prefill"
    # The prompt and the sampled token, in 16-token blocks: 1001 -> 1008.
    assert placement.kv_tokens == 1008 == placement.request.kv_tokens
    assert placement.request.decode_kv_tokens == 1504
    assert ledger.reserved_kv("p0") == 1008 and ledger.reserved_kv("d0") == 0
    assert ledger.uncomputed_prompt("p0") == 1000


def test_the_handoff_is_placed_on_a_decode_worker_with_the_whole_reservation() -> None:
    request = make_request("r1", prompt_tokens=1000, max_tokens=500, kv_tokens=1504,
                           enqueued_at=NOW - 5)
    [placement], ledger = cycle(fleet(), request)
    assert isinstance(placement, Placement)
    ledger.release("r1", 0)
    decode = placement.request.handoff()
    assert (decode.phase, decode.kv_tokens, decode.enqueued_at, decode.attempt) == (
        "decode", 1504, NOW - 5, 1)
    [second], _ = cycle(fleet(), decode, ledger=ledger)
    assert isinstance(second, Placement)
    assert (second.worker_id, second.phase, second.kv_tokens) == ("d0", "decode", 1504)
    assert ledger.uncomputed_prompt("d0") == 0  # its prompt arrived computed


def test_only_a_prefill_stage_hands_off() -> None:
    with pytest.raises(ValueError, match="only a prefill stage"):
        make_request("r1").handoff()


def test_a_full_decode_pool_does_not_hold_up_new_prompts() -> None:
    # The decode worker can hold one stage of 1504 at a time; the second waits, in its
    # own class, while a new request of the same class still gets a prefill worker.
    workers = fleet(kv_total_tokens=2000)
    ledger = Ledger(kv_safety_margin=0.0)
    staged = []
    for rid in ("a", "b"):
        [p], ledger = cycle(workers, make_request(rid, prompt_tokens=100, max_tokens=1400,
                                                  kv_tokens=1504), ledger=ledger)
        assert isinstance(p, Placement) and p.phase == "prefill"
        ledger.release(rid, 0)
        staged.append(p.request)
    first, _ = cycle(workers, staged[0].handoff(), ledger=ledger)
    assert [d.phase for d in first if isinstance(d, Placement)] == ["decode"]
    queue = make_queue(staged[1].handoff(), make_request("c", prompt_tokens=100, max_tokens=1400,
                                                         kv_tokens=1504, enqueued_at=NOW + 1))
    decisions = schedule(make_snapshot(workers), queue, ledger, PIPELINE, NOW + 1, seeded())
    assert [(d.request.request_id, d.phase) for d in decisions if isinstance(d, Placement)] == [
        ("c", "prefill")]
    assert [d.request_id for d in decisions if isinstance(d, Defer)] == ["b"]


def test_mixed_workers_take_requests_whole_when_the_stages_cannot_be_placed() -> None:
    workers = fleet(prefill=1, decode=1, mixed=1)
    # No live prefill worker: mixed workers first, then decode workers, take it whole.
    no_prefill = [make_worker("p0", role="prefill", draining=True), *workers[1:]]
    [placement], _ = cycle(no_prefill, make_request("r1"))
    assert isinstance(placement, Placement)
    assert (placement.worker_id, placement.phase) == ("m0", "whole")
    [placement], _ = cycle(no_prefill[:2], make_request("r2", lane="long"))
    assert isinstance(placement, Placement)
    assert (placement.worker_id, placement.phase) == ("d0", "whole")
    # No live decode worker: the prompt is not computed on a prefill worker for nothing.
    no_decode = [workers[0], make_worker("d0", role="decode", draining=True), workers[2]]
    [placement], _ = cycle(no_decode, make_request("r3"))
    assert isinstance(placement, Placement)
    assert (placement.worker_id, placement.phase) == ("m0", "whole")


def test_a_request_no_decode_worker_could_hold_is_not_staged() -> None:
    workers = [make_worker("p0", role="prefill", kv_total_tokens=100_000),
               make_worker("d0", role="decode", kv_total_tokens=4_000, partition=1),
               make_worker("m0", kv_total_tokens=100_000, partition=2)]
    big = make_request("big", prompt_tokens=1000, max_tokens=8000, kv_tokens=9008)
    [placement], _ = cycle(workers, big)
    assert isinstance(placement, Placement)
    assert (placement.worker_id, placement.phase) == ("m0", "whole")
    # Without a mixed worker it is refused as it would be on any fleet too small for it.
    [refusal], _ = cycle(workers[:2], big)
    assert isinstance(refusal, Defer | Reject)


def test_a_decode_stage_no_live_decode_worker_could_hold_runs_whole_on_a_mixed_one() -> None:
    workers = fleet(prefill=1, decode=1, mixed=1)
    [p], ledger = cycle(workers, make_request("r1", prompt_tokens=1000, max_tokens=500,
                                              kv_tokens=1504))
    assert isinstance(p, Placement) and p.phase == "prefill"
    gone = [workers[0], make_worker("d0", role="decode", draining=True), workers[2]]
    [again], _ = cycle(gone, p.request.handoff(), ledger=ledger)
    assert isinstance(again, Placement)
    assert (again.worker_id, again.phase, again.attempt, again.kv_tokens) == (
        "m0", "whole", 1, 1504)
    # With the decode worker live but busy, it waits for it instead.
    busy = Ledger(kv_safety_margin=0.0)
    assert busy.reserve(workers[1], make_request("other", kv_tokens=99_000))
    [wait], _ = cycle(workers, p.request.handoff(), ledger=busy)
    assert isinstance(wait, Defer)


def test_a_prefill_stage_goes_only_where_a_decode_worker_of_its_engine_runs() -> None:
    # Two prefill engines, decode workers of one: the other's prefill workers idle.
    workers = [make_worker("p-sim", role="prefill", engine="sim",
                           kv_total_tokens=200_000),  # the roomier: picked if it could be
               make_worker("p-vllm", role="prefill", engine="openai", partition=1),
               make_worker("d-vllm", role="decode", engine="openai", partition=2)]
    decisions, _ = cycle(workers, *(make_request(f"r{i}", enqueued_at=NOW - i) for i in range(3)))
    assert {(d.worker_id, d.phase) for d in decisions if isinstance(d, Placement)} == {
        ("p-vllm", "prefill")}
    # No prefill worker pairs with the decode tier: requests run whole on it.
    unpaired = [workers[0], make_worker("d-vllm", role="decode", engine="openai", partition=2)]
    [placement], _ = cycle(unpaired, make_request("r9"))
    assert isinstance(placement, Placement)
    assert (placement.worker_id, placement.phase) == ("d-vllm", "whole")


def test_a_prefill_stage_goes_only_where_a_decode_worker_of_its_engine_could_hold_it() -> None:
    # A's decode worker is too small for the request, B's is not: computing the prompt on
    # A's prefill worker would only compute it again, whole, after the hand-off.
    workers = [make_worker("p-a", role="prefill", engine="a"),
               make_worker("p-b", role="prefill", engine="b", partition=1, running=50,
                           kv_free_tokens=50_000),  # busier: p-a is the pick but for d-a
               make_worker("d-a", role="decode", engine="a", partition=2, kv_total_tokens=2_000),
               make_worker("d-b", role="decode", engine="b", partition=3)]
    big = make_request("big", prompt_tokens=1000, max_tokens=7000, kv_tokens=8016)
    small = make_request("small", prompt_tokens=1000, max_tokens=500, kv_tokens=1504,
                         enqueued_at=NOW + 1)
    decisions, _ = cycle(workers, big, small)
    placed = {d.request.request_id: (d.worker_id, d.phase) for d in decisions
              if isinstance(d, Placement)}
    assert placed == {"big": ("p-b", "prefill"), "small": ("p-a", "prefill")}


def test_a_decode_stage_goes_only_to_a_decode_worker_of_its_prefill_engine() -> None:
    staged = replace(make_request("r1", prompt_tokens=1000, max_tokens=500, kv_tokens=1504),
                     phase="prefill", kv_tokens=1008, decode_kv_tokens=1504)
    decode = staged.handoff(kv_engine="openai")
    assert decode.kv_engine == "openai" and decode.as_whole(1).kv_engine is None
    sim = make_worker("d-sim", role="decode", engine="sim", kv_total_tokens=200_000)
    vllm = make_worker("d-vllm", role="decode", engine="openai", partition=1)
    stages = [replace(decode, request_id=f"r{i}") for i in range(4)]
    decisions, _ = cycle([sim, vllm], *stages)
    assert {(d.worker_id, d.phase) for d in decisions if isinstance(d, Placement)} == {
        ("d-vllm", "decode")}
    # Its engine's decode worker busy: it waits for it, not for the other engine's.
    busy = Ledger(kv_safety_margin=0.0)
    assert busy.reserve(vllm, make_request("other", kv_tokens=99_000))
    [wait], _ = cycle([sim, vllm], decode, ledger=busy)
    assert isinstance(wait, Defer)
    # None of its engine at all: the prompt's KV cannot reach a decode worker, so the
    # request runs whole (its prompt computed again), on a mixed worker first ...
    mixed = make_worker("m0", partition=2)
    [whole], _ = cycle([sim, mixed], decode)
    assert isinstance(whole, Placement)
    assert (whole.worker_id, whole.phase, whole.attempt, whole.kv_tokens) == (
        "m0", "whole", 1, 1504)
    # ... else on another engine's decode worker.
    [whole], _ = cycle([sim], decode)
    assert isinstance(whole, Placement)
    assert (whole.worker_id, whole.phase, whole.attempt) == ("d-sim", "whole", 1)


def test_an_overdue_request_only_decode_workers_could_hold_holds_one() -> None:
    # No live prefill worker, and the mixed worker is too small for it: only the decode
    # worker can ever run it, so an overdue head holds that one (not the mixed route,
    # where it could hold nothing and smaller requests would keep taking the room).
    workers = [make_worker("p0", role="prefill", draining=True),
               make_worker("d0", role="decode", partition=1),
               make_worker("m0", partition=2, kv_total_tokens=4_000)]
    ledger = Ledger(kv_safety_margin=0.0)
    assert ledger.reserve(workers[1], make_request("busy", kv_tokens=95_000))
    big = make_request("big", prompt_tokens=1000, max_tokens=7000, kv_tokens=8016,
                       enqueued_at=NOW - 3600)
    [wait], _ = cycle(workers, big, ledger=ledger)
    assert isinstance(wait, Defer) and "holding d0" in wait.reason, wait
    assert ledger.hold_of("big") == "d0"


def test_an_overdue_request_no_mixed_worker_could_run_holds_a_prefill_worker() -> None:
    # Staged, its prefill worker full, and the mixed worker too small for the whole
    # request: it holds the prefill worker, and says why that one did not take it.
    workers = [make_worker("p0", role="prefill"),
               make_worker("d0", role="decode", partition=1),
               make_worker("m0", partition=2, kv_total_tokens=4_000)]
    ledger = Ledger(kv_safety_margin=0.0)
    assert ledger.reserve(workers[0], make_request("busy", kv_tokens=99_000))
    big = make_request("big", prompt_tokens=1000, max_tokens=7000, kv_tokens=8016,
                       enqueued_at=NOW - 3600)
    [wait], _ = cycle(workers, big, ledger=ledger)
    assert isinstance(wait, Defer) and ledger.hold_of("big") == "p0"
    assert wait.reason == "no room: largest free 1000 < 1008; holding p0"


def test_a_prompt_no_prefill_worker_could_hold_runs_whole_on_a_decode_worker() -> None:
    workers = [make_worker("p0", role="prefill", kv_total_tokens=4_000),
               make_worker("d0", role="decode", partition=1)]
    long_prompt = make_request("r1", prompt_tokens=6000, max_tokens=500, kv_tokens=6512)
    [placement], _ = cycle(workers, long_prompt)
    assert isinstance(placement, Placement)
    assert (placement.worker_id, placement.phase) == ("d0", "whole")


def test_a_request_at_its_last_attempt_is_not_staged() -> None:
    # Its decode stage would need the next attempt, past the wire's bound: it runs whole.
    [placement], _ = cycle(fleet(prefill=1, decode=1),
                           make_request("r1", attempt=MAX_ATTEMPT, lane="long"))
    assert isinstance(placement, Placement)
    assert (placement.worker_id, placement.phase) == ("d0", "whole")


def test_a_fleet_without_roles_is_unchanged() -> None:
    [placement], _ = cycle([make_worker("m0")], make_request("r1"))
    assert isinstance(placement, Placement) and placement.phase == "whole"
    assert placement.request.decode_kv_tokens is None


def overloaded(ledger: Ledger, worker: WorkerState, tokens: int) -> None:
    """Give ``worker`` ``tokens`` of prompt work placed and not computed."""
    big = make_request(f"load-{worker.worker_id}", prompt_tokens=tokens, max_tokens=1,
                       kv_tokens=tokens + 16)
    assert ledger.reserve(worker, big)


def test_overflow_sends_a_long_request_whole_to_an_idle_decode_worker() -> None:
    workers = fleet(prefill=2, decode=2, kv_total_tokens=400_000)
    pipeline = build_pipeline({"pd_overflow_tokens": 100_000})
    ledger = Ledger(kv_safety_margin=0.0)
    for w in workers[:2]:
        overloaded(ledger, w, 100_000)
    overloaded(ledger, workers[2], 5_000)  # d0 is still computing a prompt of its own
    long_request = make_request("long", lane="long", prompt_tokens=6000, max_tokens=500,
                                kv_tokens=6512)
    [placement], _ = cycle(workers, long_request, ledger=ledger, pipeline=pipeline)
    assert isinstance(placement, Placement)
    assert (placement.worker_id, placement.phase, placement.kv_tokens) == ("d1", "whole", 6512)
    assert ledger.uncomputed_prompt("d1") == 6000
    assert ledger.mark_first_token("long", 0)
    assert ledger.uncomputed_prompt("d1") == 0


@pytest.mark.parametrize(("lane", "p1_load", "expected"), [
    ("short", 100_000, "prefill"),  # short requests never overflow
    ("long", 99_999, "prefill"),    # one prefill worker below the threshold
])
def test_overflow_needs_a_long_request_and_every_prefill_worker_loaded(
    lane: str, p1_load: int, expected: str
) -> None:
    workers = fleet(prefill=2, decode=1, kv_total_tokens=400_000)
    pipeline = build_pipeline({"pd_overflow_tokens": 100_000})
    ledger = Ledger(kv_safety_margin=0.0)
    overloaded(ledger, workers[0], 100_000)
    overloaded(ledger, workers[1], p1_load)
    request = make_request("r", lane=lane, prompt_tokens=3000, max_tokens=100,  # type: ignore[arg-type]
                           kv_tokens=3104)
    [placement], _ = cycle(workers, request, ledger=ledger, pipeline=pipeline)
    assert isinstance(placement, Placement) and placement.phase == expected


def test_overflow_off_and_first_tokens_release_prompt_work() -> None:
    workers = fleet(prefill=1, decode=1, kv_total_tokens=400_000)
    ledger = Ledger(kv_safety_margin=0.0)
    overloaded(ledger, workers[0], 200_000)
    request = make_request("r", lane="long", prompt_tokens=3000, kv_tokens=3520)
    [placement], _ = cycle(workers, request, ledger=ledger,
                           pipeline=build_pipeline({"pd_overflow_tokens": 0}))
    assert isinstance(placement, Placement) and placement.phase == "prefill"
    assert ledger.uncomputed_prompt("p0") == 203_000
    ledger.release("r", 0)
    assert ledger.uncomputed_prompt("p0") == 200_000


def test_a_prompt_is_staged_only_where_a_decode_worker_of_its_version_could_take_it() -> None:
    """Found by an audit: prefill and decode workers were paired by engine only; a prompt
    computed on v1 went to a v2 decode worker."""
    v1_prefill = make_worker("p-v1", role="prefill", model_version="v1")
    v2_decode = make_worker("d-v2", role="decode", model_version="v2", partition=1)
    request = make_request("r1", prompt_tokens=500, max_tokens=500, kv_tokens=1008)
    decisions, _ = cycle([v1_prefill, v2_decode], request)
    [placement] = decisions
    assert isinstance(placement, Placement)
    assert (placement.worker_id, placement.phase) == ("d-v2", "whole")  # no stage on p-v1
    # A decode stage of v1's prompt waits for a v1 decode worker; v2's is not one.
    stage = replace(request, phase="prefill", decode_kv_tokens=1008, kv_tokens=512)
    decisions, _ = cycle([v2_decode], stage.handoff(kv_engine=None, kv_version="v1"))
    assert not any(isinstance(d, Placement) and d.phase == "decode" for d in decisions)


@pytest.mark.parametrize("candidates", [8, 0])
def test_overflow_sends_one_long_request_to_a_decode_worker_with_no_prompt_work(
    candidates: int,
) -> None:
    """Found by an audit: with candidates = 0 and no room filter the rule that a decode
    worker takes an overflow only with no prompt work of its own was skipped: three of
    four long requests went whole to the one decode worker."""
    pipeline = build_pipeline({"filters": list(REQUIRED_FILTERS), "candidates": candidates,
                               "pd_overflow_tokens": 1_000})
    requests = [make_request(f"l{i}", lane="long", priority="high", prompt_tokens=3_000,
                             max_tokens=100, kv_tokens=3_104, enqueued_at=NOW - 1 + i / 100)
                for i in range(4)]
    decisions, _ = cycle(fleet(kv_total_tokens=100_000), *requests, pipeline=pipeline)
    whole = [d for d in decisions if isinstance(d, Placement) and d.worker_id == "d0"]
    assert len(whole) == 1 and whole[0].phase == "whole"


def test_a_prefill_stage_is_booked_in_the_largest_block_size_of_the_prefill_workers() -> None:
    """Found by an audit: booked in the first prefill worker's blocks (16), a stage placed
    on a worker of 256-token blocks took 112 tokens in the ledger and 256 in the engine,
    and 200 of them were placed on an engine that held 100."""
    busy = make_worker("p16", role="prefill", block_size=16, kv_total_tokens=100_000,
                       kv_free_tokens=0)
    big = make_worker("p256", role="prefill", block_size=256, kv_total_tokens=25_600,
                      partition=1)
    decode = make_worker("d", role="decode", block_size=256, kv_total_tokens=10**6,
                         max_num_seqs=1024, partition=2)
    requests = [make_request(f"r{i}", priority="high", prompt_tokens=100, max_tokens=156,
                             kv_tokens=256) for i in range(200)]
    decisions, ledger = cycle([busy, big, decode], *requests)
    assert ledger.reserved_kv("p256") == 256 * len(
        [d for d in decisions if isinstance(d, Placement) and d.worker_id == "p256"])
    on_big = [d for d in decisions if isinstance(d, Placement) and d.worker_id == "p256"]
    assert on_big and all(d.kv_tokens == 256 for d in on_big)
    assert len(on_big) * 256 <= 25_600  # what the engine holds, in its own blocks


@pytest.mark.parametrize("value", [-1, 1.5, True, "many"])
def test_pd_overflow_tokens_is_validated(value: object) -> None:
    with pytest.raises(ConfigError, match="pd_overflow_tokens"):
        build_pipeline({"pd_overflow_tokens": value})


def test_prefill_ranks_put_the_high_class_first_then_short_prompts_before_long() -> None:
    ranks = {(c, lane): engine_rank(c, lane, "prefill")  # type: ignore[arg-type]
             for c in (0, 1, 2) for lane in ("short", "long")}
    order = sorted(ranks, key=ranks.__getitem__)
    assert order == [(0, "short"), (0, "long"), (1, "short"), (2, "short"), (1, "long"),
                     (2, "long")]
    # Whole requests and decode stages keep the class-first rank.
    assert [engine_rank(c, "long", "decode") for c in (0, 1, 2)] == [1, 3, 5]


def staged_decode(rid: str, priority: str, enqueued_at: float) -> QueuedRequest:
    request = make_request(rid, priority=priority, prompt_tokens=100, max_tokens=1400,  # type: ignore[arg-type]
                           kv_tokens=1504, enqueued_at=enqueued_at)
    return replace(request, phase="prefill", kv_tokens=112, decode_kv_tokens=1504).handoff()


def test_hand_offs_go_first_oldest_first_whatever_their_class() -> None:
    # Decode stages rank as high: a low one that waited longer is placed before a normal
    # one, and both before a new high request that could take the same decode worker.
    # Room for one stage: the oldest hand-off takes it; the new high request, which the
    # overflow rule would put whole on d0, waits.
    def new_high() -> QueuedRequest:
        return make_request("high", priority="high", prompt_tokens=100, max_tokens=1400,
                            kv_tokens=1504, enqueued_at=NOW)

    workers = [make_worker("d0", role="decode", kv_total_tokens=2000)]
    ledger = Ledger(kv_safety_margin=0.0)
    queue = make_queue(staged_decode("normal", "normal", NOW - 10),
                       staged_decode("low", "low", NOW - 20), new_high())
    decisions = schedule(make_snapshot(workers), queue, ledger, PIPELINE, NOW, seeded())
    assert [d.request.request_id for d in decisions if isinstance(d, Placement)] == ["low"]
    assert queue.engine_priority(queue.get("normal"), NOW) == 0  # type: ignore[arg-type]
    # Room for all three: placed in that order, the new high request last.
    roomy = [make_worker("d0", role="decode", kv_total_tokens=5000)]
    queue = make_queue(staged_decode("normal", "normal", NOW - 10),
                       staged_decode("low", "low", NOW - 20), new_high())
    decisions = schedule(make_snapshot(roomy), queue, Ledger(kv_safety_margin=0.0), PIPELINE,
                         NOW, seeded())
    assert [(d.request.request_id, d.worker_id, d.phase) for d in decisions
            if isinstance(d, Placement)] == [
        ("low", "d0", "decode"), ("normal", "d0", "decode"), ("high", "d0", "whole")]


def test_a_hold_for_a_hand_off_passes_to_an_older_one_of_another_class() -> None:
    # A normal decode stage blocked on a full decode worker holds it; a low one handed off
    # later but admitted earlier goes in front of it in the same class and must take the
    # hold over, or the worker stays held for a request that is no longer a head (the
    # cycle then deferred both forever).
    workers = [make_worker("d0", role="decode", kv_total_tokens=2000)]
    ledger = Ledger(kv_safety_margin=0.0)
    assert ledger.reserve(workers[0], make_request("busy", kv_tokens=1000))
    queue = make_queue(staged_decode("normal", "normal", NOW - 40))
    first = schedule(make_snapshot(workers), queue, ledger, PIPELINE, NOW, seeded())
    assert [type(d) for d in first] == [Defer] and ledger.holder("d0") == "normal"
    ledger.release("busy", 0)
    queue.push(staged_decode("low", "low", NOW - 45))
    second = schedule(make_snapshot(workers), queue, ledger, PIPELINE, NOW, seeded())
    assert [d.request.request_id for d in second if isinstance(d, Placement)] == ["low"]
