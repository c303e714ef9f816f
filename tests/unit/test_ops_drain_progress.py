"""Drain progress: phases and outcome from the drained worker's heartbeats (pure)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from schemas.workers import WorkerHeartbeat
from services.health.core import HealthPolicy
from services.health.fleet import FleetTracker
from services.ops.drain import _follow
from services.ops.drain_progress import DrainProgress
from services.worker.app import INCARNATION_STEP_S
from tests.fakes.heartbeat_worker import heartbeat

T0 = 1_000_000.0
STARTED = T0 - 600.0
#: The drained process after a fence: the same process, as a new incarnation.
FENCED = STARTED + INCARNATION_STEP_S


def hb(seq: int, at: float, **changes: Any) -> WorkerHeartbeat:
    fields: dict[str, Any] = {"started_at": STARTED, "seq": seq, "ts": at, "interval_s": 1.0,
                              "running": 3, "waiting": 0}
    fields.update(changes)
    return heartbeat("w1", **fields)


def follow(*beats: WorkerHeartbeat, tombstone: bool = False) -> DrainProgress:
    progress = DrainProgress(hb(0, T0), HealthPolicy())
    for beat in beats:
        progress.observe(beat)
    if tombstone:
        progress.observe_tombstone()
    return progress


@pytest.mark.parametrize(
    ("progress", "now", "phase", "outcome"),
    [
        # just requested: still beating, not yet draining
        (follow(), T0 + 1, "requested", None),
        (follow(hb(1, T0 + 1, draining=True, running=2)), T0 + 1.5, "draining", None),
        # drained: last word "draining, nothing in flight", then silence
        (follow(hb(1, T0 + 1, draining=True, running=0)), T0 + 2, "draining", None),
        (follow(hb(1, T0 + 1, draining=True, running=0)), T0 + 4.5, "stopped", "drained"),
        # silent with work in flight: lost (fail closed)
        (follow(hb(1, T0 + 1, draining=True, running=2)), T0 + 5, "stopped", "lost"),
        # never acknowledged the drain and went quiet: lost
        (follow(hb(1, T0 + 1, running=0)), T0 + 5, "stopped", "lost"),
        # draining, nothing running, but requests still waiting: not drained
        (follow(hb(1, T0 + 1, draining=True, running=0, waiting=2)), T0 + 5, "stopped",
         "lost"),
        # tombstone after an idle beat: drained
        (follow(hb(1, T0 + 1, draining=True, running=0), tombstone=True), T0 + 1, "stopped",
         "drained"),
        (follow(hb(1, T0 + 1, running=2), tombstone=True), T0 + 1, "stopped", "lost"),
        # restarted under the same id after draining: the drained process is gone
        (follow(hb(1, T0 + 1, draining=True, running=0),
                hb(0, T0 + 2, started_at=T0 + 1.5, running=0)), T0 + 2, "stopped", "drained"),
        # fenced mid-drain: the same process goes on draining, it is not a restart
        (follow(hb(1, T0 + 1, draining=True, running=2),
                hb(2, T0 + 2, started_at=FENCED, draining=True, running=0)), T0 + 2,
         "draining", None),
        (follow(hb(1, T0 + 1, draining=True, running=0),
                hb(2, T0 + 2, started_at=FENCED, draining=True, running=0)), T0 + 2,
         "draining", None),
        (follow(hb(1, T0 + 1, draining=True, running=2),
                hb(2, T0 + 2, started_at=FENCED, draining=True, running=1)), T0 + 6,
         "stopped", "lost"),
        (follow(hb(1, T0 + 1, draining=True, running=2),
                hb(2, T0 + 2, started_at=FENCED, draining=True, running=0)), T0 + 6,
         "stopped", "drained"),
        # an older, out-of-order beat changes nothing
        (follow(hb(2, T0 + 1, draining=True, running=0), hb(1, T0 + 0.5, running=3)),
         T0 + 4.5, "stopped", "drained"),
    ],
)
def test_progress(progress: DrainProgress, now: float, phase: str,
                  outcome: str | None) -> None:
    assert progress.phase(now) == phase
    assert progress.outcome(now) == outcome


def test_many_fences_stay_the_same_process() -> None:
    progress = follow(hb(1, T0 + 1, draining=True, running=2),
                      hb(2, T0 + 2, started_at=STARTED + 100 * INCARNATION_STEP_S,
                         draining=True, running=1))
    assert (progress.phase(T0 + 2), progress.update(T0 + 2).running) == ("draining", 1)


def test_other_workers_are_ignored() -> None:
    progress = follow()
    progress.observe(heartbeat("w2", started_at=STARTED, seq=9, ts=T0, draining=True))
    assert progress.phase(T0) == "requested"


def test_update_reports_in_flight_work() -> None:
    progress = follow(hb(1, T0 + 1, draining=True, running=2, waiting=1))
    update = progress.update(T0 + 1.5)
    assert (update.phase, update.running, update.waiting, update.age_s) == (
        "draining", 2, 1, 0.5)
    assert "draining; 2 running, 1 waiting" in update.describe()


async def test_following_sees_the_last_beat_even_when_its_successor_shares_the_poll() -> None:
    # The drained process's last beat (draining, nothing in flight) and its restarted
    # successor's first beat arrive in one poll; the tracker keeps only the newest, but
    # the follower sees both, so the drain is clean, not lost.
    now = time.time()
    first = heartbeat("w1", started_at=now - 600, seq=10, ts=now - 0.5, running=3, waiting=0)
    tracker = FleetTracker()
    tracker.observe_heartbeat(first)

    class Feed:  # stand-in for the heartbeats topic: one poll, both records
        polls = 0

        async def poll(self, timeout_ms: int = 200) -> int:
            self.polls += 1
            if self.polls == 1:
                tracker.observe_heartbeat(heartbeat(
                    "w1", started_at=now - 600, seq=11, ts=now, draining=True, running=0,
                    waiting=0))
                tracker.observe_heartbeat(heartbeat(
                    "w1", started_at=now + 0.1, seq=0, ts=now + 0.2, running=0, waiting=0))
                return 2
            await asyncio.sleep(0.01)
            return 0

    result = await _follow(Feed(), tracker, DrainProgress(first, HealthPolicy()),  # type: ignore[arg-type]
                           time.monotonic(), 5.0, None, time.time)
    assert (result.outcome, result.ok) == ("drained", True)
