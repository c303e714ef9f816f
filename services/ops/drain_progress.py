"""How a drain is going, from the heartbeats of the drained worker (pure; ``now`` passed in).

The worker drives its own drain (docs/live-system.md, "Control"): on ``DrainWorker`` it
stops taking work, finishes what is in flight, heartbeats ``draining=true`` and exits 0
after a last heartbeat with nothing running. :class:`DrainProgress` follows that from the
outside. Phases:

- ``requested``: the command is sent; no draining heartbeat yet;
- ``draining``: a heartbeat of the drained process said ``draining``;
- ``stopped``: the process is gone — a tombstone, a heartbeat of a *newer* process under
  the same worker id (the drained one exited and was restarted), or no fresh heartbeat
  (:func:`services.health.core.is_fresh`).

A newer process is one whose ``started_at`` is at least :data:`SAME_PROCESS_S` later. A
worker that fences itself (``services.worker.app``) goes on in the same process as a new
incarnation whose ``started_at`` is 1 ms later per fence, and keeps draining: its beats
are still the drained process's. A restarted process starts after the drained one exited,
i.e. later by that process's whole life (it was beating before the drain was asked for)
plus the restart, far more than a few fences' milliseconds.

Outcome once stopped: ``drained`` when the last heartbeat of the drained process had
nothing running or waiting and said draining (or a tombstone followed it); otherwise
``lost`` — it stopped with work in flight, or never acknowledged the drain. Fail closed:
a worker that merely went quiet is never reported as drained unless its last word was
"draining, nothing in flight".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schemas.workers import WorkerHeartbeat
from services.health.core import HealthPolicy, is_fresh

DrainPhase = Literal["requested", "draining", "stopped"]

#: A heartbeat whose ``started_at`` is less than this much later than the drained
#: process's is that process, fenced meanwhile (module docstring).
SAME_PROCESS_S = 1.0


@dataclass(frozen=True, slots=True)
class DrainUpdate:
    """A progress report: phase and the work still in flight (last heartbeat)."""

    worker_id: str
    phase: DrainPhase
    running: int
    waiting: int
    #: Seconds since the last heartbeat of the drained process.
    age_s: float

    def describe(self) -> str:
        what = {"requested": "drain requested, waiting for the worker to acknowledge",
                "draining": "draining", "stopped": "stopped"}[self.phase]
        return (f"{self.worker_id}: {what}; {self.running} running, {self.waiting} waiting "
                f"(last heartbeat {self.age_s:.1f}s ago)")


class DrainProgress:
    """Follows one worker process from the drain command to its exit (module docstring)."""

    def __init__(self, first: WorkerHeartbeat, policy: HealthPolicy | None = None) -> None:
        self.worker_id = first.worker_id
        self.policy = policy or HealthPolicy()
        self.last = first
        self.saw_draining = first.draining
        self.tombstoned = False
        self.replaced = False
        self._incarnation = first.started_at

    def observe(self, hb: WorkerHeartbeat) -> None:
        """A heartbeat of the worker (others and older ones are ignored)."""
        if hb.worker_id != self.worker_id:
            return
        if hb.started_at - self._incarnation >= SAME_PROCESS_S:
            # A new process under the same id: the drained one has exited.
            self.replaced = True
            return
        if (hb.started_at, hb.seq) < (self.last.started_at, self.last.seq):
            return
        self.last = hb
        self.saw_draining = self.saw_draining or hb.draining
        # A beat after a tombstone (same process) means it was not gone after all.
        self.tombstoned = False

    def observe_tombstone(self) -> None:
        self.tombstoned = True

    def stopped(self, now: float) -> bool:
        return self.tombstoned or self.replaced or not is_fresh(self.last, now, self.policy)

    def phase(self, now: float) -> DrainPhase:
        if self.stopped(now):
            return "stopped"
        return "draining" if self.saw_draining else "requested"

    def outcome(self, now: float) -> Literal["drained", "lost"] | None:
        """None while the process runs; then whether it drained cleanly."""
        if not self.stopped(now):
            return None
        hb = self.last
        idle = hb.running == 0 and hb.waiting == 0
        return "drained" if idle and (hb.draining or self.tombstoned) else "lost"

    def update(self, now: float) -> DrainUpdate:
        return DrainUpdate(self.worker_id, self.phase(now), self.last.running,
                           self.last.waiting, round(now - self.last.ts, 3))
