"""Two scheduler replicas in one consumer group (real broker, real subprocesses).

The group splits the request partitions between them; each reads every assignment, event
and control command (the log reader). What must hold with two as with one:

- every admitted request is placed once per attempt and ends once, whichever replica
  read it;
- a cancel reaches the replica that holds the request pending (every replica reads every
  cancel), and the request gets exactly one ``cancelled``;
- a replica that leaves mid-burst (SIGTERM: a graceful leave, so a rebalance) hands its
  partitions to the other; nothing is lost and nothing is placed twice;
- a burst placed by both at once never overcommits a worker's KV: each worker takes new
  work from one replica at a time (filter ``replica-turn``), the turns numbered from the
  group's members. Replicas told they are alone (``LLMQ_SCHEDULER_REPLICAS=1``) do
  overcommit; they say so in their log.

Harness (real scheduler processes, FAKE workers, observer): ``test_scheduler_service``.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from schemas.common import Priority
from schemas.status import QueueStatus
from tests.integration.test_scheduler_service import (
    Cluster,
    FakeWorker,
    SchedulerProcess,
    cluster,
    eventually,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(150)]

__all__ = ["cluster"]  # the fixture, shared with test_scheduler_service

PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")


@pytest.fixture
async def second(cluster: Cluster) -> AsyncIterator[SchedulerProcess]:
    """Another replica of the cluster's scheduler: same prefix (same group), its own id."""
    other = SchedulerProcess(cluster.prefix, cluster.tmp / "scheduler-2.log",
                             env={"LLMQ_SCHEDULER_SCHEDULER_ID": "sched-test-2"})
    yield other
    other.kill(signal.SIGTERM)


async def both_running(cluster: Cluster, second: SchedulerProcess,
                       told: int | None = None) -> None:
    """The cluster's scheduler and ``second``: finding each other in their consumer group
    (the default), or ``told`` how many replicas run (LLMQ_SCHEDULER_REPLICAS)."""
    told_env = {} if told is None else {"LLMQ_SCHEDULER_REPLICAS": str(told)}
    # Two schedulers starting on two cores can starve this process (the fake workers'
    # heartbeats) for over 3 × 0.4 s: a worker declared dead by mistake requeues its work,
    # which these tests do not look at. 10 intervals (4 s) keeps them about replicas.
    await cluster.start(LLMQ_SCHEDULER_HEARTBEAT_STALENESS="10", **told_env)
    second.env.update(cluster.scheduler.env)
    second.env["LLMQ_SCHEDULER_SCHEDULER_ID"] = "sched-test-2"
    if told is not None:
        second.env["LLMQ_SCHEDULER_REPLICA_INDEX"] = str(min(1, told - 1))
    second.start()
    await second.wait_ready()
    # The group has rebalanced: the second one was given its share of the partitions.
    await eventually(lambda: "Executing _on_partitions_assigned" in second.tail(400),
                     what="the second replica assigned partitions")
    if told is None:  # each took its turn from the group's members
        for replica in (cluster.scheduler, second):
            await eventually(lambda r=replica: "2 replica(s) in group" in r.tail(400),
                             what="both replicas placing in turns")


def counts(c: Cluster) -> Counter[tuple[str, int]]:
    return Counter((a.request_id, a.attempt) for _, a in c.observer.assignments)


async def each_done_once(c: Cluster, ids: list[str], workers: list[FakeWorker],
                         timeout_s: float = 60) -> None:
    """Every request done, placed once (attempt 1), no worker given a duplicate, no
    error reply."""
    obs = c.observer
    await eventually(lambda: sum(1 for e in obs.events if e.kind == "event.done") >= len(ids),
                     timeout_s=timeout_s, what="every request done")
    assert sorted(counts(c)) == sorted((rid, 1) for rid in ids)
    assert set(counts(c).values()) == {1}
    assert [v for w in workers for v in w.violations if v.startswith("duplicate")] == []
    assert not any(obs.errors(rid) for rid in ids)


