"""The discrete-event simulator and its policies: invariants, determinism, KV safety."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from schemas.common import Pool
from services.scheduler import Ledger, PlacementContext, Snapshot
from services.scheduler.policies.pickers.round_robin import RoundRobin
from services.sim.bench import BenchConfig, run_bench
from services.sim.cli import policies as bench_policies
from services.sim.fleet import COMPLETED, REJECTED, Job, make_jobs
from services.sim.llmq import LlmqConfig, LlmqPolicy
from services.sim.policies import (
    POLICIES,
    FewestInFlight,
    FifoRoundRobin,
    RouteOnArrival,
    _state,
)
from services.sim.simulator import SimStats, SimulationError, Simulator
from services.sim.workload import TraceRequest, attach_classes, synthetic
from services.worker.engines.sim import EngineProfile, get_profile

#: A small engine whose KV (300 blocks × 16 = 4,800 tokens) runs out long before its 32
#: sequence slots do: a plain vLLM preempts on it.
TIGHT = EngineProfile(
    name="tight",
    beta0_s=0.005,
    beta1_s_per_prefill_tok=17e-6,
    beta2_s_per_decode_tok=6e-6,
    num_blocks=300,
    block_size=16,
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    source="test",
)


def small_engine(max_num_seqs: int) -> EngineProfile:
    """β = 10 ms + 10 µs per token, roomy KV, a 64-token step budget."""
    return EngineProfile(
        name="small", beta0_s=0.01, beta1_s_per_prefill_tok=1e-5, beta2_s_per_decode_tok=1e-5,
        num_blocks=1000, block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
        source="test",
    )


def workload(n: int, rate_rps: float, seed: int = 3, **lengths: float) -> list[TraceRequest]:
    rng = random.Random(seed)
    shape = {"prompt_mean": 300.0, "prompt_max": 1500, "output_mean": 100.0,
             "output_max": 600} | lengths
    return attach_classes(synthetic(n, rng, rate_rps=rate_rps, **shape), rng)  # type: ignore[arg-type]


def run(
    name: str,
    requests: Sequence[TraceRequest],
    profile: EngineProfile = TIGHT,
    pools: Sequence[Pool] = ("any", "any"),
    *,
    config: LlmqConfig | None = None,
    check: object = None,
) -> tuple[list[Job], SimStats, Simulator]:
    jobs = make_jobs(requests, profile)
    policy = POLICIES[name](random.Random(f"7/{name}"), config or LlmqConfig(heartbeat_s=0.25))
    sim = Simulator(jobs, profile, pools, policy, check=check)  # type: ignore[arg-type]
    return jobs, sim.run(), sim


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_request_ends_exactly_once(name: str) -> None:
    jobs, stats, _ = run(name, workload(400, rate_rps=60.0))
    assert stats.arrived == 400 == stats.completed + stats.rejected
    assert stats.in_flight == 0
    for j in jobs:
        assert j.state in (COMPLETED, REJECTED)
        assert j.finished_s is not None and j.finished_s >= j.arrival_s
        if j.state == COMPLETED:
            assert j.dispatched_s is not None and j.first_token_s is not None
            assert j.arrival_s <= j.dispatched_s <= j.first_token_s <= j.finished_s
            assert j.finished_s - j.arrival_s >= j.e2e_alone_s - 1e-9


@pytest.mark.parametrize("name", list(POLICIES))
def test_clock_is_monotone_and_kv_never_negative(name: str) -> None:
    seen: list[float] = []

    def check(sim: Simulator) -> None:
        seen.append(sim.now)
        for w in sim.workers:
            engine = w.engine
            assert engine.free_blocks >= 0
            assert engine.blocks_held() + engine.free_blocks == engine.profile.num_blocks
            assert w.in_flight >= 0

    run(name, workload(200, rate_rps=80.0), check=check)
    assert seen == sorted(seen)


def test_llmq_never_preempts_where_vllm_random_does() -> None:
    requests = workload(300, rate_rps=40.0)
    _, random_stats, _ = run("vllm-random", requests)
    _, llmq_stats, _ = run("llmq", requests)
    assert random_stats.kv_preemptions > 0
    assert llmq_stats.kv_preemptions == 0
    assert llmq_stats.completed + llmq_stats.rejected == 300


def test_llmq_reservations_stay_within_each_engine_pool() -> None:
    policy_box: list[LlmqPolicy] = []

    def check(sim: Simulator) -> None:
        policy = sim.policy
        assert isinstance(policy, LlmqPolicy)
        policy_box.append(policy)
        ledger: Ledger = policy.ledger
        for w in sim.workers:
            reserved = ledger.reserved_kv(w.worker_id)
            assert reserved <= int(TIGHT.kv_total_tokens * (1 - ledger.kv_safety_margin))
            assert w.in_flight <= TIGHT.max_num_seqs

    run("llmq", workload(300, rate_rps=40.0), check=check)
    assert policy_box and len(policy_box[-1].ledger) == 0  # every reservation released


def test_fifo_rr_follows_the_core_round_robin_picker_over_free_slots() -> None:
    """Same choice as the core's round-robin picker given the workers with a free slot."""
    choices: list[tuple[int, list[int], int | None]] = []

    class Recording(FifoRoundRobin):
        def _next_free(self, workers, n):  # type: ignore[no-untyped-def]
            free = [w.index for w in workers if w.in_flight < w.max_num_seqs]
            picked: int = super()._next_free(workers, n)
            choices.append((picked, free, None if self._cursor < 0 else self._cursor))
            return picked

    jobs = make_jobs(workload(300, rate_rps=200.0), TIGHT)
    sim = Simulator(jobs, TIGHT, ["any"] * 3, Recording(random.Random(1)))
    sim.run()
    picker = RoundRobin()
    for picked, free, last in choices:
        states = [_state(sim.workers[i], 0) for i in free]
        ledger = Ledger()
        ledger.last_worker_id = None if last is None else sim.workers[last].worker_id
        ctx = PlacementContext(Snapshot.of(states, 0.0), ledger, 0.0)
        assert picker.pick([(0.0, s) for s in states], random.Random(0), ctx).partition == picked
    assert len(choices) == 300


