"""The policy benchmark: one workload, one fleet, every policy, one JSON document.

Order of work (all randomness from one ``random.Random(seed)``, drawn in this order, so a
seed fixes everything):

1. Load the trace (or generate ``synthetic`` arrivals: gamma inter-arrival times with
   coefficient of variation ``synthetic_cv`` — 1, the default, is Poisson — and lognormal
   lengths with means ``synthetic_prompt_mean`` / ``synthetic_output_mean``, default
   1,000 / 200 tokens; see :func:`~services.sim.workload.synthetic`), keep the first
   ``requests`` of them.
2. ``attach_classes``: Zipf tenants and 10/60/30 % high/normal/low.
3. ``fleet_capacity_rps``: N · μ for this length mix; ``scale_to_load`` so the offered
   load is ``load`` (λ = ρ · N · μ), keeping the trace's burstiness. μ is measured on the
   requests that fit an engine at all, and those are the ones that arrive at ρ · N · μ
   (requests too large for any engine, refused by every policy, come on top).
4. llmq's pools from each lane's work, or with ``pools = "pd"`` its prefill and decode
   roles from each phase's work (:mod:`.pools`); the baselines use every worker whole.
5. Each policy runs on a fresh copy of the same jobs and a fresh fleet, with its own rng
   ``random.Random(f"{seed}/{policy}")`` — so a policy's figures do not depend on which
   other policies run, or in which order.

The result is plain JSON-able data; wall-clock figures sit under ``wall_s`` and
``elapsed_s`` only, so two runs with one seed differ in nothing else.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from schemas.common import Pool, Role
from services.ingest.core import LaneConfig
from services.sim.fleet import Job, make_jobs
from services.sim.llmq import LlmqConfig
from services.sim.metrics import Summary, cdf_points, summarize
from services.sim.policies import POLICIES
from services.sim.pools import PoolMode, lane_work, phase_work, split_pools, split_roles
from services.sim.simulator import Simulator
from services.sim.workload import (
    TraceRequest,
    attach_classes,
    fleet_capacity_rps,
    load_trace,
    runnable_share,
    scale_to_load,
    synthetic,
)
from services.worker.engines.sim import EngineProfile, get_profile

#: Called with the number of requests that reached a terminal state since the last call.
Advance = Callable[[int], None]
#: Given a policy name and its request count, returns its progress callback (or None).
ProgressFactory = Callable[[str, int], Advance | None]


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to run; ``trace`` is ignored when ``synthetic`` is set."""

    trace: Path | None = None
    synthetic: bool = False
    requests: int | None = None
    workers: int = 8
    profile: str = "llama3-8b-h100"
    profiles_file: Path | None = None
    load: float = 0.85
    seed: int = 1
    policies: tuple[str, ...] = tuple(POLICIES)
    pools: PoolMode = "latency"
    #: KV transfer between a prefill and a decode worker (``pools = "pd"``), GB/s.
    kv_link_gbps: float = 25.0
    max_tokens_slack: float = 1.0
    llmq: LlmqConfig = field(default_factory=LlmqConfig)
    #: The synthetic workload's inter-arrival coefficient of variation (1: Poisson).
    synthetic_cv: float = 1.0
    #: The synthetic workload's mean prompt and output lengths, tokens.
    synthetic_prompt_mean: float = 1000.0
    synthetic_output_mean: float = 200.0
    #: The file ``llmq.profile`` was read from (reported only; None: the default profile).
    scheduler_profile: Path | None = None

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not (math.isfinite(self.load) and self.load > 0):
            raise ValueError(f"load must be a finite number > 0, got {self.load!r}")
        if not (math.isfinite(self.max_tokens_slack) and self.max_tokens_slack >= 1):
            raise ValueError(
                f"max_tokens_slack must be a finite number >= 1, got {self.max_tokens_slack!r}"
            )
        if self.requests is not None and self.requests < 2:
            raise ValueError("requests must be >= 2")
        if not self.synthetic and self.trace is None:
            raise ValueError("give a trace or ask for a synthetic workload")
        if self.pools == "pd" and self.workers < 2:
            raise ValueError("--pools pd needs at least 2 workers (a prefill and a decode one)")
        if not (math.isfinite(self.kv_link_gbps) and self.kv_link_gbps > 0):
            raise ValueError(f"kv_link_gbps must be a finite number > 0, got {self.kv_link_gbps!r}")
        if not (math.isfinite(self.synthetic_cv) and self.synthetic_cv > 0):
            raise ValueError(f"synthetic_cv must be a finite number > 0, got {self.synthetic_cv!r}")
        for name in ("synthetic_prompt_mean", "synthetic_output_mean"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"{name} must be a finite number >= 1, got {value!r}")
        for f in fields(self.llmq):  # LlmqConfig checks > 0, which inf and some NaN pass
            value = getattr(self.llmq, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"llmq.{f.name} must be finite, got {value!r}")


@dataclass(frozen=True, slots=True)
class Workload:
    """The scaled arrivals every policy sees, and how they were made."""

    requests: list[TraceRequest]
    profile: EngineProfile
    capacity_rps: float
    pools: list[Pool]
    source: str
    roles: list[Role] | None = None  # llmq's, with pools = "pd"


