"""Discrete-event simulator: drives N calibrated ``SimEngineCore``s under one policy.

The simulator owns the clock, the event heap, the engines and the job records; a
*policy* (:mod:`.policies`) owns every decision — admission, queueing, routing — and acts
through two calls: :meth:`Simulator.dispatch` (send a job to a worker's engine) and
:meth:`Simulator.reject` (end it with an error code). Every policy runs on the same cost
model (the engine core) and the same arrivals; nothing here knows which policy runs.

Events, in time order (ties: heap entries before an arrival at the same instant, then
insertion order — so a run is deterministic):

* **arrival** of the next job of the workload (arrivals are pre-sorted and merged with the
  heap rather than pushed into it) → ``policy.on_arrival``;
* **wake** of an engine at ``engine.quiet_until_s()``, the start of its next step that can
  do more than decode one token per sequence (admit, prefill, preempt, finish). The engine
  is advanced through that one step (``advance(wake + 1 ns)``) and the step's events are
  recorded: the first ``first_token`` sets TTFT, ``preempted`` counts, ``finished`` is
  pushed as a *finish* event at its own time. Quiet decode steps in between are never
  visited (the core fast-forwards them exactly);
* **finish** at the end of the step that produced a job's last token → the dispatcher's
  in-flight count drops, then ``policy.on_finished``;
* **hand-off** (disaggregated fleets only): a job dispatched as a prefill stage finishes
  its one token on a prefill worker; its KV cache then travels for ``1 ms + prompt ×
  kv_bytes_per_token ÷ link`` (``kv_link_gbps``, 25 GB/s: one 200 Gb/s link) and at
  the end of that the prefill worker's in-flight count drops and the policy is told
  (``on_prefilled``); it places the decode stage, which joins a decode engine with all
  but the last prompt token cached (``SimRequest.cached_tokens``) and samples every
  output token, the first one included, as vLLM's decode instance does behind its P/D
  proxy (the prefill's token is discarded). A policy that dispatches phases also hears
  of first tokens (``on_first_token``), which is when an engine has computed a prompt;
* **heartbeat** every ``policy.heartbeat_s`` seconds (only for policies that ask for one)
  → ``policy.on_heartbeat``, which reads the workers the way heartbeats would report them.

Before a job is added to an engine, the engine is advanced to ``now`` (every step that
starts before ``now`` runs; the last one may end after it, its events carry their own
times). So an engine's internal state may run up to one step ahead of the clock, while
everything a policy is told happens exactly at its event time. After each event, every
engine it touched gets one fresh wake-up (stale ones are skipped by a version number).

Invariants (checked at the end of :meth:`Simulator.run`): the clock never goes back;
each job completes or is rejected exactly once; arrived = completed + rejected (+ in
flight, which is 0 after the drain); every engine ends idle with all its KV free.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from schemas.common import Phase, Pool, Role
from services.sim.fleet import (
    COMPLETED,
    QUEUED,
    REJECTED,
    RUNNING,
    Job,
    SimWorker,
)
from services.worker.engines.sim import EngineProfile, SeqEvent, SimRequest
from services.worker.engines.sim.model import to_ns, to_s

_WAKE: Final = 0
_FINISH: Final = 1
_HEARTBEAT: Final = 2
_HANDOFF: Final = 3
_FIRST_TOKEN: Final = 4
#: advance(wake + _EPS_S) runs exactly the step that starts at ``wake`` (the core rounds to
#: integer ns; this lands 1 ns past it for times below ~10^6 s).
_EPS_S: Final = 1e-9

#: What a heap entry carries: the worker to wake, the job that finished, or nothing.
_Payload = SimWorker | Job | None


class SimulationError(RuntimeError):
    """The run broke an invariant or cannot make progress (a bug, never a result)."""


class ClockResolutionError(SimulationError, ValueError):
    """The workload spans more time than the nanosecond clock can step through (float
    seconds past ~2·10^6 s): an input to change — a higher load, fewer requests — not a
    bug. A ``ValueError`` too, so the command line reports it in one line."""


def check_heartbeat(period_s: float) -> None:
    """Refuse a heartbeat period the clock cannot step by: one that is not finite, or that
    rounds to under 1 ns on the nanosecond grid (each heartbeat would then schedule the next
    at the same instant, forever). ``ValueError`` names it."""
    if not (math.isfinite(period_s) and to_ns(period_s) >= 1):
        raise ValueError(
            f"{period_s!r} s: a heartbeat period must be finite and at least 1 ns (the "
            "simulator's clock resolution)"
        )


class Policy(Protocol):
    """What a policy implements; :mod:`.policies` has the four compared in the bench."""

    name: str
    #: Seconds between heartbeats, or None when the policy reads engines directly.
    heartbeat_s: float | None

    def start(self, sim: Simulator) -> None:
        """Called once before the first event, with the fleet built."""

    def on_arrival(self, job: Job, now: float) -> None: ...

    def on_finished(self, job: Job, now: float) -> None: ...

    def on_heartbeat(self, now: float) -> None: ...

    def queued(self) -> int:
        """Jobs the policy holds that are neither dispatched nor rejected."""
        ...


@runtime_checkable
class PhasedPolicy(Policy, Protocol):
    """A policy that runs requests in two phases on a disaggregated fleet."""

    def on_prefilled(self, job: Job, now: float) -> None:
        """``job``'s prefill stage ended and its KV arrived: place its decode stage."""

    def on_first_token(self, job: Job, now: float) -> None:
        """An engine computed ``job``'s prompt: called at its first token's time."""


