"""The simulator with prefill and decode apart (``--pools pd``): invariants, the hand-off
model against hand-computed times, the split of the fleet, determinism."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from services.scheduler.core.types import WorkerState
from services.sim.bench import BenchConfig, prepare
from services.sim.fleet import COMPLETED, REJECTED, Job, SimWorker, make_jobs
from services.sim.llmq import LlmqConfig, LlmqPolicy
from services.sim.pools import split_roles
from services.sim.simulator import SimStats, SimulationError, Simulator
from services.sim.workload import TraceRequest, attach_classes, synthetic
from services.worker.engines.sim import EngineProfile, get_profile
from services.worker.engines.sim.model import to_ns, to_s
from tests.unit.test_sim_simulator import twice

H100 = get_profile("llama3-8b-h100")


def workload(n: int, rate_rps: float, seed: int = 3) -> list[TraceRequest]:
    rng = random.Random(seed)
    return attach_classes(synthetic(n, rng, rate_rps=rate_rps, prompt_mean=1500.0,
                                    prompt_max=6000, output_mean=150.0, output_max=600), rng)


def run_pd(requests: list[TraceRequest], roles: tuple[str, ...] = ("prefill", "prefill",
           "decode"), profile: EngineProfile = H100, check: object = None,
           ) -> tuple[list[Job], SimStats, Simulator]:
    jobs = make_jobs(requests, profile)
    policy = LlmqPolicy(random.Random(7), LlmqConfig(heartbeat_s=0.25))
    sim = Simulator(jobs, profile, ["any"] * len(roles), policy, roles=roles,  # type: ignore[arg-type]
                    check=check)  # type: ignore[arg-type]
    return jobs, sim.run(), sim


def test_every_request_ends_once_after_both_phases_and_kv_is_conserved() -> None:
    placed: dict[int, set[str]] = {}

    def check(sim: Simulator) -> None:
        for w in sim.workers:
            engine = w.engine
            assert engine.blocks_held() + engine.free_blocks == engine.profile.num_blocks
            assert w.in_flight >= 0
        for job in sim.jobs:
            if job.worker is not None:
                placed.setdefault(job.idx, set()).add(sim.workers[job.worker].role)

    jobs, stats, sim = run_pd(workload(300, rate_rps=20.0), check=check)
    assert stats.arrived == 300 == stats.completed + stats.rejected
    assert stats.kv_preemptions == 0
    policy = sim.policy
    assert isinstance(policy, LlmqPolicy) and len(policy.ledger) == 0
    for j in jobs:
        assert j.state in (COMPLETED, REJECTED)
        if j.state == COMPLETED:
            assert j.phase in ("decode", "whole")
            assert j.finished_s is not None and j.first_token_s is not None
            assert j.arrival_s <= j.first_token_s <= j.finished_s
            assert j.finished_s - j.arrival_s >= j.e2e_alone_s - 1e-9
    decoded = [j for j in jobs if j.phase == "decode"]
    assert decoded and all(placed[j.idx] == {"prefill", "decode"} for j in decoded)
    assert all(j.handed_off_s is None and j.handoff_queue_s >= 0 for j in jobs)


def test_llmq_learns_of_a_first_token_at_its_time_not_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: llmq was told of a prompt computed at the start of the step that
    computed it, up to a step (136 ms with a full prefill chunk) before its first token,
    and its overflow rule counted that prompt as done too early."""
    told: list[tuple[float, float | None]] = []
    first_token = LlmqPolicy.on_first_token

    def record(self: LlmqPolicy, job: Job, now: float) -> None:
        told.append((now, job.first_token_s))
        first_token(self, job, now)

    monkeypatch.setattr(LlmqPolicy, "on_first_token", record)
    _, stats, _ = run_pd(workload(200, rate_rps=20.0))
    assert stats.completed == 200 and len(told) >= 200
    assert all(now == first for now, first in told)


def test_heartbeats_report_decoding_up_to_now() -> None:
    """Found by an audit: an engine in a quiet decode run was advanced only at the run's
    start, so a heartbeat's tokens/s (read from its decoded-token counter) lagged, then
    caught up in a burst (off by 84 % at P99 on conv 0.85)."""
    seen: list[tuple[float, int]] = []
    policy = LlmqPolicy(random.Random(7), LlmqConfig(heartbeat_s=0.25))
    heartbeat = policy._heartbeat

    def spy(w: SimWorker, interval: float, now: float) -> WorkerState:
        seen.append((now, w.engine.decode_tokens))
        return heartbeat(w, interval, now)

    policy._heartbeat = spy  # type: ignore[method-assign]
    # One request alone: 600 tokens decoded one per step of ~5.76 ms (about 3.5 s).
    [job] = make_jobs([TraceRequest(0, 0.0, 100, 600)], H100)
    Simulator([job], H100, ["any"], policy).run()
    assert job.first_token_s is not None and job.finished_s is not None
    decoding = [(t, n) for t, n in seen if job.first_token_s < t < job.finished_s]
    assert len(decoding) >= 10
    step = H100.beta0_s + H100.beta2_s_per_decode_tok  # one decode step, one sequence
    for (t0, n0), (t1, n1) in itertools.pairwise(decoding):
        assert abs((n1 - n0) - (t1 - t0) / step) <= 2  # ~43 per 0.25 s, never 0 then a burst


