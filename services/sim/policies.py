"""The baseline policies of the bench, and the registry of every policy by name.

Each policy is a small adapter between the simulator's events and a placement rule; all
of them run on the same engines (one cost model) and the same arrivals. None of the
baselines admits, prioritises or knows about KV: each engine schedules FCFS and preempts
when its KV runs out, as a plain vLLM does. Exact readings:

``fifo-rr``
    One global FIFO. Whenever a job arrives or a sequence finishes, the FIFO's head goes
    to the next worker in round-robin order *that has a free sequence slot* (dispatched
    and unfinished < ``max_num_seqs``), the cursor moving on past it; when no worker has a
    free slot the FIFO waits for the next finish. This is the core's ``round-robin``
    picker (smallest worker id after the last one placed on, wrapping) over the workers
    that pass ``seq-slots`` alone — no KV filter, no priorities, no lanes.

``least-requests``
    Route each job on arrival, with the core's ``least-requests`` picker, to the worker
    with the fewest jobs in flight (dispatched and unfinished; ties uniformly at random).
    Every worker is a candidate: no slot or KV limit, the engine queues the excess. (For
    speed the picker is handed only the workers tied at the minimum — the same decision,
    see :class:`FewestInFlight`.)

``vllm-random``
    Route each job on arrival with the core's ``random`` picker, uniformly over the fleet:
    a plain vLLM fleet behind a load balancer.

``llmq`` (:mod:`.llmq`)
    llmq's own governance: admission, priority with aging, lanes, KV-aware placement.

A job longer than an engine accepts — prompt + max_tokens over the model's
``max_model_len`` or over what the KV pool holds, whichever is less
(:func:`~services.sim.workload.context_limit`) — can never run: the baselines reject it
``too_large`` on arrival, as vLLM refuses a request longer than its ``max_model_len``
(which it keeps within its KV pool). llmq's admission applies the same ``max_model_len``
through its own check, and its KV check besides.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping

from services.scheduler import (
    REGISTRY,
    Ledger,
    Picker,
    PlacementContext,
    Snapshot,
    WorkerState,
)
from services.sim.fleet import Job, SimWorker
from services.sim.llmq import LlmqConfig, LlmqPolicy
from services.sim.simulator import Policy, Simulator
from services.sim.workload import context_limit


def _fits_engine(limit: int, job: Job) -> bool:
    """Whether vLLM would take ``job`` at all (``limit``: :func:`context_limit`)."""
    return job.prompt + job.max_tokens <= limit


class FifoRoundRobin:
    """``fifo-rr``: one global FIFO, round-robin over workers with a free sequence slot."""

    name = "fifo-rr"
    heartbeat_s: float | None = None
    aging_bound_s: float | None = None

    def __init__(self, rng: random.Random) -> None:
        self._fifo: deque[Job] = deque()
        self._cursor = -1
        self._free = 0  # workers with a free sequence slot
        self._sim: Simulator | None = None
        self._limit = 0

    def start(self, sim: Simulator) -> None:
        self._sim = sim
        self._free = len(sim.workers)
        self._limit = context_limit(sim.profile)

    def on_arrival(self, job: Job, now: float) -> None:
        sim = self._started()
        if not _fits_engine(self._limit, job):
            sim.reject(job, "too_large")
            return
        self._fifo.append(job)
        self._pump(sim)

    def on_finished(self, job: Job, now: float) -> None:
        sim = self._started()
        assert job.worker is not None
        w = sim.workers[job.worker]
        if w.in_flight == w.max_num_seqs - 1:
            self._free += 1
        self._pump(sim)

    def on_heartbeat(self, now: float) -> None:
        return None

    def queued(self) -> int:
        return len(self._fifo)

    def _pump(self, sim: Simulator) -> None:
        fifo, workers = self._fifo, sim.workers
        n = len(workers)
        while fifo and self._free > 0:
            target = self._next_free(workers, n)
            sim.dispatch(fifo.popleft(), target)
            self._cursor = target
            w = workers[target]
            if w.in_flight >= w.max_num_seqs:
                self._free -= 1

    def _next_free(self, workers: list[SimWorker], n: int) -> int:
        start = self._cursor
        for step in range(1, n + 1):
            j = (start + step) % n
            w = workers[j]
            if w.in_flight < w.max_num_seqs:
                return j
        raise AssertionError("free-slot count out of step with the workers")

    def _started(self) -> Simulator:
        assert self._sim is not None, "start() first"
        return self._sim


class RouteOnArrival:
    """Route every job on arrival with one of the core's baseline pickers.

    The candidates are every worker, described by a :class:`WorkerState` whose
    ``running`` is the dispatcher's exact in-flight count (kept current on every dispatch
    and finish, as a load balancer counts its open requests); the ledger is empty, so
    ``ledger.in_flight(worker)`` is exactly that count.
    """

    heartbeat_s: float | None = None
    aging_bound_s: float | None = None

    def __init__(self, name: str, picker: str, rng: random.Random) -> None:
        self.name = name
        plugin = REGISTRY[picker]({})
        if not isinstance(plugin, Picker):
            raise ValueError(f"{picker!r} is not a picker")
        self._picker = plugin
        self._rng = rng
        self._ledger = Ledger(kv_safety_margin=0.0)
        self._candidates: list[tuple[float, WorkerState]] = []
        self._snapshot: Snapshot | None = None
        self._sim: Simulator | None = None
        self._limit = 0

    def start(self, sim: Simulator) -> None:
        self._sim = sim
        self._limit = context_limit(sim.profile)
        states = [_state(w, 0) for w in sim.workers]
        self._candidates = [(0.0, s) for s in states]
        self._snapshot = Snapshot.of(states, 0.0)

    def on_arrival(self, job: Job, now: float) -> None:
        sim, snapshot = self._sim, self._snapshot
        assert sim is not None and snapshot is not None, "start() first"
        if not _fits_engine(self._limit, job):
            sim.reject(job, "too_large")
            return
        ctx = PlacementContext(snapshot, self._ledger, now)
        chosen = self._picker.pick(self._choices(), self._rng, ctx)
        index = chosen.partition
        sim.dispatch(job, index)
        self._refresh(sim.workers[index])

    def on_finished(self, job: Job, now: float) -> None:
        assert self._sim is not None and job.worker is not None
        self._refresh(self._sim.workers[job.worker])

    def on_heartbeat(self, now: float) -> None:
        return None

    def queued(self) -> int:
        return 0

    def _choices(self) -> list[tuple[float, WorkerState]]:
        """The candidate list handed to the picker: every worker."""
        return self._candidates

    def _refresh(self, w: SimWorker) -> None:
        self._candidates[w.index] = (0.0, _state(w, w.in_flight))


class FewestInFlight(RouteOnArrival):
    """``least-requests`` with the candidate list cut to the workers that can win.

    The core picker takes the minimum of ``in_flight`` over its candidates and breaks
    ties with ``rng.choice`` over the tied ones in candidate order. Handing it only the
    workers at the minimum, in worker order, gives it the same tied list — the same
    choice, the same rng draw — in O(ties) instead of O(fleet) per arrival. Workers are
    bucketed by in-flight count to find them.
    """

    def __init__(self, rng: random.Random) -> None:
        super().__init__("least-requests", "least-requests", rng)
        self._load: list[int] = []
        self._by_load: dict[int, set[int]] = {}
        self._fewest = 0

    def start(self, sim: Simulator) -> None:
        super().start(sim)
        self._load = [0] * len(sim.workers)
        self._by_load = {0: set(range(len(sim.workers)))}
        self._fewest = 0

    def _choices(self) -> list[tuple[float, WorkerState]]:
        candidates = self._candidates
        return [candidates[i] for i in sorted(self._by_load[self._fewest])]

    def _refresh(self, w: SimWorker) -> None:
        super()._refresh(w)
        old, new = self._load[w.index], w.in_flight
        if old == new:
            return
        bucket = self._by_load[old]
        bucket.discard(w.index)
        if not bucket:
            del self._by_load[old]
        self._by_load.setdefault(new, set()).add(w.index)
        self._load[w.index] = new
        if new < self._fewest:
            self._fewest = new
        elif old == self._fewest and old not in self._by_load:
            self._fewest = min(self._by_load)


def _state(w: SimWorker, in_flight: int) -> WorkerState:
    profile = w.engine.profile
    return WorkerState(
        worker_id=w.worker_id,
        model=profile.model,
        model_version=None,
        pool=w.pool,
        partition=w.index,
        kv_total_tokens=profile.kv_total_tokens,
        kv_free_tokens=profile.kv_total_tokens,
        block_size=profile.block_size,
        running=in_flight,
        waiting=0,
        max_num_seqs=profile.max_num_seqs,
        draining=False,
        heartbeat_ts=0.0,
        tokens_per_s=0.0,
    )


#: Builds a policy from its seeded rng and llmq's settings (the baselines have none).
PolicyFactory = Callable[[random.Random, LlmqConfig], Policy]

#: Every policy the bench knows, by name, in the order the bench reports them.
POLICIES: Mapping[str, PolicyFactory] = {
    "fifo-rr": lambda rng, _: FifoRoundRobin(rng),
    "least-requests": lambda rng, _: FewestInFlight(rng),
    "vllm-random": lambda rng, _: RouteOnArrival("vllm-random", "random", rng),
    "llmq": LlmqPolicy,
}
