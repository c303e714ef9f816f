"""Restart safety and backpressure of the scheduler process (real broker, real subprocess).

- kill -9 with requests pending and some assigned, restart: every accepted request gets
  exactly one assignment (no loss, no second assignment of the same attempt), and the
  restored reservations keep the worker's KV from being overcommitted;
- a bounded pending queue pauses the request topics, and resuming them loses nothing.

Harness (real scheduler process, FAKE workers, observer): ``test_scheduler_service``.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import pytest

from tests.integration.test_scheduler_service import Cluster, cluster, eventually

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(90)]

__all__ = ["cluster"]  # the fixture, shared with test_scheduler_service


def assignment_counts(c: Cluster) -> Counter[tuple[str, int]]:
    return Counter((a.request_id, a.attempt) for _, a in c.observer.assignments)


async def test_kill_9_and_restart_lose_nothing_and_assign_nothing_twice(cluster: Cluster) -> None:
    await cluster.start()
    # Usable KV 3,800: three 1,024-token requests at a time.
    worker = await cluster.worker("fake-a", 1, kv_total_tokens=4_000)
    ids = [f"r{i}" for i in range(10)]
    for rid in ids:
        await cluster.admit(rid, prompt_tokens=1_000, max_tokens=24)
    obs = cluster.observer
    await eventually(lambda: len(worker.held) == 3, what="three running")
    await asyncio.sleep(0.3)  # the rest are pending in the scheduler, unacked

    assert cluster.scheduler.kill(signal.SIGKILL) == -signal.SIGKILL
    # While the scheduler is down one request finishes: the restart must see the release.
    await worker.finish(worker.holding()[0])
    cluster.scheduler.start()
    await cluster.scheduler.wait_ready()

    # The group takes over the dead member's partitions (session timeout), then the
    # freed slot is filled, and only it: two reservations were restored, not forgotten.
    await eventually(lambda: len(worker.held) == 3, timeout_s=30, what="slot refilled")
    await asyncio.sleep(0.5)
    assert len(worker.taken) == 4, [a.request_id for a in worker.taken]

    worker.hold, worker.run_s = False, 0.05
    for rid in worker.holding():
        await worker.finish(rid)
    await eventually(lambda: all(obs.assigned(r) for r in ids) and not worker.held,
                     timeout_s=20, what="every request assigned and finished")
    counts = assignment_counts(cluster)
    assert sorted(counts) == sorted((rid, 1) for rid in ids), counts
    assert set(counts.values()) == {1}, counts
    assert not worker.violations, worker.violations
    assert not obs.errors("r0") and not any(obs.errors(r) for r in ids)


async def test_a_full_queue_pauses_topics_and_resuming_loses_nothing(cluster: Cluster) -> None:
    await cluster.start(LLMQ_SCHEDULER_MAX_PENDING="10")
    obs = cluster.observer
    ids = [f"r{i}" for i in range(60)]
    for wave in range(6):  # no worker yet: everything waits
        for rid in ids[wave * 10 : (wave + 1) * 10]:
            await cluster.admit(rid, priority="low", lane="short")
        await asyncio.sleep(0.3)
    await asyncio.sleep(1.5)
    pending = [s.pending_requests for s in obs.statuses if s.model]
    assert pending, "no QueueStatus published"
    # Bounded: at most the bound plus what was fetched before the pause took effect.
    assert max(pending) <= 20, pending

    await cluster.worker("fake-a", 0, hold=False, run_s=0.02)
    await eventually(lambda: all(obs.assigned(r) for r in ids), timeout_s=30,
                     what="every request assigned after resuming")
    counts = assignment_counts(cluster)
    assert set(counts.values()) == {1} and len(counts) == len(ids), counts
