"""The class heads one scheduling cycle chooses from: per lane, best first.

A cycle (:mod:`.cycle`) places class heads one at a time. The lanes take turns
(:mod:`.lanes`); within a lane the head with the best effective priority goes next: the
smallest (order key, class rank), and of equals the class in play longest (the queue's
class order at the start, :meth:`PendingQueue.keyed_heads`; a class put back after a hold
ended comes after every class still in play). Scanning every head for each choice made a
cycle O(classes²) when many classes block, as each deferral is one more choice; here each
lane keeps its heads in a heap, so a choice costs O(log classes).

Heap entries are replaced lazily: an entry is current while its serial number is the one
``_serials`` holds for its class; others are dropped when they reach the top.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Mapping

from schemas.common import Lane
from services.scheduler.core.queue import ClassKey
from services.scheduler.core.types import QueuedRequest

#: (order key, class rank, place in the class order, serial, class, its head). The first
#: four order the choice; the serial is unique, so nothing after it is ever compared.
_Entry = tuple[float, int, int, int, ClassKey, QueuedRequest]


class CycleHeads:
    """The heads in play during one cycle; owned by that cycle."""

    __slots__ = ("_by_lane", "_counter", "_serials")

    def __init__(self, heads: Mapping[ClassKey, tuple[float, QueuedRequest]]) -> None:
        """``heads``: each class's head with its order key, in the queue's class order."""
        #: class -> serial of its current entry; the serial of a class's first entry is
        #: also its place (put() keeps a class's place while it stays in play).
        self._serials: dict[ClassKey, int] = {}
        self._by_lane: dict[Lane, list[_Entry]] = {}
        # As put() would, one class after another, but heapified once per lane.
        for place, (klass, (order_key, request)) in enumerate(heads.items()):
            self._serials[klass] = place
            entry = (order_key, klass[1], place, place, klass, request)
            self._by_lane.setdefault(klass[0], []).append(entry)
        for heap in self._by_lane.values():
            heapq.heapify(heap)
        self._counter = itertools.count(len(heads))  # places and serials, never reused

    def __len__(self) -> int:
        return len(self._serials)

    def put(self, klass: ClassKey, order_key: float, request: QueuedRequest, *,
            place: int | None = None) -> None:
        """Make ``request`` (with its order key) the head of ``klass``, after every class
        in play; with ``place`` (from :meth:`best`), in the class's place instead (its
        next request, after a placement)."""
        serial = next(self._counter)
        self._serials[klass] = serial
        entry = (order_key, klass[1], serial if place is None else place, serial, klass,
                 request)
        heapq.heappush(self._by_lane.setdefault(klass[0], []), entry)

    def drop(self, klass: ClassKey) -> None:
        """Take ``klass`` out of play (blocked, or nothing left in it)."""
        del self._serials[klass]

    def lanes(self) -> Collection[Lane]:
        """The lanes with a head in play."""
        return [lane for lane, heap in self._by_lane.items() if self._top(heap) is not None]

    def best(self, lane: Lane) -> tuple[ClassKey, QueuedRequest, int]:
        """The head ``lane`` would place next, its class and the class's place; ``lane``
        must be among :meth:`lanes`."""
        top = self._top(self._by_lane[lane])
        assert top is not None
        return top[4], top[5], top[2]

    def _top(self, heap: list[_Entry]) -> _Entry | None:
        """The current entry at the top of ``heap``, dropping replaced ones on the way."""
        serials = self._serials
        while heap:
            top = heap[0]
            if serials.get(top[4]) == top[3]:
                return top
            heapq.heappop(heap)
        return None