def test_fifo_rr_never_exceeds_the_sequence_slots() -> None:
    def check(sim: Simulator) -> None:
        assert all(w.in_flight <= w.max_num_seqs for w in sim.workers)

    _, stats, _ = run("fifo-rr", workload(500, rate_rps=400.0), check=check)
    assert stats.completed == 500


def test_least_requests_pruned_candidates_pick_exactly_like_the_full_list() -> None:
    requests = workload(400, rate_rps=150.0)
    full_jobs = make_jobs(requests, TIGHT)
    full = RouteOnArrival("least-requests", "least-requests", random.Random(4))
    Simulator(full_jobs, TIGHT, ["any"] * 5, full).run()
    pruned_jobs = make_jobs(requests, TIGHT)
    Simulator(pruned_jobs, TIGHT, ["any"] * 5, FewestInFlight(random.Random(4))).run()
    assert [j.worker for j in pruned_jobs] == [j.worker for j in full_jobs]
    assert [j.finished_s for j in pruned_jobs] == [j.finished_s for j in full_jobs]


def test_least_requests_spreads_a_burst_evenly() -> None:
    burst = [TraceRequest(i, 0.0, 50, 400) for i in range(30)]
    jobs, _, _ = run("least-requests", burst, pools=["any"] * 3)
    counts = [sum(1 for j in jobs if j.worker == w) for w in range(3)]
    assert counts == [10, 10, 10]


@pytest.mark.parametrize("name", ["fifo-rr", "least-requests", "vllm-random", "llmq"])
def test_a_request_larger_than_the_kv_pool_is_rejected_too_large(name: str) -> None:
    requests = [TraceRequest(0, 0.0, 100, 50), TraceRequest(1, 0.1, 4800, 100)]
    jobs, stats, _ = run(name, requests)
    assert jobs[1].state == REJECTED and jobs[1].reject_code == "too_large"
    assert stats.completed == 1


def test_a_simulator_runs_once_and_refuses_double_dispatch() -> None:
    jobs = make_jobs([TraceRequest(0, 0.0, 10, 5)], TIGHT)
    sim = Simulator(jobs, TIGHT, ["any"], POLICIES["fifo-rr"](random.Random(1), LlmqConfig()))
    sim.run()
    with pytest.raises(SimulationError, match="runs once"):
        sim.run()
    with pytest.raises(SimulationError, match="dispatched in state"):
        sim.dispatch(jobs[0], 0)


def test_unsorted_arrivals_are_refused() -> None:
    jobs = make_jobs([TraceRequest(0, 1.0, 10, 5), TraceRequest(1, 0.5, 10, 5)], TIGHT)
    with pytest.raises(ValueError, match="sorted"):
        Simulator(jobs, TIGHT, ["any"], FifoRoundRobin(random.Random(1)))


