"""``scripts/experiments/pd_split.py`` (the prefill/decode experiment quoted in
docs/benchmarks.md, "Eleventh round"): every request goes through both phases, in order,
never faster than alone on an idle engine, and a seed gives the same figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from services.sim.bench import BenchConfig, prepare
from services.sim.fleet import COMPLETED

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "experiments" / "pd_split.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pd_split", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_request_is_prefilled_then_decoded_and_never_beats_its_time_alone() -> None:
    pd = _script()
    config = BenchConfig(synthetic=True, requests=400, workers=4, load=0.9, seed=3)
    workload = prepare(config)
    profile = workload.profile
    jobs, preemptions = pd.run_split(workload, config, n_prefill=3, gbps=25.0)
    assert len(jobs) == 400 and preemptions == 0
    for job in jobs:
        assert job.state == COMPLETED
        assert job.dispatched_s == job.arrival_s and job.worker in range(3)
        assert job.arrival_s <= job.first_token_s <= job.finished_s
        # Prefill alone, then (T - 1) decode steps alone: the split adds a transfer and
        # removes nothing, so neither can be beaten.
        assert job.first_token_s - job.arrival_s >= job.ttft_alone_s * (1 - 1e-9)
        assert job.finished_s - job.arrival_s >= job.e2e_alone_s * (1 - 1e-9)
        if job.output > 1:  # decoding starts once the KV arrived: T - 1 steps after it
            transfer = 0.001 + job.prompt * pd.KV_BYTES_PER_TOKEN / 25e9
            steps = (job.output - 1) * (profile.beta0_s + profile.beta2_s_per_decode_tok)
            assert job.finished_s - job.first_token_s >= (transfer + steps) * (1 - 1e-9)
    again, _ = pd.run_split(workload, config, n_prefill=3, gbps=25.0)
    assert [j.finished_s for j in again] == [j.finished_s for j in jobs]
