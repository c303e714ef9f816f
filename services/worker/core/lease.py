"""The worker's lease on the work it was given: may it still answer it?

The scheduler declares a worker dead once its newest heartbeat is older than ``staleness``
intervals (DESIGN.md: 3) and requeues that worker's work or ends it ``worker_lost``. A
worker process that was paused (SIGSTOP, a VM freeze, a stop-the-world pause) or cut off
from the broker for that long, but for less than its group session timeout, still holds its
slot when it comes back; finishing its runs then answers requests a second time.

So a worker answers only under a lease. The lease runs for ``limit_s`` (a little under the
scheduler's bound) from the creation of the newest heartbeat the broker acknowledged.
:meth:`Lease.check` is called before every record a run sends, when each heartbeat is
acknowledged (a beat that became visible only after the previous one went stale leaves a
gap in which the scheduler may have given the work away), and by a watch task.

Once the lease has lapsed, the worker does not know whether the scheduler noticed: a pause
a little longer than the lease may still be shorter than the scheduler's bound. So it
**asks** (for up to ``ask_s``): its runs hold their records, and its heartbeats carry
``renew``. The scheduler, which alone decides losses, answers with a ``LeaseAnswer``:

- **granted** (it had not declared this incarnation dead; having read a fresh heartbeat, it
  will not for the gap): :meth:`Lease.granted` renews the lease from that heartbeat's
  creation, and the runs send what they held;
- **not granted**, or **no answer** within ``ask_s`` (an older scheduler, or none
  running): the worker is *fenced* (``services.worker.app``): its runs end unanswered,
  and the process carries on as a new incarnation of itself, announced by a heartbeat with
  a newer ``started_at``. The scheduler treats that as a restart and requeues or ends
  whatever the earlier incarnation still held, if staleness had not made it do so already.

``ask_s = 0`` fences at once, without asking. Times are monotonic seconds, passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: ``valid``: answer. ``ask``: the lease has just lapsed; send a renewing heartbeat now.
#: ``asking``: a renewal is asked; hold records. ``fence``: end the runs unanswered.
Verdict = Literal["valid", "ask", "asking", "fence"]


@dataclass(slots=True)
class Lease:
    """The newest acknowledged (or granted) heartbeat's creation time, how long it vouches
    for us, and whether a renewal is being asked."""

    limit_s: float
    beat_at: float  # when the newest acknowledged heartbeat (or the incarnation) began
    ask_s: float = 0.0
    asking_since: float | None = None

    def __post_init__(self) -> None:
        if self.limit_s <= 0:
            raise ValueError(f"limit_s must be > 0, got {self.limit_s}")
        if self.ask_s < 0:
            raise ValueError(f"ask_s must be >= 0, got {self.ask_s}")

    @property
    def asking(self) -> bool:
        return self.asking_since is not None

    def valid(self, now: float) -> bool:
        """True while the scheduler cannot yet have declared this worker dead."""
        return self.asking_since is None and now - self.beat_at <= self.limit_s

    def check(self, now: float) -> Verdict:
        """The lease at ``now``; a lapse starts the asking (or fences, with ``ask_s`` 0)."""
        if self.asking_since is not None:
            return "fence" if now - self.asking_since > self.ask_s else "asking"
        if now - self.beat_at <= self.limit_s:
            return "valid"
        return self._lapse(now)

    def acked(self, beat_at: float, acked_at: float) -> Verdict:
        """A heartbeat created at ``beat_at`` was acknowledged at ``acked_at``.

        While asking, an ack proves nothing (the scheduler may have decided in the gap):
        only :meth:`granted` ends it. Otherwise the lease moves to the beat, unless it had
        lapsed before the ack (then the asking starts). A beat older than the newest one
        (acknowledged out of order, or from before a fence) moves nothing.
        """
        if self.asking_since is not None:
            return self.check(acked_at)
        if acked_at - self.beat_at > self.limit_s:
            return self._lapse(acked_at)
        self.beat_at = max(self.beat_at, beat_at)
        return "valid"

    def granted(self, beat_at: float, now: float) -> bool:
        """The scheduler granted the renewing heartbeat created at ``beat_at``. True when
        that renews the lease; False when it came too late to (the asking goes on) or when
        nothing was asked."""
        if self.asking_since is None:
            return False
        if now - beat_at > self.limit_s:
            return False  # the granted beat is itself stale by now: ask with a newer one
        self.beat_at = max(self.beat_at, beat_at)
        self.asking_since = None
        return True

    def restart(self, now: float) -> None:
        """A new incarnation: nothing was given to it yet, so its lease starts now."""
        self.beat_at = now
        self.asking_since = None

    def _lapse(self, now: float) -> Verdict:
        if self.ask_s <= 0:
            return "fence"
        self.asking_since = now
        return "ask"