def test_llmq_serves_high_priority_first_under_overload() -> None:
    """Thirty jobs arrive at once on one worker with two slots: the first two take the
    slots as they come; of the rest, the ten high ones go first."""
    one_slot = small_engine(max_num_seqs=2)
    classes = ["low", "normal", "high"] * 10
    burst = [TraceRequest(i, 0.0, 20, 20, priority=p) for i, p in enumerate(classes)]  # type: ignore[arg-type]
    jobs, stats, _ = run("llmq", burst, one_slot, pools=["any"])
    assert stats.completed == 30
    order = sorted(jobs, key=lambda j: (j.dispatched_s, j.idx))
    assert [j.idx for j in order[:2]] == [0, 1]
    assert {j.priority for j in order[2:12]} == {"high"}


@pytest.mark.parametrize("engine_priority", [True, False])
def test_llmq_engines_prefill_by_class_unless_told_fcfs(engine_priority: bool) -> None:
    """Thirty jobs at once fit one worker's KV and slots, so llmq places them all at once;
    the engine prefills one prompt a step (64-token budget). Job 0 (low) starts alone, in
    the step that begins as it arrives; then, with engine priority, the ten high jobs get
    their first token next; FCFS engines serve everyone in arrival order."""
    narrow = small_engine(max_num_seqs=64)
    classes = ["low", "normal", "high"] * 10
    burst = [TraceRequest(i, 0.0, 60, 20, priority=p) for i, p in enumerate(classes)]  # type: ignore[arg-type]
    config = LlmqConfig(heartbeat_s=0.25, engine_priority=engine_priority)
    jobs, stats, _ = run("llmq", burst, narrow, pools=["any"], config=config)
    assert stats.completed == 30
    assert {j.dispatched_s for j in jobs} == {0.0}
    first = sorted(jobs, key=lambda j: (j.first_token_s, j.idx))
    if engine_priority:
        assert first[0].idx == 0
        assert {j.priority for j in first[1:11]} == {"high"}
        assert {j.priority for j in first[11:21]} == {"normal"}
    else:
        assert [j.idx for j in first] == sorted(j.idx for j in jobs)


@pytest.mark.parametrize("engine_priority", [True, False])
def test_llmq_engines_prefill_short_before_long_within_a_class(engine_priority: bool) -> None:
    """Twelve normal jobs at once, all placed on one worker: 0 and 5-11 short (60-token
    prompts), 1-4 long (2,100, 33 steps of 64 tokens each). Job 0 starts alone. A FCFS
    engine then prefills in arrival order, so the seven short jobs wait for four long
    prompts; with engine priority (class, then lane) they go first."""
    lengths = [60] + [2100] * 4 + [60] * 7
    burst = [TraceRequest(i, 0.0, p, 10, priority="normal") for i, p in enumerate(lengths)]
    config = LlmqConfig(heartbeat_s=0.25, engine_priority=engine_priority)
    jobs, stats, _ = run("llmq", burst, small_engine(max_num_seqs=64), pools=["any"],
                         config=config)
    assert stats.completed == 12
    assert {j.dispatched_s for j in jobs} == {0.0}
    lanes = [j.lane for j in sorted(jobs, key=lambda j: (j.first_token_s, j.idx))]
    if engine_priority:
        assert lanes == ["short"] * 8 + ["long"] * 4
    else:
        assert lanes == ["short"] + ["long"] * 4 + ["short"] * 7


