"""The ``llmq`` policy in the simulator: the live pure cores, driven by simulated events.

Nothing here decides anything the live services would not: admission is
``services.ingest.core.admit``, queueing and placement are ``services.scheduler.schedule``
with the default profile (``DEFAULT_PROFILE``), the :class:`PendingQueue` (priority with
aging, lanes interleaved 3:1 on ``any`` workers) and the :class:`Ledger` (KV reservations).
This adapter only plays the parts of the Kafka plumbing:

* **Heartbeats** every ``heartbeat_s`` (default 1 s, the live interval): each worker is
  reported as its engine stands (running, waiting, free KV, tokens/s over the last
  interval), in one fresh :class:`Snapshot` that the scheduler uses until the next one.
  The ledger, updated at once by placements and finishes, is ahead of it.
* **Queue status** (``llmq.status``) with the same period: ``queued_tokens`` = Σ (prompt +
  max_tokens) of pending requests, ``drain_tokens_per_s`` from the live scheduler's
  :class:`DrainMeter` (reserved tokens, prompt + max_tokens, of requests finished while
  requests waited, per backlogged second, over
  ``drain_window_s`` = 30 s), fed the same way: finishes as they happen, the backlog
  after every scheduling pass. With the live workers, their largest usable KV and the
  fleet's KV headroom it forms the :class:`ClusterView` admission reads; like the live
  ingest, admission sees it as of the last status.
* **Engine priority**: a placement joins its engine's waiting queue at the class it has
  aged into (``PendingQueue.engine_priority``: 0 high, 1 normal, 2 low), as the live
  scheduler's assignment tells the worker, and within a class the short lane before the
  long one (``schemas.common.engine_rank``, what the live worker submits to an engine run
  with vLLM's priority scheduling; a prefill stage is ranked for a prompt queue, high
  class first, then short before long); then by arrival at the engine. The baselines submit
  everything at 0 — plain FCFS, what a vLLM fleet without priorities does.
  ``engine_priority=False`` submits llmq's at 0 too.
* **Assignments** are delivered at once: a placement is added to its engine and marked
  started in the ledger in the same instant; a finish releases the reservation and settles
  the tenant's token bucket (``settle``) at once. Both pass their time (``at=now``), so the
  ledger credits releases since the last heartbeat to that heartbeat's view.

* **Prefill and decode apart** (a fleet with ``prefill`` and ``decode`` workers, e.g.
  ``llmq bench policies --pools pd``): the cycle places a request's prefill stage on a
  prefill worker; when the simulator delivers its KV (``on_prefilled``) the decode stage
  (``QueuedRequest.handoff()``, attempt 1) is pushed back into the pending queue, where a
  cycle places it on a decode worker. The prefill reservation is kept until then (a real
  prefill engine holds the prompt's KV until the decode side pulls it; the simulated one
  frees it at once, so this only errs on the safe side), as the live scheduler keeps it
  until the decode stage starts. First tokens are reported to the ledger
  (``mark_first_token``), which is how the cycle knows how much prompt work each worker
  has left (the overflow rule of :mod:`services.scheduler.core.cycle`).

Every request asks for ``max_tokens`` (the true output length, times the bench's slack)
and ``timeout_s``; its queue deadline is ``arrival + timeout_s``. The reservation is
``kv_tokens_for(prompt, max_tokens, block_size)``; the ledger's usable KV per worker is
``⌊num_blocks × block_size × (1 − kv_safety_margin)⌋``, so Σ reservations never exceed
the engine's pool and the engines never preempt (a request's KV never outgrows its
reservation: an engine holds ``ceil((prompt + generated) / block_size)`` blocks).

Tenants: every tenant gets limits far above any offered load (rpm, tpm, concurrency) and
``max_priority = high`` — the bench measures queue governance, not per-tenant quotas, so
the only admission rejections are ``overloaded`` (the queue would not drain within the
request's timeout) and ``too_large``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from schemas.common import Lane, engine_rank
from services.ingest.core import (
    AdmissionConfig,
    AdmissionRequest,
    ClusterView,
    LaneConfig,
    ModelCapacity,
    TenantPolicy,
    TenantState,
    admit,
    kv_tokens_for,
    settle,
)
from services.ingest.core import Reject as AdmissionReject
from services.scheduler import (
    DEFAULT_LANE_WEIGHTS,
    DEFAULT_PROFILE,
    DrainMeter,
    Ledger,
    PendingQueue,
    Placement,
    QueueConfig,
    QueuedRequest,
    Reject,
    Snapshot,
    WorkerState,
    build_pipeline,
    schedule,
)
from services.sim.fleet import Job, SimWorker
from services.sim.simulator import Simulator

#: Every simulated worker runs the ``sim`` engine (its heartbeat's ``engine``), so a
#: prompt's KV may pass between any prefill and decode worker of the fleet.
ENGINE: Final = "sim"

_UNLIMITED: Final = 1e15


@dataclass(frozen=True, slots=True)
class LlmqConfig:
    """llmq's settings in the simulator (defaults: the live defaults)."""

    heartbeat_s: float = 1.0
    timeout_s: float = 120.0
    kv_safety_margin: float = 0.05
    aging_s_per_class: float = 30.0
    #: Decode stages' ordering step per class (``QueueConfig.handoff_step_s``).
    handoff_step_s: float = 1.0
    drain_window_s: float = 30.0
    lane_threshold: int = 2000
    #: Engines order their waiting queue by the request's class (vLLM's
    #: ``--scheduling-policy priority``), as llmq's workers ask them to; False: FCFS.
    engine_priority: bool = True
    lane_weights: Mapping[Lane, float] = field(default_factory=lambda: dict(DEFAULT_LANE_WEIGHTS))
    profile: Mapping[str, object] = field(default_factory=lambda: dict(DEFAULT_PROFILE))

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "timeout_s", "drain_window_s", "aging_s_per_class"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LlmqConfig.{name} must be > 0")


