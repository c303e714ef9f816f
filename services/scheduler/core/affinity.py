"""Which worker last served a prompt prefix: the memory behind the prefix-affinity scorer.

A worker that just served a prefix likely still has its KV blocks in vLLM's prefix cache,
so sending the next request with the same ``prefix_hash`` there skips recomputing it. The
map is bounded (least recently placed prefixes are forgotten first) and only ever a hint:
the worker named may since have filled up, drained or died, and the filters still apply.
"""

from __future__ import annotations

from collections import OrderedDict


class AffinityMap:
    """prefix_hash -> worker_id of the latest placement with that prefix (LRU-bounded)."""

    __slots__ = ("_capacity", "_map")

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._map: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def get(self, prefix_hash: str | None) -> str | None:
        """The worker that last served ``prefix_hash``, if remembered."""
        if prefix_hash is None:
            return None
        return self._map.get(prefix_hash)

    def record(self, prefix_hash: str, worker_id: str) -> None:
        """Remember a placement; evicts the least recently placed prefix when full."""
        self._map[prefix_hash] = worker_id
        self._map.move_to_end(prefix_hash)
        if len(self._map) > self._capacity:
            self._map.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        """Drop every prefix pointing at ``worker_id`` (it is gone): O(n), rare."""
        for prefix in [p for p, w in self._map.items() if w == worker_id]:
            del self._map[prefix]
