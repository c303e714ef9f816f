"""Simulator invariants over random small workloads and fleets, for every policy.

For any arrivals, lengths, priorities and pool labels: every request ends exactly once
(completed + rejected = arrived, nothing left in flight), the clock never goes back,
engines never hold more KV than they have, and llmq never reserves more than a worker's
usable KV, never exceeds its sequence slots and never causes a KV preemption.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.common import PRIORITIES, Pool
from services.sim.fleet import make_jobs
from services.sim.llmq import LlmqConfig, LlmqPolicy
from services.sim.policies import POLICIES
from services.sim.simulator import Simulator
from services.sim.workload import TraceRequest
from services.worker.engines.sim import EngineProfile

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PROFILE = EngineProfile(
    name="prop",
    beta0_s=0.004,
    beta1_s_per_prefill_tok=2e-5,
    beta2_s_per_decode_tok=1e-5,
    num_blocks=64,
    block_size=16,
    max_num_seqs=6,
    max_num_batched_tokens=256,
    source="hypothesis",
)  # 1,024 KV tokens: a few requests fill it


@st.composite
def workloads(draw: st.DrawFn) -> list[TraceRequest]:
    n = draw(st.integers(1, 40))
    gaps = draw(st.lists(st.floats(0.0, 0.3), min_size=n, max_size=n))
    out, t = [], 0.0
    for i, gap in enumerate(gaps):
        t += gap
        out.append(
            TraceRequest(
                idx=i,
                arrival_s=t,
                prompt_tokens=draw(st.integers(1, 700)),
                output_tokens=draw(st.integers(1, 400)),
                tenant=draw(st.sampled_from(["a", "b", "c"])),
                priority=draw(st.sampled_from(PRIORITIES)),
            )
        )
    return out


pools = st.lists(st.sampled_from(["short", "long", "any"]), min_size=1, max_size=3)


@SETTINGS
@given(
    requests=workloads(),
    fleet=pools,
    name=st.sampled_from(sorted(POLICIES)),
    threshold=st.sampled_from([300, 2000]),
)
def test_conservation_and_capacity(
    requests: list[TraceRequest], fleet: list[Pool], name: str, threshold: int
) -> None:
    if name == "llmq" and not {"any"} <= set(fleet) and not {"short", "long"} <= set(fleet):
        fleet = [*fleet, "any"]  # llmq rejects a lane no worker serves; keep both served
    config = LlmqConfig(heartbeat_s=0.2, timeout_s=30.0, lane_threshold=threshold)
    jobs = make_jobs(requests, PROFILE)
    policy = POLICIES[name](random.Random(11), config)
    usable = int(PROFILE.kv_total_tokens * (1 - config.kv_safety_margin))
    clock: list[float] = []

    def check(sim: Simulator) -> None:
        clock.append(sim.now)
        for w in sim.workers:
            assert 0 <= w.engine.free_blocks <= PROFILE.num_blocks
            if isinstance(sim.policy, LlmqPolicy):
                assert sim.policy.ledger.reserved_kv(w.worker_id) <= usable
                assert w.in_flight <= PROFILE.max_num_seqs

    stats = Simulator(jobs, PROFILE, fleet, policy, check=check).run()
    assert stats.arrived == len(requests) == stats.completed + stats.rejected
    assert stats.in_flight == 0
    assert clock == sorted(clock)
    assert all(j.terminal for j in jobs)
    if name == "llmq":
        assert stats.kv_preemptions == 0
        assert len(policy.ledger) == 0  # type: ignore[attr-defined]
    else:
        too_large = sum(1 for r in requests if r.prompt_tokens + r.output_tokens > 1025)
        assert stats.rejected == too_large