class LlmqPolicy:
    """``llmq``: admission → pending queue → ``schedule()`` → engines, per the module doc."""

    name = "llmq"

    def __init__(self, rng: random.Random, config: LlmqConfig | None = None) -> None:
        self.config = config or LlmqConfig()
        cfg = self.config
        self.heartbeat_s: float | None = cfg.heartbeat_s
        self._rng = rng
        self._pipeline = build_pipeline(cfg.profile)
        self._admission = AdmissionConfig(lanes=LaneConfig(cfg.lane_threshold))
        self._ledger = Ledger(kv_safety_margin=cfg.kv_safety_margin)
        self._pending = PendingQueue(self._queue_config(100_000))
        self.aging_bound_s: float | None = self._pending.aging_bound_s("low")
        self._tenants: dict[str, TenantPolicy] = {}
        self._states: dict[str, TenantState] = {}
        self._reserved: dict[int, int] = {}
        self._queued_tokens = 0
        self._drain = DrainMeter(cfg.drain_window_s)
        self._decoded: list[int] = []
        self._snapshot: Snapshot | None = None
        self._view = ClusterView()
        self._model = ""
        self._block_size = 16
        self._sim: Simulator | None = None
        self._staged: dict[int, QueuedRequest] = {}  # prefill stages placed, by job
        self._attempts: dict[int, int] = {}  # jobs placed at an attempt other than 0
        self.admission_checks: Counter[str] = Counter()

    @property
    def ledger(self) -> Ledger:
        """The reservation ledger (read it, e.g. in tests; the policy owns it)."""
        return self._ledger

    # ---- Policy -------------------------------------------------------------------------
    def start(self, sim: Simulator) -> None:
        self._sim = sim
        profile = sim.profile
        served = profile.model or profile.name
        shape = self._admission.registry.get(served)
        self._model = shape.name if shape is not None else served
        self._block_size = profile.block_size
        self._decoded = [0] * len(sim.workers)
        # The pending queue is bounded; the live service leaves the excess in Kafka. Here
        # the whole workload may be queued, so the bound is the workload's size.
        self._pending = PendingQueue(self._queue_config(max(100_000, len(sim.jobs) + 1)))

    def on_heartbeat(self, now: float) -> None:
        sim = self._started()
        interval = self.config.heartbeat_s
        states = [self._heartbeat(w, interval, now) for w in sim.workers]
        self._snapshot = Snapshot.of(states, now)
        self._view = self._cluster_view(states, now)
        self._schedule(now)

    def on_arrival(self, job: Job, now: float) -> None:
        sim = self._started()
        tenant = self._tenant(job.tenant)
        state = self._states.get(job.tenant) or TenantState.full(tenant, now)
        request = AdmissionRequest(
            request_id=str(job.idx),
            tenant=job.tenant,
            model=self._model,
            prompt_tokens=job.prompt,
            max_tokens=job.max_tokens,
            priority=job.priority,
            lane_hint=None,
            timeout_s=self.config.timeout_s,
        )
        result = admit(request, tenant, state, self._view, now, config=self._admission)
        if isinstance(result, AdmissionReject):
            self.admission_checks[result.check] += 1
            sim.reject(job, result.code)
            return
        self._states[job.tenant] = result.new_state
        self._reserved[job.idx] = result.reserved_tokens
        queued = QueuedRequest(
            request_id=str(job.idx),
            tenant=job.tenant,
            model=result.model,
            model_version=None,
            priority=result.priority,
            lane=result.lane,
            prompt_tokens=job.prompt,
            max_tokens=job.max_tokens,
            kv_tokens=kv_tokens_for(job.prompt, job.max_tokens, self._block_size),
            enqueued_at=now,
            deadline=now + self.config.timeout_s,
        )
        if not self._pending.push(queued):
            raise AssertionError("the pending queue is sized for the whole workload")
        self._queued_tokens += job.prompt + job.max_tokens
        self._schedule(now)

    def on_finished(self, job: Job, now: float) -> None:
        self._ledger.release(str(job.idx), self._attempts.pop(job.idx, 0), at=now,
                             held_tokens=job.prompt + job.output)
        self._settle(job, job.prompt + job.output, now)
        # The queue's unit, as the live scheduler measures it (prompt + max_tokens).
        self._drain.add(self._model, now, job.prompt + job.max_tokens)
        self._schedule(now)

    def on_prefilled(self, job: Job, now: float) -> None:
        staged = self._staged[job.idx]
        self._ledger.mark_first_token(staged.request_id, staged.attempt)  # computed
        self._pending.push(staged.handoff(kv_engine=ENGINE), force=True)
        self._queued_tokens += job.prompt + job.max_tokens
        self._schedule(now)

    def on_first_token(self, job: Job, now: float) -> None:
        self._ledger.mark_first_token(str(job.idx), self._attempts.get(job.idx, 0))

    def queued(self) -> int:
        return len(self._pending)

    # ---- internals ----------------------------------------------------------------------
    def _queue_config(self, max_pending: int) -> QueueConfig:
        cfg = self.config
        return QueueConfig(
            aging_s_per_class=cfg.aging_s_per_class,
            max_pending=max_pending,
            lane_weights=dict(cfg.lane_weights),
            handoff_step_s=cfg.handoff_step_s,
        )

    def _schedule(self, now: float) -> None:
        if len(self._pending) and self._snapshot is not None:
            self._place(self._snapshot, now)
        self._drain.waiting(now, (self._model,) if len(self._pending) else ())

    def _place(self, snapshot: Snapshot, now: float) -> None:
        sim = self._started()
        jobs = sim.jobs
        decisions = schedule(snapshot, self._pending, self._ledger, self._pipeline, now, self._rng)
        for d in decisions:
            if isinstance(d, Placement):
                job = jobs[int(d.request.request_id)]
                self._queued_tokens -= job.prompt + job.max_tokens
                self._end_prefill(job)  # a decode stage pulls its KV: the prefill's ends
                if d.phase == "prefill":
                    self._staged[job.idx] = d.request
                if d.attempt:
                    self._attempts[job.idx] = d.attempt
                sim.dispatch(job, d.partition, self._engine_priority(d.request, now), d.phase)
                self._ledger.mark_started(d.request.request_id, d.attempt, at=now)
            elif isinstance(d, Reject):
                job = jobs[int(d.request_id)]
                self._queued_tokens -= job.prompt + job.max_tokens
                self._end_prefill(job)
                sim.reject(job, d.code)
                self._settle(job, 0, now)

    def _end_prefill(self, job: Job) -> None:
        staged = self._staged.pop(job.idx, None)
        if staged is not None:
            self._ledger.release(staged.request_id, staged.attempt)

    def _engine_priority(self, request: QueuedRequest, now: float) -> int:
        # What the live worker submits for an assignment: the class the request has aged
        # into (the scheduler's engine_priority), then its lane; 0 for all (FCFS) when off.
        if not self.config.engine_priority:
            return 0
        return engine_rank(self._pending.engine_priority(request, now), request.lane,
                           request.phase)

    def _settle(self, job: Job, used: int, now: float) -> None:
        reserved = self._reserved.pop(job.idx)
        tenant = self._tenants[job.tenant]
        self._states[job.tenant] = settle(self._states[job.tenant], tenant, reserved, used, now)

    def _heartbeat(self, w: SimWorker, interval: float, now: float) -> WorkerState:
        engine = w.engine
        decoded = engine.decode_tokens
        rate = (decoded - self._decoded[w.index]) / interval
        self._decoded[w.index] = decoded
        profile = engine.profile
        return WorkerState(
            worker_id=w.worker_id,
            model=self._model,
            model_version=None,
            pool=w.pool,
            partition=w.index,
            kv_total_tokens=profile.kv_total_tokens,
            kv_free_tokens=engine.kv_free_tokens,
            block_size=profile.block_size,
            running=engine.running,
            waiting=engine.waiting,
            max_num_seqs=profile.max_num_seqs,
            draining=False,
            heartbeat_ts=now,
            tokens_per_s=rate,
            role=w.role,
            engine=ENGINE,
        )

    def _cluster_view(self, states: list[WorkerState], now: float) -> ClusterView:
        # As ingest counts the fleet: prefill workers run no request to its end.
        states = [s for s in states if s.role != "prefill"]
        usable = [self._ledger.usable_kv(s) for s in states]
        reserved = sum(self._ledger.reserved_kv(s.worker_id) for s in states)
        capacity = ModelCapacity(
            model=self._model,
            live_workers=len(states),
            max_usable_kv_tokens=max(usable, default=0),
            queued_tokens=self._queued_tokens,
            drain_tokens_per_s=self._drain.rate(self._model, now),
            kv_headroom_tokens=max(0, sum(usable) - reserved),
        )
        return ClusterView.of([capacity])

    def _tenant(self, name: str) -> TenantPolicy:
        policy = self._tenants.get(name)
        if policy is None:
            policy = self._tenants[name] = TenantPolicy(
                tenant=name,
                rpm=_UNLIMITED,
                tpm=_UNLIMITED,
                max_concurrency=10**12,
                max_priority="high",
            )
        return policy

    def _started(self) -> Simulator:
        assert self._sim is not None, "start() first"
        return self._sim