def twice(config: BenchConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two runs of ``config``, without their wall-clock figures (all the rest must match)."""
    docs = (run_bench(config)[0], run_bench(config)[0])
    for doc in docs:
        del doc["elapsed_s"]
        for p in doc["policies"].values():
            del p["wall_s"]
    return docs


def test_same_seed_same_figures() -> None:
    first, second = twice(BenchConfig(synthetic=True, requests=600, workers=2, load=0.9,
                                      seed=5))
    assert first == second
    assert set(first["policies"]) == set(POLICIES)


def test_profile_of_the_shipped_fleet_is_used_by_name() -> None:
    profile = get_profile("llama3-8b-h100")
    jobs, stats, _ = run("llmq", workload(50, rate_rps=10.0), profile, pools=["short", "long"])
    assert stats.completed == 50 and stats.kv_preemptions == 0
    assert {j.worker for j in jobs if j.lane == "short"} <= {0}


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_run_ends_with_its_last_request_not_a_later_heartbeat(name: str) -> None:
    jobs, stats, sim = run(name, workload(100, rate_rps=40.0))
    assert stats.end_s == max(j.finished_s for j in jobs if j.finished_s is not None)
    assert stats.end_s <= sim.now


@pytest.mark.timeout(30)
def test_a_span_past_the_clocks_resolution_is_an_error_not_a_hang() -> None:
    # At 2e7 s a nanosecond is below a double's resolution: a wake would repeat forever.
    requests = [TraceRequest(0, 0.0, 100, 10), TraceRequest(1, 2e7, 100, 10)]
    with pytest.raises(SimulationError, match="nanosecond resolution"):
        run("fifo-rr", requests)


def _no_livelock(limit: int = 10_000) -> object:
    """A ``check`` hook that fails a run once it passes ``limit`` events."""
    events = 0

    def check(sim: Simulator) -> None:
        nonlocal events
        events += 1
        assert events <= limit, f"livelock: {events} events, clock at t={sim.now}"

    return check


@pytest.mark.parametrize("heartbeat_s", [1e-10, 4e-10, float("inf")])
def test_a_heartbeat_period_off_the_nanosecond_grid_is_refused(heartbeat_s: float) -> None:
    # Under 0.5 ns the period rounds to 0 and each heartbeat re-fires at the same instant.
    requests = [TraceRequest(0, 0.0, 100, 10), TraceRequest(1, 1.0, 100, 10)]
    with pytest.raises(ValueError, match="at least 1 ns"):
        run("llmq", requests, config=LlmqConfig(heartbeat_s=heartbeat_s), check=_no_livelock())


class _ShrinkingHeartbeat:
    """Beats at 0 and 2e7 s, then asks for one every nanosecond; rejects every job. At
    2e7 s a nanosecond is below a double's resolution: now + 1 ns is now."""

    name = "shrinking"

    def __init__(self) -> None:
        self.heartbeat_s: float | None = 2e7
        self._sim: Simulator | None = None

    def start(self, sim: Simulator) -> None:
        self._sim = sim

    def on_arrival(self, job: Job, now: float) -> None:
        assert self._sim is not None
        self._sim.reject(job, "test")

    def on_finished(self, job: Job, now: float) -> None:
        raise AssertionError("nothing is dispatched")

    def on_heartbeat(self, now: float) -> None:
        if now > 0:
            self.heartbeat_s = 1e-9

    def queued(self) -> int:
        return 0


def test_a_heartbeat_that_cannot_move_the_clock_is_an_error_not_a_livelock() -> None:
    jobs = make_jobs([TraceRequest(0, 0.0, 10, 5), TraceRequest(1, 3e7, 10, 5)], TIGHT)
    sim = Simulator(jobs, TIGHT, ["any"], _ShrinkingHeartbeat(), check=_no_livelock())  # type: ignore[arg-type]
    with pytest.raises(SimulationError, match="nanosecond resolution"):
        sim.run()


@pytest.mark.timeout(30)
def test_bench_refuses_a_sub_nanosecond_heartbeat_naming_the_option() -> None:
    result = CliRunner().invoke(
        bench_policies,
        ["--synthetic", "--requests", "10", "--policies", "llmq", "--heartbeat-s", "1e-10", "-q"],
    )
    assert result.exit_code == 2, result.output
    assert "--heartbeat-s" in result.output and "at least 1 ns" in result.output
    assert "Traceback" not in result.output


@pytest.mark.timeout(60)
def test_bench_table_shows_each_lanes_floor_from_the_json(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = CliRunner().invoke(
        bench_policies,
        ["--synthetic", "--requests", "300", "--workers", "2", "--policies", "fifo-rr,llmq",
         "--json", str(out)],
        terminal_width=200,
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    for lane in ("short", "long"):
        floor = doc["policies"]["llmq"]["lanes"][lane]["e2e_alone_p99_s"]
        assert floor == doc["policies"]["fifo-rr"]["lanes"][lane]["e2e_alone_p99_s"]
        for policy in doc["policies"].values():  # nobody beats the floor
            assert policy["lanes"][lane]["e2e_p99_with_rejections_s"] >= floor
    short = doc["policies"]["llmq"]["lanes"]["short"]["e2e_alone_p99_s"]
    assert f"short {short:.3g}s" in result.output and "e2e p99 alone" in result.output
