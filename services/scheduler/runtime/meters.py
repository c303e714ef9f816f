"""Small measuring and remembering state of the scheduler runtime.

- :class:`DrainMeter`: tokens (prompt + generated) finished per second per model over a
  sliding window, from terminal events' ``usage`` — the ``drain_tokens_per_s`` of
  ``QueueStatus``. Events are placed on the window by their own ``ts``, so the history
  replayed at start counts exactly as it did live, and a replayed old event counts for
  nothing. The rate is ``Σ tokens in (now - window, now] / window``: it ramps up over one
  window after the fleet starts, which errs on the side of a lower rate (ingest's
  Retry-After is longer, never shorter).
- :class:`RecentCancels`: cancels of requests the scheduler cannot act on yet (not read
  from their topic yet, or running on a worker that may still be lost), remembered for
  ``memory_s`` from their ``issued_at`` so a late arrival or a requeue ends ``cancelled``.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class DrainMeter:
    """Tokens finished per model over a sliding window of ``window_s`` seconds."""

    def __init__(self, window_s: float = 30.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._sums: dict[str, int] = {}

    def add(self, model: str, ts: float, tokens: int) -> None:
        """Record ``tokens`` finished at ``ts`` (samples must come roughly in time order;
        an out-of-order one only lives a little longer or shorter in the window)."""
        if tokens <= 0:
            return
        self._samples.setdefault(model, deque()).append((ts, tokens))
        self._sums[model] = self._sums.get(model, 0) + tokens

    def rate(self, model: str, now: float) -> float:
        """Tokens per second finished in ``(now - window_s, now]``."""
        self._expire(model, now)
        return self._sums.get(model, 0) / self.window_s

    def models(self) -> list[str]:
        return list(self._samples)

    def _expire(self, model: str, now: float) -> None:
        samples = self._samples.get(model)
        if samples is None:
            return
        horizon = now - self.window_s
        while samples and samples[0][0] <= horizon:
            _, tokens = samples.popleft()
            self._sums[model] -= tokens
        if not samples:
            del self._samples[model]
            del self._sums[model]


class RecentCancels:
    """request_id -> (tenant, expires_at), bounded; oldest forgotten first."""

    def __init__(self, memory_s: float = 600.0, capacity: int = 100_000) -> None:
        self.memory_s = memory_s
        self._capacity = max(1, capacity)
        self._items: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, request_id: str, tenant: str, issued_at: float, now: float) -> bool:
        """Remember a cancel; False when it is already too old to matter."""
        expires_at = issued_at + self.memory_s
        if expires_at <= now:
            return False
        self._items[request_id] = (tenant, expires_at)
        self._items.move_to_end(request_id)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)
        return True

    def matches(self, request_id: str, tenant: str, now: float) -> bool:
        """True if ``request_id`` of ``tenant`` was cancelled and the cancel still holds."""
        item = self._items.get(request_id)
        if item is None:
            return False
        if item[1] <= now:
            del self._items[request_id]
            return False
        return item[0] == tenant

    def discard(self, request_id: str) -> None:
        self._items.pop(request_id, None)

    def prune(self, now: float) -> None:
        for request_id in [r for r, (_, exp) in self._items.items() if exp <= now]:
            del self._items[request_id]