@dataclass(frozen=True, slots=True)
class SimStats:
    """Counters of one run (the per-request figures live in the jobs)."""

    arrived: int
    completed: int
    rejected: int
    in_flight: int
    end_s: float
    events: int
    wakes: int
    engine_steps: int
    kv_preemptions: int


ProgressFn = Callable[[int], None]


class Simulator:
    """One run of one policy over one workload on one fleet; single use."""

    def __init__(
        self,
        jobs: Sequence[Job],
        profile: EngineProfile,
        pools: Sequence[Pool],
        policy: Policy,
        *,
        progress: ProgressFn | None = None,
        progress_every: int = 2000,
        check: Callable[[Simulator], None] | None = None,
        roles: Sequence[Role] | None = None,
        kv_link_gbps: float = 25.0,
    ) -> None:
        if not pools:
            raise ValueError("the fleet needs at least one worker")
        if roles is not None and len(roles) != len(pools):
            raise ValueError(f"{len(roles)} roles for {len(pools)} workers")
        if not (math.isfinite(kv_link_gbps) and kv_link_gbps > 0):
            raise ValueError(f"kv_link_gbps must be finite and > 0, got {kv_link_gbps!r}")
        for i in range(1, len(jobs)):
            if jobs[i].arrival_s < jobs[i - 1].arrival_s:
                raise ValueError("jobs must be sorted by arrival")
        self.jobs = jobs
        self.profile = profile
        self.workers = [
            SimWorker(i, profile, pool, roles[i] if roles is not None else "mixed")
            for i, pool in enumerate(pools)
        ]
        self.policy = policy
        self._phased = policy if isinstance(policy, PhasedPolicy) else None
        self._link_bytes_per_s = kv_link_gbps * 1e9
        self.now = 0.0
        self.completed = 0
        self.rejected = 0
        self._progress = progress
        self._progress_every = max(1, progress_every)
        self._check = check  # called after every event (tests assert invariants in it)
        self._reported = 0
        self._heap: list[tuple[float, int, int, _Payload, int]] = []
        self._seq = 0
        self._dirty: dict[int, None] = {}  # workers touched by the current event, in order
        self._events = 0
        self._wakes = 0
        self._ran = False

    # ---- what policies call ---------------------------------------------------------
    def dispatch(self, job: Job, worker: int, priority: int = 0, phase: Phase = "whole") -> None:
        """Send ``job`` to worker ``worker`` now; it joins the engine's waiting queue at
        ``priority`` (vLLM's: lower first; every job at the default 0 is FCFS). ``phase``:
        the whole request, its prefill stage (one token, on a ``prefill`` worker) or, after
        its hand-off, its decode stage (on a ``decode`` worker)."""
        if job.state != QUEUED:
            raise SimulationError(f"job {job.idx} dispatched in state {job.state}")
        w = self.workers[worker]
        expected = {"whole": w.role != "prefill", "prefill": w.role == "prefill",
                    "decode": w.role == "decode" and job.phase == "prefill"}
        if not expected[phase]:
            raise SimulationError(
                f"job {job.idx}: {phase} stage (after {job.phase}) on a {w.role} worker")
        now = self.now
        engine = w.engine
        if engine.has_work:
            self._record(engine.advance(now), w)
        if phase == "prefill":
            request = SimRequest(job.idx, job.prompt, 1, job.arrival_s, priority)
        else:
            cached = max(0, job.prompt - 1) if phase == "decode" else 0
            request = SimRequest(job.idx, job.prompt, job.output, job.arrival_s, priority,
                                 cached_tokens=cached)
        engine.add(request, now)
        job.state = RUNNING
        if job.dispatched_s is None:
            job.dispatched_s = now
        if job.handed_off_s is not None:  # its decode stage waited in the queue since
            job.handoff_queue_s += now - job.handed_off_s
            job.handed_off_s = None
        job.phase = phase
        job.worker = worker
        w.in_flight += 1
        self._dirty[worker] = None

    def reject(self, job: Job, code: str) -> None:
        """End ``job`` now with error ``code`` (it was never dispatched)."""
        if job.state != QUEUED:
            raise SimulationError(f"job {job.idx} rejected in state {job.state}")
        job.state = REJECTED
        job.reject_code = code
        job.finished_s = self.now
        self.rejected += 1

    # ---- the loop -------------------------------------------------------------------
    def run(self) -> SimStats:
        if self._ran:
            raise SimulationError("a Simulator runs once")
        self._ran = True
        policy, jobs, heap = self.policy, self.jobs, self._heap
        policy.start(self)
        if policy.heartbeat_s is not None:
            check_heartbeat(policy.heartbeat_s)
            self._push(0.0, _HEARTBEAT, None)
        n, i = len(jobs), 0
        heappop = heapq.heappop
        while True:
            next_arrival = jobs[i].arrival_s if i < n else math.inf
            if heap and heap[0][0] <= next_arrival:
                t, _, kind, payload, version = heappop(heap)
                self._advance_clock(t)
                if kind == _WAKE:
                    assert isinstance(payload, SimWorker)
                    self._wake(payload, version)
                elif kind == _FINISH:
                    assert isinstance(payload, Job)
                    self._finish(payload)
                elif kind == _HANDOFF:
                    assert isinstance(payload, Job)
                    self._handoff(payload)
                elif kind == _FIRST_TOKEN:
                    assert isinstance(payload, Job) and self._phased is not None
                    self._phased.on_first_token(payload, self.now)
                else:
                    self._heartbeat(i < n)
            elif i < n:
                job = jobs[i]
                i += 1
                self._advance_clock(job.arrival_s)
                job.state = QUEUED
                policy.on_arrival(job, self.now)
            else:
                break
            self._events += 1
            if self._dirty:
                self._schedule_wakes()
            if self._check is not None:
                self._check(self)
            done = self.completed + self.rejected
            if self._progress is not None and done - self._reported >= self._progress_every:
                self._progress(done - self._reported)
                self._reported = done
        if self._progress is not None and self.completed + self.rejected > self._reported:
            self._progress(self.completed + self.rejected - self._reported)
        return self._finish_run(i)

    # ---- internals ------------------------------------------------------------------
    def _advance_clock(self, t: float) -> None:
        if t < self.now:
            raise SimulationError(f"clock went back from {self.now} to {t}")
        self.now = t

    def _push(self, t: float, kind: int, payload: _Payload, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload, version))

    def _schedule_wakes(self) -> None:
        for index in self._dirty:
            w = self.workers[index]
            w.version += 1
            wake = w.engine.quiet_until_s()
            if wake is not None:
                self._push(wake, _WAKE, w, w.version)
        self._dirty.clear()

    def _wake(self, w: SimWorker, version: int) -> None:
        if version != w.version:
            return
        self._wakes += 1
        until = self.now + _EPS_S
        if to_ns(until) <= to_ns(self.now):
            raise ClockResolutionError(
                f"t={self.now:.0f} s is past the clock's nanosecond resolution: the simulated "
                "span is too long (raise --load, or use fewer requests)"
            )
        self._record(w.engine.advance(until), w)
        self._dirty[w.index] = None

    def _record(self, events: list[SeqEvent], w: SimWorker) -> None:
        jobs, phased = self.jobs, self._phased
        for e in events:
            job = jobs[e.seq_id]
            kind = e.kind
            if kind == "finished":
                if job.phase == "prefill":  # its KV now travels to a decode worker
                    self._push(self._arrives_s(e.time_s, job.prompt), _HANDOFF, job)
                else:
                    self._push(e.time_s, _FINISH, job)
            elif kind == "first_token":
                if job.phase == "prefill":
                    continue  # the prefill's token is discarded; the decode samples it
                if job.first_token_s is None:
                    job.first_token_s = e.time_s
                if phased is not None:
                    # Told at the token's time, the end of its step, not at the step's
                    # start: llmq must not learn a prompt was computed before it was.
                    self._push(e.time_s, _FIRST_TOKEN, job)
            else:
                job.preemptions += 1

    def _arrives_s(self, sent_s: float, prompt_tokens: int) -> float:
        transfer = 0.001 + prompt_tokens * self.profile.kv_bytes_per_token / self._link_bytes_per_s
        return to_s(to_ns(sent_s + transfer))

    def _handoff(self, job: Job) -> None:
        if job.state != RUNNING or job.worker is None or self._phased is None:
            raise SimulationError(f"job {job.idx} handed off in state {job.state}")
        job.state = QUEUED
        job.handed_off_s = self.now
        self.workers[job.worker].in_flight -= 1
        self._phased.on_prefilled(job, self.now)

    def _finish(self, job: Job) -> None:
        if job.state != RUNNING or job.worker is None:
            raise SimulationError(f"job {job.idx} finished in state {job.state}")
        job.state = COMPLETED
        job.finished_s = self.now
        self.completed += 1
        self.workers[job.worker].in_flight -= 1
        self.policy.on_finished(job, self.now)

    def _heartbeat(self, arrivals_left: bool) -> None:
        # Engines to now first: one in a quiet decode run was last advanced at its start,
        # and its counters (decoded tokens: the tokens/s a heartbeat reports) would lag by
        # up to that run's length. Only quiet steps start before now, so no event comes
        # and the wake already due stays right (rescheduled all the same if one came).
        for w in self.workers:
            if w.engine.has_work:
                events = w.engine.advance(self.now)
                if events:
                    self._record(events, w)
                    self._dirty[w.index] = None
        self.policy.on_heartbeat(self.now)
        busy = any(w.in_flight for w in self.workers)
        if arrivals_left or busy or self.policy.queued():
            if not (arrivals_left or busy or self._heap):
                # Jobs queued, nothing running, nothing due: the policy can never place them.
                raise SimulationError(
                    f"stuck at t={self.now:.3f}s: {self.policy.queued()} jobs queued on an "
                    "idle fleet"
                )
            interval = self.policy.heartbeat_s
            assert interval is not None
            self._push(self._next_heartbeat_s(interval), _HEARTBEAT, None)

    def _next_heartbeat_s(self, interval: float) -> float:
        """``now + interval`` on the nanosecond grid, at least 1 ns after now: a heartbeat
        due at ``now`` would fire again and again without the clock moving."""
        t = to_s(max(to_ns(self.now + interval), to_ns(self.now) + 1))
        if t <= self.now:
            raise ClockResolutionError(
                f"t={self.now:.0f} s is past the clock's nanosecond resolution: the simulated "
                "span is too long for this heartbeat period (raise --load or --heartbeat-s, or use "
                "fewer requests)"
            )
        return t

    def _finish_run(self, arrived: int) -> SimStats:
        in_flight = sum(w.in_flight for w in self.workers)
        queued = self.policy.queued()
        if queued:
            raise SimulationError(f"{queued} jobs still queued after the last event")
        if self.completed + self.rejected + in_flight != arrived or in_flight:
            raise SimulationError(
                f"conservation: arrived {arrived} != completed {self.completed} + rejected "
                f"{self.rejected} + in flight {in_flight}"
            )
        for w in self.workers:
            engine = w.engine
            if engine.has_work or engine.free_blocks != engine.profile.num_blocks:
                raise SimulationError(f"{w.worker_id} did not drain")
        return SimStats(
            arrived=arrived,
            completed=self.completed,
            rejected=self.rejected,
            in_flight=in_flight,
            # The last request's end, not the clock: that may stop at a later heartbeat.
            end_s=max((j.finished_s for j in self.jobs if j.finished_s is not None),
                      default=self.now),
            events=self._events,
            wakes=self._wakes,
            engine_steps=sum(w.engine.steps for w in self.workers),
            kv_preemptions=sum(w.engine.preemptions for w in self.workers),
        )