async def test_two_replicas_place_every_request_once(
        cluster: Cluster, second: SchedulerProcess) -> None:
    await both_running(cluster, second)
    workers = [await cluster.worker(f"fake-{i}", i, hold=False, run_s=0.05) for i in range(2)]
    ids = [f"r{i}" for i in range(60)]
    for i, rid in enumerate(ids):
        await cluster.admit(rid, priority=PRIORITIES[i % 3], prompt_tokens=200, max_tokens=8)
    await each_done_once(cluster, ids, workers)
    assert cluster.scheduler.alive() and second.alive()


async def test_a_cancel_reaches_the_replica_holding_the_request(
        cluster: Cluster, second: SchedulerProcess) -> None:
    await both_running(cluster, second)
    ids = [f"c{i}" for i in range(12)]
    for rid in ids:  # no worker: every one waits in one replica or the other
        await cluster.admit(rid, timeout_s=120)
    obs = cluster.observer
    await eventually(lambda: sum(s.pending_requests for s in _latest(cluster)) == len(ids),
                     what="all twelve pending across both replicas")
    assert all(s.pending_requests for s in _latest(cluster)), "one replica held them all"
    for rid in ids:
        await cluster.cancel(rid)
    await eventually(lambda: all(obs.errors(rid) for rid in ids), what="every cancel answered")
    await asyncio.sleep(1.0)  # a second answer, if any, would have come by now
    for rid in ids:
        assert [e.code for e in obs.errors(rid)] == ["cancelled"], rid
        assert len(obs.terminal_events(rid)) == 1, rid


async def test_a_replica_leaving_mid_burst_hands_its_work_over(
        cluster: Cluster, second: SchedulerProcess) -> None:
    await both_running(cluster, second)
    workers = [await cluster.worker(f"fake-{i}", i, hold=False, run_s=0.2,
                                    kv_total_tokens=6_000) for i in range(2)]
    ids = [f"m{i}" for i in range(80)]
    for rid in ids[:40]:
        await cluster.admit(rid, prompt_tokens=800, max_tokens=16)
    obs = cluster.observer
    await eventually(lambda: len(obs.assignments) >= 10, what="work under way")
    # Leaves the group: a rebalance. A graceful stop may take up to its bounded waits (the
    # flush at the revoke, the reply-topic checks, the final flush: 10 s each by default).
    assert second.kill(signal.SIGTERM, timeout_s=45) == 0
    for rid in ids[40:]:
        await cluster.admit(rid, prompt_tokens=800, max_tokens=16)
    await each_done_once(cluster, ids, workers, timeout_s=90)


async def test_a_burst_on_two_replicas_never_overcommits_a_worker(
        cluster: Cluster, second: SchedulerProcess) -> None:
    await both_running(cluster, second)
    # Usable KV 3,800: three 1,024-token requests at a time on each worker.
    workers = [await cluster.worker(f"fake-{i}", i, hold=False, run_s=0.3,
                                    kv_total_tokens=4_000) for i in range(2)]
    ids = [f"k{i}" for i in range(60)]
    await asyncio.gather(*(cluster.admit(rid, prompt_tokens=1_000, max_tokens=24)
                           for rid in ids))
    await each_done_once(cluster, ids, workers, timeout_s=90)
    # Before the turns, 25 of these 60 placements went past a worker's usable KV.
    assert [v for w in workers for v in w.violations] == []


async def test_replicas_told_they_are_alone_say_so(
        cluster: Cluster, second: SchedulerProcess) -> None:
    await both_running(cluster, second, told=1)
    await cluster.worker("fake-a", 0, hold=False, run_s=0.05)
    ids = [f"w{i}" for i in range(20)]
    for rid in ids:
        await cluster.admit(rid)
    obs = cluster.observer
    await eventually(lambda: all(obs.assigned(rid) for rid in ids), what="all placed")
    warning = "while this one places alone"
    await eventually(lambda: warning in cluster.scheduler.tail(400) + second.tail(400),
                     what="the warning")


def _latest(c: Cluster) -> list[QueueStatus]:
    """The newest QueueStatus of each replica."""
    newest: dict[str, QueueStatus] = {}
    for status in c.observer.statuses:
        newest[status.scheduler_id] = status
    return list(newest.values())
