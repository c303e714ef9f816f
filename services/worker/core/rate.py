"""Recent throughput: tokens per second over a sliding window, in one-second buckets."""

from __future__ import annotations

import math
from collections import deque


class RateMeter:
    """Counts events in 1 s buckets; :meth:`rate` averages the last ``window_s`` seconds.

    The window is the buckets kept: ``window_s - 1`` whole seconds and the current one so
    far, so the average is over that time (dividing by ``window_s`` under-read a steady
    rate by up to 10 %, by the sub-second phase of the read). While less time than that has
    passed since the first event, the average is over the time since then (so a fresh
    worker does not report a diluted rate), at least a second.
    """

    def __init__(self, window_s: int = 10) -> None:
        if window_s < 1:
            raise ValueError("window_s must be >= 1")
        self.window_s = window_s
        self._buckets: deque[tuple[int, int]] = deque()  # (second, count)
        self._first: float | None = None
        self.total = 0

    def add(self, n: int, now: float) -> None:
        if n <= 0:
            return
        if self._first is None:
            self._first = now
        second = math.floor(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1] = (second, self._buckets[-1][1] + n)
        else:
            self._buckets.append((second, n))
        self.total += n
        self._trim(now)

    def rate(self, now: float) -> float:
        """Events per second over the window ending at ``now``."""
        self._trim(now)
        if self._first is None or not self._buckets:
            return 0.0
        covered = self.window_s - 1 + (now - math.floor(now))
        span = min(covered, max(1.0, now - self._first))
        return sum(n for _, n in self._buckets) / span

    def _trim(self, now: float) -> None:
        oldest = math.floor(now) - self.window_s
        while self._buckets and self._buckets[0][0] <= oldest:
            self._buckets.popleft()
