"""Flow between the request topics and the pending queue: in-order acks and pausing.

:class:`OrderedAcks` — the request agent consumes without acknowledging; a record is
acknowledged once what the scheduler produced for it (its assignment, or its terminal
reply and event) was acknowledged by the broker. Those outputs finish in any order (a big
request waits while a small one behind it is placed), but Faust 0.15 commits the highest
run of consecutive acked offsets without checking that it starts at the committed offset
(``Consumer._new_offset``), so acking out of order could commit past a record that is still
pending — lost on a crash. This class hands records back for acking strictly in offset
order per partition: a record is acked once it *and every record before it* is done. A
blocked head only delays commits; after a crash the records behind it are redelivered and
skipped (the assignment log knows them).

It also drops duplicates (an offset at or below the highest one received: redelivery
after a seek) and tells where a partition must resume (:meth:`OrderedAcks.next_offset`).
And it bounds what a blocked head keeps in memory: every record done behind it stays
(its handle holds the record) until the head is done, and the pending queue's ladder
below does not count them, so a partition holding ``limit`` records is paused whatever the
ladder says, until it holds fewer than ``resume_below`` (:meth:`OrderedAcks.over`).

:class:`PauseLadder` — backpressure goes to Kafka, not to memory (DESIGN.md). As the pending
queue fills, request topics are paused lowest priority first: topic i of
``PAUSE_ORDER`` (low.long first, high.short last) pauses once the queue holds
``max_pending × (1 − band + band·i/5)`` requests and resumes ``hysteresis × max_pending``
below that. Records already fetched still arrive after a pause; they are admitted past the
bound (they are in memory anyway), so the queue exceeds ``max_pending`` by at most one
fetch.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Final, Generic, TypeVar

from schemas.common import Lane, Priority

H = TypeVar("H")
TopicKey = tuple[Priority, Lane]

#: Request topics in the order they pause: lowest priority, long lane first.
PAUSE_ORDER: Final[tuple[TopicKey, ...]] = (
    ("low", "long"),
    ("low", "short"),
    ("normal", "long"),
    ("normal", "short"),
    ("high", "long"),
    ("high", "short"),
)


class _Partition(Generic[H]):
    __slots__ = ("done", "handles", "highest", "order")

    def __init__(self) -> None:
        self.order: deque[int] = deque()
        self.handles: dict[int, H] = {}
        self.done: set[int] = set()
        self.highest = -1


class OrderedAcks(Generic[H]):
    """Records received per partition, released for acking in offset order."""

    def __init__(self) -> None:
        self._parts: dict[Hashable, _Partition[H]] = {}
        self._over: set[Hashable] = set()

    def received(self, tp: Hashable, offset: int, handle: H) -> bool:
        """Track a record; False for a duplicate (already received), which must be ignored."""
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Partition()
        if offset <= part.highest:
            return False
        part.highest = offset
        part.order.append(offset)
        part.handles[offset] = handle
        return True

    def done(self, tp: Hashable, offset: int) -> list[H]:
        """Mark a record done; returns the handles that may now be acked, in order."""
        part = self._parts.get(tp)
        if part is None or offset not in part.handles:
            return []  # forgotten (partition revoked) or never tracked
        part.done.add(offset)
        ready: list[H] = []
        while part.order and part.order[0] in part.done:
            head = part.order.popleft()
            part.done.discard(head)
            ready.append(part.handles.pop(head))
        return ready

    def forget(self, tps: Iterable[Hashable]) -> None:
        """Drop partitions (revoked): their records will be redelivered to their new owner."""
        for tp in tps:
            self._parts.pop(tp, None)
            self._over.discard(tp)

    def next_offset(self, tp: Hashable) -> int | None:
        """One past the highest offset received on ``tp``; None if nothing was."""
        part = self._parts.get(tp)
        return None if part is None or part.highest < 0 else part.highest + 1

    def over(self, limit: int, resume_below: int) -> set[Hashable]:
        """Partitions holding too many records (module docstring): ``limit`` or more, or,
        once over, still ``resume_below`` or more."""
        self._over = {
            tp for tp, part in self._parts.items()
            if len(part.order) >= (resume_below if tp in self._over else limit)
        }
        return set(self._over)

    def outstanding(self, tp: Hashable | None = None) -> int:
        """Records received and not yet released (on ``tp``, or everywhere)."""
        if tp is not None:
            part = self._parts.get(tp)
            return 0 if part is None else len(part.order)
        return sum(len(p.order) for p in self._parts.values())


class PauseLadder:
    """Which request topics should be paused for a queue of a given size."""

    def __init__(self, max_pending: int, band: float = 0.1, hysteresis: float = 0.05) -> None:
        if max_pending < 1 or not 0.0 <= band < 1.0 or not 0.0 < hysteresis < 1.0:
            raise ValueError("need max_pending >= 1, 0 <= band < 1, 0 < hysteresis < 1")
        steps = len(PAUSE_ORDER) - 1
        self.pause_at: dict[TopicKey, int] = {}
        self.resume_below: dict[TopicKey, int] = {}
        for i, key in enumerate(PAUSE_ORDER):
            at = max(1, _ceil(max_pending * (1.0 - band + band * i / steps)))
            self.pause_at[key] = at
            self.resume_below[key] = max(1, min(at, _ceil(at - hysteresis * max_pending)))
        self.paused: set[TopicKey] = set()

    def update(self, size: int) -> tuple[list[TopicKey], list[TopicKey]]:
        """Apply a queue size; returns (newly paused, newly resumed), in PAUSE_ORDER."""
        paused, resumed = [], []
        for key in PAUSE_ORDER:
            if key not in self.paused and size >= self.pause_at[key]:
                self.paused.add(key)
                paused.append(key)
            elif key in self.paused and size < self.resume_below[key]:
                self.paused.discard(key)
                resumed.append(key)
        return paused, resumed


def _ceil(x: float) -> int:
    """Ceiling that ignores float noise (1000 × 0.94 is 940.0000000000001)."""
    return math.ceil(round(x, 6))
