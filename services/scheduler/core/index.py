"""Candidate indexes: which workers could take a route, ordered by room, kept incrementally.

A *route* is what a request needs from a worker regardless of load: (model, version, lane).
For each route the cycle asks once per snapshot which workers pass the route-stage filters
(model, pool/lane, fresh heartbeat, not draining) and memoises the answer in the snapshot.
Over those members the index keeps each worker's *room* (:meth:`Ledger.room`: free KV if
it has a sequence slot, else 0) in a lazy max-heap. A placement or a release touches one
worker; the index learns of it from the ledger's change log and pushes one fresh entry
(O(log n)), so a decision never rescans the fleet:

* "does anything fit?" is the heap top, O(1) amortised — a blocked head costs almost
  nothing;
* the K roomiest candidates are popped in O(K log n) and pushed back.

Stale workers are never members, whatever the profile says (fail closed).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator
from typing import cast

from schemas.common import Lane
from services.scheduler.core.ledger import Ledger
from services.scheduler.core.types import Snapshot, WorkerState

Route = tuple[str, str | None, Lane]


# Heap entries are single ints, -room · 2^20 + position: int comparisons are several times
# cheaper than tuples. ``key >> 20`` is -room and ``key & _POS_MASK`` the position.
_POS_BITS = 20
_POS_MASK = (1 << _POS_BITS) - 1


class RouteIndex:
    """Members of one route in one snapshot, with their room in a lazy max-heap.

    Every change of a member's room pushes a fresh entry; an entry is current when its
    room equals ``room[position]`` (equal duplicates are skipped by position). The heap is
    rebuilt from ``room`` when stale entries outnumber live ones.
    """

    __slots__ = ("_block", "_cursor", "_heap", "_ledger", "members", "pos", "room")

    def __init__(self, members: list[WorkerState], ledger: Ledger) -> None:
        if len(members) > _POS_MASK:
            raise ValueError(f"at most {_POS_MASK} workers per route, got {len(members)}")
        self.members = members
        self.pos = {w.worker_id: i for i, w in enumerate(members)}
        self._ledger = ledger
        room_of = ledger.room
        self.room = [room_of(w) for w in members]
        self._heap: list[int] = []
        self._cursor = ledger.cursor
        self._block: int | None = None
        self._reheap()

    @property
    def largest_block(self) -> int:
        """The largest KV block size among the members (0 for none), worked out once."""
        if self._block is None:
            self._block = max((w.block_size for w in self.members), default=0)
        return self._block

    def sync(self) -> None:
        """Catch up with reservations and releases since the last call."""
        ledger = self._ledger
        changed = ledger.changes_since(self._cursor)
        self._cursor = ledger.cursor
        if changed is None:  # the log was trimmed past us: recompute every member
            room_of = ledger.room
            self.room = [room_of(w) for w in self.members]
            self._reheap()
            return
        pos, members, room, heap = self.pos, self.members, self.room, self._heap
        room_of = ledger.room
        for worker_id in changed:
            i = pos.get(worker_id)
            if i is not None:
                now = room_of(members[i])
                if now != room[i]:
                    room[i] = now
                    heapq.heappush(heap, (-now << _POS_BITS) | i)
        if len(heap) > 2 * len(members) + 64:
            self._reheap()

    def top_room(self) -> int:
        """The largest room among members (0 when there are none)."""
        heap, room = self._heap, self.room
        while heap:
            key = heap[0]
            top = -(key >> _POS_BITS)
            if room[key & _POS_MASK] == top:
                return top
            heapq.heappop(heap)
        return 0

    def roomiest(self, kv_tokens: int) -> Generator[WorkerState, None, None]:
        """Members with room >= ``kv_tokens``, roomiest first, lazily.

        Pops current entries as it yields them and pushes them back when the iterator
        ends or is closed (a ``for`` loop that breaks closes it when it is collected; call
        ``close()`` to be explicit), so the index is unchanged. Stale entries met on the
        way are dropped for good — that is what keeps the top of the heap clean.
        """
        heap, room, members = self._heap, self.room, self.members
        taken: list[int] = []
        seen: set[int] = set()
        try:
            while heap:
                key = heap[0]
                here = -(key >> _POS_BITS)
                i = key & _POS_MASK
                if room[i] != here or i in seen:
                    heapq.heappop(heap)  # superseded, or a duplicate of one yielded
                    continue
                if here < kv_tokens:
                    return
                taken.append(heapq.heappop(heap))
                seen.add(i)
                yield members[i]
        finally:
            for key in taken:
                heapq.heappush(heap, key)

    def fitting(self, kv_tokens: int) -> list[WorkerState]:
        """Every member with room >= ``kv_tokens``, in member order: O(members)."""
        room = self.room
        return [w for i, w in enumerate(self.members) if room[i] >= kv_tokens]

    def _reheap(self) -> None:
        self._heap = [(-r << _POS_BITS) | i for i, r in enumerate(self.room)]
        heapq.heapify(self._heap)


def route_index(
    snapshot: Snapshot,
    route: Route,
    ledger: Ledger,
    admits: Callable[[WorkerState], bool],
    owner: object,
) -> RouteIndex:
    """The index of ``route`` for this snapshot and ledger, built on first use.

    ``admits`` applies the route-stage filters; ``owner`` (the pipeline) is part of the
    memo key because another pipeline may filter differently.
    """
    index = cached_route_index(snapshot, route, ledger, owner)
    if index is not None:
        return index
    members = [w for w in snapshot.workers.values() if snapshot.is_fresh(w) and admits(w)]
    index = snapshot.memo[("route", route, owner, ledger)] = RouteIndex(members, ledger)
    return index


def cached_route_index(
    snapshot: Snapshot, route: Route, ledger: Ledger, owner: object
) -> RouteIndex | None:
    """The index :func:`route_index` built for these, brought up to date; None before the
    first: a caller may then skip setting up the route's filters."""
    found = snapshot.memo.get(("route", route, owner, ledger))
    if found is None:
        return None
    index = cast(RouteIndex, found)
    index.sync()
    return index


