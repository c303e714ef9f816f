"""The simulated fleet: one :class:`Job` per request and one :class:`SimWorker` per engine.

A job is the simulator's record of one request from arrival to its terminal event; the
metrics are computed from these records alone. A worker wraps one calibrated
``SimEngineCore`` (the single cost model every policy runs on) with the dispatcher's own
count of sequences in flight (dispatched, finish not yet delivered), which is what a load
balancer or the scheduler knows at the current instant; the engine itself may already be
up to one step ahead of the simulation clock (see :mod:`.simulator`).

Reference latencies come from :func:`services.worker.engines.sim.capacity.latency_alone`:
``slowdown = e2e latency / e2e alone`` and ``wait = max(0, TTFT − TTFT alone)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from schemas.common import Lane, Phase, Pool, Priority, Role
from services.ingest.core import LaneConfig, classify_lane
from services.sim.workload import TraceRequest
from services.worker.engines.sim import EngineProfile, SimEngineCore, latency_alone
from services.worker.engines.sim.model import to_ns, to_s

#: Job states. A job is terminal once completed or rejected.
ARRIVING: Final = 0
QUEUED: Final = 1
RUNNING: Final = 2
COMPLETED: Final = 3
REJECTED: Final = 4


class Job:
    """One request of the workload and everything that happened to it (times in s)."""

    __slots__ = (
        "arrival_s",
        "dispatched_s",
        "e2e_alone_s",
        "finished_s",
        "first_token_s",
        "handed_off_s",
        "handoff_queue_s",
        "idx",
        "lane",
        "max_tokens",
        "output",
        "phase",
        "preemptions",
        "priority",
        "prompt",
        "reject_code",
        "state",
        "tenant",
        "ttft_alone_s",
        "worker",
    )

    def __init__(
        self,
        request: TraceRequest,
        lane: Lane,
        max_tokens: int,
        alone: tuple[float, float],
    ) -> None:
        self.idx = request.idx
        # On the engine's integer-ns grid, so the clock and the engines agree exactly.
        self.arrival_s = to_s(to_ns(request.arrival_s))
        self.prompt = request.prompt_tokens
        self.output = request.output_tokens
        self.tenant = request.tenant
        self.priority: Priority = request.priority
        self.lane: Lane = lane
        self.max_tokens = max_tokens
        self.ttft_alone_s, self.e2e_alone_s = alone
        self.state = ARRIVING
        self.dispatched_s: float | None = None
        #: A two-stage job: when its prefill handed off, and how long its decode stage
        #: then waited in the policy's queue (part of its ``queue`` time, metrics).
        self.handed_off_s: float | None = None
        self.handoff_queue_s = 0.0
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.worker: int | None = None
        self.reject_code: str | None = None
        self.preemptions = 0
        #: What its latest dispatch ran: ``whole``, or ``prefill`` then ``decode`` on a
        #: disaggregated fleet (``worker`` is then the decode worker once it is there).
        self.phase: Phase = "whole"

    @property
    def terminal(self) -> bool:
        return self.state >= COMPLETED


def make_jobs(
    requests: Sequence[TraceRequest],
    profile: EngineProfile,
    *,
    lanes: LaneConfig | None = None,
    max_tokens_slack: float = 1.0,
    model: str = "",
) -> list[Job]:
    """Jobs for ``requests`` in arrival order (``idx`` must be 0..n-1 in that order).

    ``max_tokens = ceil(output × max_tokens_slack)``: the trace's output length is the true
    output; the slack inflates only what the client asks for (and llmq reserves). The lane
    is ``classify_lane(prompt + max_tokens)`` for every policy, so per-lane figures compare.
    A request that could never fit an engine's KV pool gets infinite reference latencies
    (every policy rejects it; it never enters a latency figure).
    """
    if max_tokens_slack < 1.0:
        raise ValueError(f"max_tokens_slack must be >= 1, got {max_tokens_slack}")
    config = lanes or LaneConfig()
    cache: dict[tuple[int, int], tuple[float, float]] = {}
    jobs: list[Job] = []
    for i, r in enumerate(requests):
        if r.idx != i:
            raise ValueError(f"request {i} has idx {r.idx}: expected 0..n-1 in arrival order")
        max_tokens = max(r.output_tokens, math.ceil(round(r.output_tokens * max_tokens_slack, 6)))
        lane = classify_lane(r.prompt_tokens + max_tokens, model, None, False, config)
        key = (r.prompt_tokens, r.output_tokens)
        alone = cache.get(key)
        if alone is None:
            fits = r.prompt_tokens + r.output_tokens <= profile.max_seq_tokens()
            alone = latency_alone(profile, *key) if fits else (math.inf, math.inf)
            cache[key] = alone
        jobs.append(Job(r, lane, max_tokens, alone))
    return jobs


class SimWorker:
    """One engine of the fleet. ``in_flight``: dispatched, finish not yet delivered."""

    __slots__ = ("engine", "in_flight", "index", "pool", "role", "version", "worker_id")

    def __init__(
        self, index: int, profile: EngineProfile, pool: Pool = "any", role: Role = "mixed"
    ) -> None:
        self.index = index
        self.worker_id = f"w{index:05d}"
        self.pool: Pool = pool
        self.role: Role = role
        self.engine = SimEngineCore(profile)
        self.in_flight = 0
        self.version = 0  # bumped whenever a scheduled wake-up becomes stale

    @property
    def max_num_seqs(self) -> int:
        return self.engine.profile.max_num_seqs
