"""How llmq splits a fleet into short, long and shared (``any``) pools for a workload.

Same hardware for every policy: llmq only labels its workers. The split follows each
lane's work, measured in engine time with the same cost model:

    W(L) = (n_L / μ_L) / T         (engines kept busy by lane L, on average)

``n_L`` is the number of requests of lane L, ``T`` the span of the arrivals and ``μ_L``
the completion rate of one engine with an endless backlog of that lane's requests (all
of them, or ``sample_size`` drawn without replacement by the seeded rng), admitted the
way llmq admits them (:func:`reserved_capacity`): FCFS, a request joins the engine only
while Σ (prompt + max_tokens, in whole blocks) of those running stays within the usable
KV and a sequence slot is free. Where KV is plentiful this is vLLM's own saturated rate;
where KV is scarce it is lower than vLLM's (which admits on current size and preempts),
and the split must use llmq's rate or it starves the KV-heavy lane. Modes:

* ``latency`` (default): the long lane is for throughput, the short lane for latency. The
  long pool gets the fewest workers that carry its work at utilization ≤ ``u`` (0.9):
  ``n_long = ceil(W(long) / u)``; every other worker serves the short lane, which then
  runs cooler than the long one. If that would push the short pool above ``u`` (the
  fleet is too loaded to favour one lane), it falls back to ``proportional``;
* ``proportional``: equal utilization, ``round(N · W(short) / Σ W)`` short workers and
  the rest long;
* ``hybrid``: ``⌊N · W(L) / Σ W⌋`` dedicated workers per lane, the remainder (0 or 1)
  ``any``, where the lanes interleave 3:1;
* ``any``: every worker takes both lanes (interleaved 3:1).
* ``pd``: prefill and decode apart (:func:`split_roles`): every worker takes both lanes,
  some compute prompts and hand their KV on, the others decode. The split makes the
  busier side as cool as it can be: ``n_decode`` in 1 … N − 1 minimising
  ``max(W(prefill) / (N − n_decode), W(decode) / n_decode)``, where W(phase) is measured
  as above with an engine fed prefill stages only (one output token) or decode stages
  only (all but the last prompt token cached). The overflow rule of the cycle covers
  the prefill side's peaks.

Each lane with requests keeps at least one worker; a one-lane workload gives every worker
to that lane; a fleet of one worker is ``any``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Literal

from schemas.common import Lane, Pool, Role
from services.sim.fleet import Job
from services.worker.engines.sim import EngineProfile, SimEngineCore, SimRequest

PoolMode = Literal["latency", "proportional", "hybrid", "any", "pd"]


def reserved_capacity(
    profile: EngineProfile,
    lengths: Sequence[tuple[int, int, int]],
    usable_kv: int,
    n: int,
    *,
    cached: bool = False,
) -> float:
    """Completed requests/s of one engine fed ``n`` requests (``lengths`` = (prompt, output,
    max_tokens), repeated) under llmq's reservation rule; the rate is measured between the
    10 % and 70 % completion marks, as :func:`saturated_capacity` does. ``cached``: each
    arrives with all but its last prompt token in KV (a decode stage)."""
    core = SimEngineCore(profile)
    bs, slots = profile.block_size, profile.max_num_seqs
    reserved: dict[int, int] = {}
    total, nxt, done = 0, 0, []

    def fill(now: float) -> None:
        nonlocal total, nxt
        while nxt < n and len(reserved) < slots:
            prompt, output, max_tokens = lengths[nxt % len(lengths)]
            kv = -(-(prompt + max_tokens) // bs) * bs
            if total + kv > usable_kv and reserved:
                return  # FCFS: the head waits for room (alone, it always starts)
            core.add(SimRequest(nxt, prompt, output,
                                cached_tokens=prompt - 1 if cached else 0), now)
            reserved[nxt] = kv
            total += kv
            nxt += 1

    fill(0.0)
    while core.has_work:
        wake = core.quiet_until_s()
        assert wake is not None
        for e in core.advance(wake + 1e-9):
            if e.kind == "finished":
                total -= reserved.pop(e.seq_id)
                done.append(e.time_s)
                fill(e.time_s)
    t_open, t_close = done[n // 10], done[(7 * n) // 10]
    counted = sum(1 for t in done if t_open < t <= t_close)
    return counted / (t_close - t_open) if t_close > t_open else math.inf


def _runs(profile: EngineProfile, usable_kv: int) -> Callable[[Job], bool]:
    """Whether a job runs at all: the rest are refused too_large and add no work."""
    bs, limit = profile.block_size, profile.max_seq_tokens()

    def runs(j: Job) -> bool:
        reserved = -(-(j.prompt + j.max_tokens) // bs) * bs
        return j.prompt + j.output <= limit and reserved <= usable_kv

    return runs


def lane_work(
    profile: EngineProfile,
    jobs: Sequence[Job],
    rng: random.Random,
    usable_kv: int,
    sample_size: int = 4096,
) -> dict[Lane, float]:
    """W(L): engines kept busy by each lane on average (0 for an empty lane)."""
    span = jobs[-1].arrival_s - jobs[0].arrival_s if jobs else 0.0
    work: dict[Lane, float] = {}
    runs = _runs(profile, usable_kv)
    for lane in ("short", "long"):
        members = [j for j in jobs if j.lane == lane and runs(j)]
        if not members or span <= 0:
            work[lane] = 0.0
            continue
        sample = members if len(members) <= sample_size else rng.sample(members, sample_size)
        lengths = [(j.prompt, j.output, j.max_tokens) for j in sample]
        n = max(len(lengths), 4 * profile.max_num_seqs)
        mu = reserved_capacity(profile, lengths, usable_kv, n)
        work[lane] = len(members) / mu / span
    return work


def phase_work(
    profile: EngineProfile,
    jobs: Sequence[Job],
    rng: random.Random,
    usable_kv: int,
    sample_size: int = 4096,
) -> tuple[float, float]:
    """(W(prefill), W(decode)): engines kept busy by each phase on average."""
    span = jobs[-1].arrival_s - jobs[0].arrival_s if jobs else 0.0
    members = list(filter(_runs(profile, usable_kv), jobs))
    if not members or span <= 0:
        return 0.0, 0.0
    sample = members if len(members) <= sample_size else rng.sample(members, sample_size)
    n = max(len(sample), 4 * profile.max_num_seqs)
    prefill = reserved_capacity(profile, [(j.prompt, 1, 1) for j in sample], usable_kv, n)
    decode = reserved_capacity(profile, [(j.prompt, j.output, j.max_tokens) for j in sample],
                               usable_kv, n, cached=True)
    return len(members) / prefill / span, len(members) / decode / span


def split_roles(workers: int, work: tuple[float, float]) -> list[Role]:
    """Role of each worker for ``pd``: prefill workers first, then decode (module doc)."""
    if workers < 2:
        raise ValueError("prefill and decode apart need at least 2 workers")
    prefill_work, decode_work = work

    def hottest(n_decode: int) -> float:  # the busier side's utilization
        return max(prefill_work / (workers - n_decode), decode_work / n_decode)

    n_decode = min(range(1, workers), key=hottest)  # ties: the fewest decode workers
    prefill: list[Role] = ["prefill"]
    decode: list[Role] = ["decode"]
    return prefill * (workers - n_decode) + decode * n_decode


def split_pools(
    workers: int, work: dict[Lane, float], mode: PoolMode = "latency", utilization: float = 0.9
) -> list[Pool]:
    """Pool of each worker: dedicated short workers first, then long, then ``any``."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if not 0 < utilization <= 1:
        raise ValueError("utilization must be in (0, 1]")
    short, long_ = work.get("short", 0.0), work.get("long", 0.0)
    if mode in ("any", "pd") or workers == 1 or short + long_ <= 0:
        return ["any"] * workers
    if short <= 0 or long_ <= 0:  # one lane only: every worker takes it
        return ["short" if short > 0 else "long"] * workers
    n_short, n_long = _counts(workers, short, long_, mode, utilization)
    n_short = min(max(n_short, 1), workers - 1)
    n_long = min(max(n_long, 1), workers - n_short)
    shared = workers - n_short - n_long
    short_pool: list[Pool] = ["short"]
    long_pool: list[Pool] = ["long"]
    any_pool: list[Pool] = ["any"]
    return short_pool * n_short + long_pool * n_long + any_pool * shared


def _counts(
    workers: int, short: float, long_: float, mode: PoolMode, utilization: float
) -> tuple[int, int]:
    """(dedicated short, dedicated long) workers before clamping; see the module doc."""
    exact = workers * short / (short + long_)
    if mode == "hybrid":
        return math.floor(exact), math.floor(workers - exact)
    if mode == "latency":
        n_long = max(1, math.ceil(long_ / utilization - 1e-9))
        if workers - n_long >= 1 and short / (workers - n_long) <= utilization:
            return workers - n_long, n_long
    n_short = math.floor(exact + 0.5)  # proportional (and latency's fallback)
    return n_short, workers - n_short
