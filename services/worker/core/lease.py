"""The worker's lease on the work it was given: may it still answer it?

The scheduler declares a worker dead once its newest heartbeat is older than ``staleness``
intervals (DESIGN.md: 3) and requeues that worker's work or ends it ``worker_lost``. A
worker process that was paused (SIGSTOP, a VM freeze, a stop-the-world pause) or cut off
from the broker for that long, but for less than its group session timeout, still holds its
slot when it comes back; finishing its runs then answers requests a second time.

So a worker answers only under a lease. The lease runs for ``limit_s`` (a little under the
scheduler's bound) from the creation of the newest heartbeat the broker acknowledged.
:meth:`Lease.valid` is checked before every record a run sends, and again when each
heartbeat is acknowledged (a beat that became visible only after the previous one went
stale leaves a gap in which the scheduler may have given the work away). Once the lease
has lapsed, the worker is *fenced* (``services.worker.app``): its runs end unanswered, and
the process carries on as a new incarnation of itself, announced by a heartbeat with a newer
``started_at``. The scheduler treats that as a restart and requeues or ends whatever the
earlier incarnation still held, if staleness had not made it do so already.

Times are monotonic seconds, passed in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Lease:
    """The newest acknowledged heartbeat's creation time and how long it vouches for us."""

    limit_s: float
    beat_at: float  # when the newest acknowledged heartbeat (or the incarnation) began

    def __post_init__(self) -> None:
        if self.limit_s <= 0:
            raise ValueError(f"limit_s must be > 0, got {self.limit_s}")

    def valid(self, now: float) -> bool:
        """True while the scheduler cannot yet have declared this worker dead."""
        return now - self.beat_at <= self.limit_s

    def renewed(self, beat_at: float, acked_at: float) -> bool:
        """A heartbeat created at ``beat_at`` was acknowledged at ``acked_at``.

        False: the lease had lapsed before it was (the caller fences). A beat older than
        the newest one (acknowledged out of order, or from before a fence) moves nothing.
        """
        ok = self.valid(acked_at)
        self.beat_at = max(self.beat_at, beat_at)
        return ok

    def restart(self, now: float) -> None:
        """A new incarnation: nothing was given to it yet, so its lease starts now."""
        self.beat_at = now
