"""Builders for the scheduler's values: sensible defaults, override what the test is about.

Times are around ``NOW`` (seconds); a default worker is fresh, idle, in pool ``any`` with
100,000 usable-before-margin KV tokens and 256 sequence slots; a default request is a
normal-priority short-lane request for the same model, reserving 1,024 KV tokens.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from typing import Any

from schemas.common import Lane, Pool, Priority, Role
from services.scheduler import (
    DEFAULT_STALE_AFTER_S,
    PendingQueue,
    QueueConfig,
    QueuedRequest,
    Snapshot,
    WorkerState,
)

NOW = 1_000.0
MODEL = "llama-3.1-8b"

_ids = itertools.count()


def make_worker(
    worker_id: str = "w0",
    *,
    model: str = MODEL,
    model_version: str | None = "v1",
    pool: Pool = "any",
    partition: int = 0,
    kv_total_tokens: int = 100_000,
    kv_free_tokens: int | None = None,
    block_size: int = 16,
    running: int = 0,
    waiting: int = 0,
    max_num_seqs: int = 256,
    draining: bool = False,
    heartbeat_ts: float = NOW,
    tokens_per_s: float = 1_000.0,
    role: Role = "mixed",
    engine: str | None = None,
) -> WorkerState:
    return WorkerState(
        worker_id=worker_id,
        model=model,
        model_version=model_version,
        pool=pool,
        partition=partition,
        kv_total_tokens=kv_total_tokens,
        kv_free_tokens=kv_total_tokens if kv_free_tokens is None else kv_free_tokens,
        block_size=block_size,
        running=running,
        waiting=waiting,
        max_num_seqs=max_num_seqs,
        draining=draining,
        heartbeat_ts=heartbeat_ts,
        tokens_per_s=tokens_per_s,
        role=role,
        engine=engine,
    )


def make_request(
    request_id: str | None = None,
    *,
    tenant: str = "acme",
    model: str = MODEL,
    model_version: str | None = None,
    priority: Priority = "normal",
    lane: Lane = "short",
    prompt_tokens: int = 512,
    max_tokens: int = 512,
    kv_tokens: int = 1_024,
    enqueued_at: float = NOW,
    deadline: float | None = None,
    attempt: int = 0,
    prefix_hash: str | None = None,
) -> QueuedRequest:
    return QueuedRequest(
        request_id=f"r{next(_ids)}" if request_id is None else request_id,
        tenant=tenant,
        model=model,
        model_version=model_version,
        priority=priority,
        lane=lane,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        kv_tokens=kv_tokens,
        enqueued_at=enqueued_at,
        deadline=deadline,
        attempt=attempt,
        prefix_hash=prefix_hash,
    )


def make_snapshot(
    workers: Iterable[WorkerState] = (),
    *,
    now: float = NOW,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> Snapshot:
    return Snapshot.of(workers, now, stale_after_s)


def make_queue(*requests: QueuedRequest, **config: Any) -> PendingQueue:
    """A queue holding ``requests``; keyword arguments go to :class:`QueueConfig`."""
    queue = PendingQueue(QueueConfig(**config))
    for request in requests:
        assert queue.push(request)
    return queue


def seeded(seed: int = 7) -> random.Random:
    return random.Random(seed)
