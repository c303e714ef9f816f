"""Which assignments to run: dedupe of ``(request_id, attempt)`` and recent cancels.

Delivery is at-least-once, so the same assignment can arrive twice (a redelivery after a
rebalance or restart, a scheduler retry) and a requeued request arrives again with a higher
attempt. :class:`AttemptLedger` remembers the highest attempt seen per request, in bounded
memory (least recently seen forgotten first), and classifies each arrival:

==========  =====================================  ===================================
verdict     when                                   the worker
==========  =====================================  ===================================
new         request never seen (or forgotten)      runs it
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

Verdict = Literal["new", "duplicate", "stale", "newer"]


class AttemptLedger:
    """Highest attempt seen per request_id, for the last ``capacity`` requests."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._seen: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def classify(self, request_id: str, attempt: int) -> Verdict:
        """What to do with an arrival; does not record it (see :meth:`record`)."""
        seen = self._seen.get(request_id)
        if seen is None:
            return "new"
        if attempt == seen:
            return "duplicate"
        return "stale" if attempt < seen else "newer"

    def record(self, request_id: str, attempt: int) -> None:
        """Remember ``attempt`` (never lowers what is remembered)."""
        seen = self._seen.pop(request_id, None)
        self._seen[request_id] = attempt if seen is None else max(seen, attempt)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def admit(self, request_id: str, attempt: int) -> Verdict:
        """:meth:`classify`, then :meth:`record` when the arrival is to be run."""
        verdict = self.classify(request_id, attempt)
        if verdict in ("new", "newer"):
            self.record(request_id, attempt)
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