def prepare(config: BenchConfig) -> Workload:
    """Steps 1-4 of the module docstring."""
    rng = random.Random(config.seed)
    profile = get_profile(config.profile, config.profiles_file)
    if config.synthetic:
        raw = synthetic(config.requests or 200_000, rng, rate_rps=1.0, cv=config.synthetic_cv,
                        prompt_mean=config.synthetic_prompt_mean,
                        output_mean=config.synthetic_output_mean)
        source = "synthetic"
    else:
        assert config.trace is not None
        raw = load_trace(config.trace)
        source = str(config.trace)
    if config.requests is not None:
        raw = raw[: config.requests]
    classed = attach_classes(raw, rng)
    capacity = fleet_capacity_rps(profile, config.workers, classed, rng)
    scaled = scale_to_load(classed, config.load, capacity, runnable_share(profile, classed))
    jobs = _jobs(scaled, profile, config)
    usable = int(profile.kv_total_tokens * (1 - config.llmq.kv_safety_margin))
    if config.pools == "pd":
        roles = split_roles(config.workers, phase_work(profile, jobs, rng, usable))
        return Workload(scaled, profile, capacity, ["any"] * config.workers, source, roles)
    pools = split_pools(config.workers, lane_work(profile, jobs, rng, usable), config.pools)
    return Workload(scaled, profile, capacity, list(pools), source)


def _jobs(
    requests: Sequence[TraceRequest], profile: EngineProfile, config: BenchConfig
) -> list[Job]:
    return make_jobs(
        requests,
        profile,
        lanes=LaneConfig(config.llmq.lane_threshold),
        max_tokens_slack=config.max_tokens_slack,
        model=profile.model,
    )


@dataclass(slots=True)
class PolicyRun:
    """One policy's summary, plus what only plots need (kept out of the JSON)."""

    summary: Summary
    cdf: dict[str, tuple[list[float], list[float]]]


def run_policy(
    name: str, workload: Workload, config: BenchConfig, advance: Advance | None = None
) -> PolicyRun:
    """Simulate ``name`` on a fresh fleet and fresh jobs; returns its figures."""
    jobs = _jobs(workload.requests, workload.profile, config)
    policy = POLICIES[name](random.Random(f"{config.seed}/{name}"), config.llmq)
    ours = name == "llmq"
    pools: list[Pool] = workload.pools if ours else ["any"] * config.workers
    roles = workload.roles if ours else None
    started = time.perf_counter()
    stats = Simulator(jobs, workload.profile, pools, policy, progress=advance, roles=roles,
                      kv_link_gbps=config.kv_link_gbps).run()
    wall = time.perf_counter() - started
    summary = summarize(jobs, config.llmq.timeout_s)
    summary.update(
        kv_preemptions=stats.kv_preemptions,
        aging_bound_s=getattr(policy, "aging_bound_s", None),
        makespan_s=round(stats.end_s - jobs[0].arrival_s, 6),
        engine_steps=stats.engine_steps,
        events=stats.events,
        pools={p: pools.count(p) for p in ("short", "long", "any") if p in pools},
        wall_s=round(wall, 3),
    )
    if roles is not None:
        summary["roles"] = {r: roles.count(r) for r in ("prefill", "decode") if r in roles}
    checks = getattr(policy, "admission_checks", None)
    if checks:
        summary["admission_checks"] = dict(sorted(checks.items()))
    cdf = {lane: cdf_points(jobs, lane) for lane in ("short", "long")}
    return PolicyRun(summary, cdf)


def run_bench(
    config: BenchConfig, progress: ProgressFactory | None = None
) -> tuple[dict[str, Any], dict[str, PolicyRun]]:
    """Every policy of ``config`` on one workload: (JSON document, runs by policy)."""
    started = time.perf_counter()
    workload = prepare(config)
    runs: dict[str, PolicyRun] = {}
    for name in config.policies:
        advance = progress(name, len(workload.requests)) if progress else None
        runs[name] = run_policy(name, workload, config, advance)
    doc = {
        "policies": {name: run.summary for name, run in runs.items()},
        "config": _config_doc(config, workload),
        "elapsed_s": round(time.perf_counter() - started, 3),
    }
    return doc, runs


def _config_doc(config: BenchConfig, workload: Workload) -> dict[str, Any]:
    reqs = workload.requests
    llmq = asdict(config.llmq)
    return {
        "source": workload.source,
        "requests": len(reqs),
        "workers": config.workers,
        "profile": config.profile,
        "engine": {
            "num_blocks": workload.profile.num_blocks,
            "block_size": workload.profile.block_size,
            "max_num_seqs": workload.profile.max_num_seqs,
            "max_num_batched_tokens": workload.profile.max_num_batched_tokens,
        },
        "load": config.load,
        "seed": config.seed,
        "policies": list(config.policies),
        "max_tokens_slack": config.max_tokens_slack,
        "pool_mode": config.pools,
        "llmq_pools": {p: workload.pools.count(p) for p in ("short", "long", "any")},
        **({"llmq_roles": {r: workload.roles.count(r) for r in ("prefill", "decode")},
            "kv_link_gbps": config.kv_link_gbps} if workload.roles is not None else {}),
        **({"synthetic": {"cv": config.synthetic_cv,
                          "prompt_mean": config.synthetic_prompt_mean,
                          "output_mean": config.synthetic_output_mean}}
           if config.synthetic else {}),
        "fleet_capacity_rps": round(workload.capacity_rps, 6),
        "arrival_span_s": round(reqs[-1].arrival_s - reqs[0].arrival_s, 6),
        **({"scheduler_profile": str(config.scheduler_profile)}
           if config.scheduler_profile is not None else {}),
        "llmq": {k: (dict(v) if isinstance(v, dict) else v) for k, v in llmq.items()},
    }
