"""Micro-benchmark of one placement decision (``llmq bench decide``).

Builds a fleet of ``workers`` (one model; pools 50 % any, 25 % short, 25 % long; mixed KV
sizes and loads) and a pending queue of ``pending`` requests over all six classes, fills
the ledger to a steady state, then times ``schedule(..., max_placements=1)`` — one whole
scheduling call that ends in one placement, snapshot reused as between two heartbeat
batches. Between timed calls (untimed) the oldest placement is released and a fresh request
is pushed, so fleet load and queue length stay constant. Pure and deterministic for a seed
apart from the timings themselves.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections import deque
from typing import Final

from schemas.common import LANES, PRIORITIES, Pool
from services.scheduler.core.cycle import schedule
from services.scheduler.core.ledger import Ledger
from services.scheduler.core.queue import PendingQueue, QueueConfig
from services.scheduler.core.types import Placement, QueuedRequest, Snapshot, WorkerState
from services.scheduler.policies.profile import DEFAULT_PROFILE, build_pipeline

MODEL: Final = "llama-3.1-8b"
_POOLS: Final[tuple[Pool, ...]] = ("any", "any", "short", "long")
_NOW: Final = 10_000.0


def bench_decide(
    workers: int = 1000,
    pending: int = 10_000,
    seed: int = 1,
    repeats: int = 2000,
    warmup: int = 200,
) -> dict[str, float | int | str]:
    """Time one placement per ``schedule()`` call; returns microsecond percentiles."""
    if workers < 1 or pending < 1 or repeats < 1 or warmup < 0:
        raise ValueError("workers, pending and repeats must be >= 1, warmup >= 0")
    rng = random.Random(seed)
    snapshot = Snapshot.of((_worker(i, rng) for i in range(workers)), _NOW)
    ledger = Ledger()
    queue = PendingQueue(QueueConfig(max_pending=pending + 1))
    pipeline = build_pipeline(DEFAULT_PROFILE)
    ids = itertools.count()
    for _ in range(pending):
        queue.push(_request(next(ids), rng))
    live: deque[Placement] = deque()
    backlog = max(1, workers * 4)  # placements kept running: the fleet is busy, not empty
    samples: list[int] = []
    for round_ in range(warmup + repeats):
        start = time.perf_counter_ns()
        decisions = schedule(snapshot, queue, ledger, pipeline, _NOW, rng, max_placements=1)
        elapsed = time.perf_counter_ns() - start
        placed = [d for d in decisions if isinstance(d, Placement)]
        if placed and round_ >= warmup:
            samples.append(elapsed)
        live.extend(placed)
        while len(live) > backlog or (live and not placed):
            done = live.popleft()
            ledger.release(done.request.request_id, done.attempt)
        while len(queue) < pending:
            queue.push(_request(next(ids), rng))
    samples.sort()
    micro = [s / 1000.0 for s in samples] or [0.0]
    return {
        "workers": workers,
        "pending": pending,
        "repeats": len(samples),
        "profile": "default",
        "placement_p50_us": round(statistics.median(micro), 2),
        "placement_p99_us": round(micro[min(len(micro) - 1, int(0.99 * len(micro)))], 2),
        "placement_mean_us": round(statistics.fmean(micro), 2),
    }


def _worker(i: int, rng: random.Random) -> WorkerState:
    total = rng.choice((120_000, 240_000, 480_000))
    return WorkerState(
        worker_id=f"w{i:05d}",
        model=MODEL,
        model_version="v1",
        pool=_POOLS[i % len(_POOLS)],
        partition=i,
        kv_total_tokens=total,
        kv_free_tokens=total,
        block_size=16,
        running=0,
        waiting=0,
        max_num_seqs=256,
        draining=False,
        heartbeat_ts=_NOW - rng.random(),
        tokens_per_s=rng.uniform(500.0, 3000.0),
    )


def _request(n: int, rng: random.Random) -> QueuedRequest:
    lane = LANES[0] if rng.random() < 0.75 else LANES[1]
    prompt = rng.randint(50, 1500) if lane == "short" else rng.randint(2000, 16_000)
    out = rng.randint(16, 512)
    return QueuedRequest(
        request_id=f"r{n}",
        tenant=f"t{n % 7}",
        model=MODEL,
        model_version=None,
        priority=rng.choice(PRIORITIES),
        lane=lane,
        prompt_tokens=prompt,
        max_tokens=out,
        kv_tokens=-(-(prompt + out) // 16) * 16,
        enqueued_at=_NOW - rng.uniform(0.0, 120.0),
        prefix_hash=f"p{rng.randrange(500)}" if rng.random() < 0.5 else None,
    )
