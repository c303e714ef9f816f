"""``scripts/experiments/pd_split.py`` (the prefill/decode experiment quoted in
docs/benchmarks.md, "Eleventh round" and "Twelfth round"): every request goes through both
phases, in order, never faster than alone on an idle engine; an overflow sends only long
requests whole to decode engines; a seed gives the same figures."""

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
    jobs, split = pd.run_split(workload, config, n_prefill=3, gbps=25.0)
    assert len(jobs) == 400 and split == pd.Split(preemptions=0, overflowed=0)
    for job in jobs:
        assert job.state == COMPLETED
        assert job.dispatched_s == job.arrival_s and job.worker in range(3)
        assert job.arrival_s <= job.first_token_s <= job.finished_s
        # The prompt alone on a prefill engine, the KV transfer, then a decode-engine step
        # that recomputes the last prompt token and samples the first output token: the
        # split adds a transfer and a step and removes nothing, so the first token cannot
        # come sooner than that, nor the last sooner than T - 1 more decode steps.
        transfer = 0.001 + job.prompt * pd.KV_BYTES_PER_TOKEN / 25e9
        first_step = profile.beta0_s + profile.beta1_s_per_prefill_tok
        assert job.first_token_s - job.arrival_s >= (job.ttft_alone_s + transfer
                                                     + first_step) * (1 - 1e-9)
        steps = (job.output - 1) * (profile.beta0_s + profile.beta2_s_per_decode_tok)
        assert job.finished_s - job.first_token_s >= steps * (1 - 1e-9)
        assert job.finished_s - job.arrival_s >= job.e2e_alone_s * (1 - 1e-9)
    again, _ = pd.run_split(workload, config, n_prefill=3, gbps=25.0)
    assert [j.finished_s for j in again] == [j.finished_s for j in jobs]


def test_overflow_sends_long_requests_whole_to_decode_engines_only_under_backlog() -> None:
    pd = _script()
    config = BenchConfig(synthetic=True, requests=400, workers=4, load=0.9, seed=3)
    workload = prepare(config)
    jobs, split = pd.run_split(workload, config, n_prefill=3, gbps=25.0, overflow=0)
    whole = [j for j in jobs if j.worker == 3]
    assert split.overflowed == len(whole) > 0 and all(j.lane == "long" for j in whole)
    for job in jobs:
        assert job.state == COMPLETED
        assert job.finished_s - job.arrival_s >= job.e2e_alone_s * (1 - 1e-9)
    # A backlog no prefill engine ever reaches: nothing overflows, the fixed split exactly.
    fixed, _ = pd.run_split(workload, config, n_prefill=3, gbps=25.0)
    never, split = pd.run_split(workload, config, n_prefill=3, gbps=25.0, overflow=10**9)
    assert split.overflowed == 0
    assert [j.finished_s for j in never] == [j.finished_s for j in fixed]