def test_a_decode_stages_wait_for_a_decode_worker_is_queue_time() -> None:
    # Three prefill workers feed one decode worker faster than it decodes: decode stages
    # wait in llmq's queue, and that wait is part of the request's queue time (metrics).
    small = dataclasses.replace(H100, num_blocks=3_000)  # 48k tokens: about 30 requests
    jobs, stats, _ = run_pd(workload(400, rate_rps=60.0), profile=small,
                            roles=("prefill", "prefill", "prefill", "decode"))
    decoded = [j for j in jobs if j.phase == "decode"]
    assert stats.completed == 400 and decoded
    assert sum(j.handoff_queue_s > 0 for j in decoded) > len(decoded) // 10
    assert all(j.handoff_queue_s == 0 for j in jobs if j.phase == "whole")


def test_one_request_takes_prefill_then_transfer_then_decode_by_hand() -> None:
    # One request alone: prompt 1,000 and 10 output tokens on the H100 profile.
    request = TraceRequest(idx=0, arrival_s=0.0, prompt_tokens=1000, output_tokens=10,
                           tenant="t0", priority="normal")
    jobs, stats, _ = run_pd([request], roles=("prefill", "decode"))
    job = jobs[0]
    b0, b1, b2 = H100.beta0_s, H100.beta1_s_per_prefill_tok, H100.beta2_s_per_decode_tok
    step = lambda prefill, decode: to_s(to_ns(b0) + to_ns(b1) * prefill + to_ns(b2) * decode)  # noqa: E731
    prefilled = step(1000, 0)  # the prompt in one step; its token is discarded
    arrived = to_s(to_ns(prefilled + 0.001 + 1000 * H100.kv_bytes_per_token / 25e9))
    # The decode engine recomputes the last prompt token and samples all 10 tokens.
    first = arrived + step(1, 0)
    assert job.first_token_s == pytest.approx(first, abs=2e-9)
    assert job.finished_s == pytest.approx(first + 9 * step(0, 1), abs=1e-8)
    assert stats.completed == 1
    assert job.handoff_queue_s == 0  # an idle decode worker takes it as it arrives


def test_a_decode_stage_may_only_run_on_a_decode_worker_after_its_prefill() -> None:
    jobs = make_jobs(workload(2, rate_rps=1.0), H100)
    policy = LlmqPolicy(random.Random(1))
    sim = Simulator(jobs, H100, ["any", "any"], policy, roles=["prefill", "decode"])
    jobs[0].state = 1  # QUEUED
    with pytest.raises(SimulationError, match="decode stage"):
        sim.dispatch(jobs[0], 1, phase="decode")
    with pytest.raises(SimulationError, match="whole stage"):
        sim.dispatch(jobs[0], 0, phase="whole")
    with pytest.raises(ValueError, match="roles"):
        Simulator(jobs, H100, ["any"], policy, roles=["prefill", "decode"])


def test_split_roles_gives_decode_the_fewest_workers_for_its_work() -> None:
    assert split_roles(8, (5.3, 1.5)) == ["prefill"] * 6 + ["decode"] * 2
    assert split_roles(8, (6.6, 0.17)) == ["prefill"] * 7 + ["decode"]
    assert split_roles(2, (0.1, 9.0)) == ["prefill", "decode"]  # each side keeps one
    with pytest.raises(ValueError):
        split_roles(1, (1.0, 1.0))


def test_pd_bench_is_deterministic_and_reports_its_roles() -> None:
    config = BenchConfig(synthetic=True, requests=500, workers=4, load=0.8, seed=5, pools="pd",
                         policies=("fifo-rr", "llmq"))
    first, second = twice(config)
    assert first == second
    assert first["policies"]["llmq"]["roles"] == first["config"]["llmq_roles"]
    assert sum(first["config"]["llmq_roles"].values()) == 4
    assert "roles" not in first["policies"]["fifo-rr"]
    assert prepare(config).roles is not None


def test_pd_needs_two_workers() -> None:
    with pytest.raises(ValueError, match="at least 2 workers"):
        BenchConfig(synthetic=True, workers=1, pools="pd")
