"""Small remembering state of the scheduler runtime.

- :class:`RecentCancels`: cancels of requests the scheduler cannot act on yet (not read
  from their topic yet, or running on a worker that may still be lost), remembered for
  ``memory_s`` from their ``issued_at`` so a late arrival or a requeue ends ``cancelled``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

#: How far a cancel's ``issued_at`` may be before its request's ``created_at`` and still
#: be its own: the two stamps come from different clocks (the client's, ingest's).
CLOCK_MARGIN_S: Final = 60.0


class RecentCancels:
    """(request_id, tenant) -> (issued_at, expires_at), bounded; oldest forgotten first.
    Keyed by both, so a cancel naming the wrong tenant (ignored) cannot overwrite the right
    one."""

    def __init__(self, memory_s: float = 600.0, capacity: int = 100_000) -> None:
        self.memory_s = memory_s
        self._capacity = max(1, capacity)
        self._items: OrderedDict[tuple[str, str], tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, request_id: str, tenant: str, issued_at: float, now: float) -> bool:
        """Remember a cancel; False when it is already too old to matter. It expires
        ``memory_s`` from ``issued_at``, or from ``now`` plus ``CLOCK_MARGIN_S`` when it
        claims to be issued later than that: one stamped far ahead sat at the head of the
        pruning order and held every later one in memory until the capacity pushed them out
        (found by an audit). ``matches`` compares the ``issued_at`` given (a client whose
        clock runs ahead stamps its request and its cancel alike)."""
        expires_at = min(issued_at, now + CLOCK_MARGIN_S) + self.memory_s
        if expires_at <= now:
            return False
        key = (request_id, tenant)
        self._items[key] = (issued_at, expires_at)
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)
        return True

    def matches(self, request_id: str, tenant: str, now: float,
                created_at: float | None = None) -> bool:
        """True if ``request_id`` of ``tenant`` was cancelled and the cancel still holds;
        with ``created_at`` (the request's), only a cancel issued after it, give or take
        ``CLOCK_MARGIN_S``: a cancel of an earlier request under the same id (reused once
        the log forgot the first) does not end a new one (found by a review: remembered a
        day, it outlived the log's hour)."""
        key = (request_id, tenant)
        found = self._items.get(key)
        if found is None:
            return False
        issued_at, expires_at = found
        if expires_at <= now:
            del self._items[key]
            return False
        return created_at is None or issued_at >= created_at - CLOCK_MARGIN_S

    def discard(self, request_id: str, tenant: str) -> None:
        self._items.pop((request_id, tenant), None)

    def prune(self, now: float) -> None:
        """Forget expired cancels from the oldest read on, up to the first that holds: a
        day's worth may be held, and this runs every second. One read out of its
        ``issued_at`` order waits behind a younger one (``matches`` says no all the same;
        the capacity bounds them)."""
        items = self._items
        while items:
            key, (_, expires_at) = next(iter(items.items()))
            if expires_at > now:
                break
            del items[key]
