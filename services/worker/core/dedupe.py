"""Which assignments to run: dedupe of ``(request_id, attempt)`` and recent cancels.

Delivery is at-least-once, so the same assignment can arrive twice (a redelivery after a
rebalance or restart, a scheduler retry) and a requeued request arrives again with a higher
attempt. :class:`AttemptLedger` remembers the highest attempt seen per request, in bounded
memory (least recently seen forgotten first), with the ``admitted_at`` of the admission it
ran, and classifies each arrival:

==========  =====================================  ===================================
verdict     when                                   the worker
==========  =====================================  ===================================
new         request never seen (or forgotten)      runs it
reused      another admission of the id (its       answers it ``invalid`` unrun: the
            ``admitted_at`` differs)               scheduler forgot the first use, the
                                                   worker has not (ids are single-use)
duplicate   same attempt as the highest seen       drops it (no second terminal)
stale       lower attempt than the highest seen    drops it (clients keep the newest)
newer       higher attempt than the highest seen   runs it; stops the older attempt
==========  =====================================  ===================================

:class:`RecentCancels` remembers cancels for ``ttl_s`` (default 60 s), so an assignment
that arrives after its cancel is answered ``cancelled`` instead of run. A cancel names the
tenant; a mismatch does not match (``CancelRequest``: "a mismatch is ignored").
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

Verdict = Literal["new", "reused", "duplicate", "stale", "newer"]


class AttemptLedger:
    """Highest attempt seen per request_id, and the admission it was of, for the last
    ``capacity`` requests."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._seen: OrderedDict[str, tuple[int, float | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def classify(self, request_id: str, attempt: int,
                 admitted_at: float | None = None) -> Verdict:
        """What to do with an arrival of the admission ``admitted_at`` (None: unknown);
        does not record it (see :meth:`record`)."""
        seen = self._seen.get(request_id)
        if seen is None:
            return "new"
        top, first_at = seen
        if admitted_at is not None and first_at is not None and admitted_at != first_at:
            return "reused"
        if attempt == top:
            return "duplicate"
        return "stale" if attempt < top else "newer"

    def record(self, request_id: str, attempt: int, admitted_at: float | None = None) -> None:
        """Remember ``attempt`` (never lowers what is remembered) and, the first time, the
        admission it is of."""
        seen = self._seen.pop(request_id, None)
        if seen is None:
            self._seen[request_id] = (attempt, admitted_at)
        else:
            self._seen[request_id] = (max(seen[0], attempt),
                                      seen[1] if seen[1] is not None else admitted_at)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def admit(self, request_id: str, attempt: int,
              admitted_at: float | None = None) -> Verdict:
        """:meth:`classify`, then :meth:`record` when the arrival is to be run."""
        verdict = self.classify(request_id, attempt, admitted_at)
        if verdict in ("new", "newer"):
            self.record(request_id, attempt, admitted_at)
        return verdict


class RecentCancels:
    """Cancels of the last ``ttl_s`` seconds (at most ``capacity``), by (request_id,
    tenant): a cancel naming the wrong tenant cannot overwrite the right one."""

    def __init__(self, ttl_s: float = 60.0, capacity: int = 100_000) -> None:
        if ttl_s <= 0 or capacity < 1:
            raise ValueError("ttl_s must be > 0 and capacity >= 1")
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()  # -> time added

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, request_id: str, tenant: str, now: float) -> None:
        key = (request_id, tenant)
        self._seen.pop(key, None)
        self._seen[key] = now
        self._expire(now)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def matches(self, request_id: str, tenant: str, now: float) -> bool:
        """True when ``request_id`` of ``tenant`` was cancelled within the last ``ttl_s``."""
        self._expire(now)
        return (request_id, tenant) in self._seen

    def _expire(self, now: float) -> None:
        # Entries are in arrival order, so the oldest are at the front.
        while self._seen:
            t = next(iter(self._seen.values()))
            if now - t < self.ttl_s:
                break
            self._seen.popitem(last=False)