class Capacity:
    """What the live fleet could ever offer a route; decides Reject versus Defer.

    Live = fresh heartbeat. Draining workers count as serving the model (a replacement is
    usually on its way) but not as able to take the request: they never will. Nor do
    prefill workers: they compute prompts only, and a request is staged there only when a
    decode worker could hold it (:mod:`.cycle`, step 6).
    """

    __slots__ = (
        "accepting",
        "any_live",
        "lane_served",
        "max_usable",
        "model_served",
        "recent_usable",
        "version_served",
    )

    def __init__(self, snapshot: Snapshot, route: Route, ledger: Ledger) -> None:
        model, version, lane = route
        self.any_live = False
        self.model_served = False
        self.version_served = False
        self.lane_served = False
        self.accepting = 0
        self.max_usable = 0
        for w in snapshot.workers.values():
            if not snapshot.is_fresh(w):
                continue
            self.any_live = True
            if w.model != model:
                continue
            self.model_served = True
            if version is not None and w.model_version != version:
                continue
            self.version_served = True
            if w.pool != "any" and w.pool != lane:
                continue
            self.lane_served = True
            if not w.draining and w.role != "prefill":  # a prefill worker runs no request
                self.accepting += 1                      # to its end
                self.max_usable = max(self.max_usable, ledger.usable_kv(w))
        #: The largest usable KV of a worker of the route heard from lately but not fresh
        #: (``Snapshot.recent``; -1 for none): what the route may have again soon. Not a
        #: draining one: it was on its way out (a retired worker is not coming back).
        self.recent_usable = max(
            (ledger.usable_kv(w) for w in snapshot.recent
             if w.model == model and (version is None or w.model_version == version)
             and (w.pool == "any" or w.pool == lane) and w.role != "prefill"
             and not w.draining), default=-1)


def capacity(snapshot: Snapshot, route: Route, ledger: Ledger) -> Capacity:
    """Memoised :class:`Capacity` of ``route`` in ``snapshot``."""
    key = ("capacity", route, ledger)
    found = snapshot.memo.get(key)
    if found is None:
        found = snapshot.memo[key] = Capacity(snapshot, route, ledger)
    return cast(Capacity, found)


def max_tokens_per_s(snapshot: Snapshot) -> float:
    """The best recent throughput among fresh workers (memoised; 0 for an empty fleet)."""
    found = snapshot.memo.get("max_tokens_per_s")
    if found is None:
        fresh = [w.tokens_per_s for w in snapshot.workers.values() if snapshot.is_fresh(w)]
        found = snapshot.memo["max_tokens_per_s"] = max(fresh, default=0.0)
    return cast(float, found)
