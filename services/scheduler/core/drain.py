"""The drain meter: how fast the fleet empties a model's queue, measured.

:class:`DrainMeter` gives the ``drain_tokens_per_s`` of ``QueueStatus`` (live scheduler)
and of the simulator's cluster view; ingest turns it into ``overloaded`` refusals and
their Retry-After. Pure: times come in as arguments.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection


class DrainMeter:
    """How fast the fleet empties a model's queue: tokens finished per second.

    Tokens in the queue's unit: a finished request counts what it reserved while queued,
    prompt + max_tokens (the caller adds it so), not the tokens it generated — ingest
    divides queued tokens by this rate, and answers that stop short of max_tokens would
    otherwise make the fleet look slower than it drains.

    The plain measure, all tokens finished in a sliding window of
    ``window_s`` divided by the window, is a lower bound of capacity; but when the fleet
    was idle for part of the window it is far below it (completions follow the arrivals:
    one warm-up request, or a quiet night, is not what a fleet can do). Capacity shows while
    work waits, so the scheduler marks when a model's pending queue turns non-empty and
    empty again (:meth:`waiting`) and the meter also keeps the tokens finished while the
    model was backlogged and the backlogged seconds. With at least ``min_backlog_s``
    backlogged seconds in the window the rate is the larger of the two measures.

    0.0 means unknown (nothing finished in the window): the ``QueueStatus`` convention.
    Ingest judges a backlog by ``drain × timeout`` or by the fleet's free KV, whichever
    admits more, so the low plain measure of an idle fleet does not refuse a burst the
    fleet can start at once. A restarted scheduler has no backlog marks for the history it
    replays and starts from the plain measure.
    """

    def __init__(self, window_s: float = 30.0, min_backlog_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if not 0 < min_backlog_s <= window_s:
            raise ValueError(f"min_backlog_s must be in (0, window_s], got {min_backlog_s}")
        self.window_s = window_s
        self.min_backlog_s = min_backlog_s
        self._samples: dict[str, deque[tuple[float, int, bool]]] = {}  # ts, tokens, backlogged
        self._sums: dict[str, list[int]] = {}  # model -> [all tokens, backlogged tokens]
        self._open: dict[str, float] = {}  # model -> start of the backlog going on now
        self._spans: dict[str, deque[tuple[float, float]]] = {}  # closed backlogs

    def waiting(self, now: float, models: Collection[str]) -> None:
        """The models with requests waiting in the pending queue as of ``now``: their
        backlog starts (or goes on); every other model's backlog ends."""
        for model in models:
            self._open.setdefault(model, now)
        for model in [m for m in self._open if m not in models]:
            start = self._open.pop(model)
            if now > start:
                self._spans.setdefault(model, deque()).append((start, now))

    def add(self, model: str, ts: float, tokens: int) -> None:
        """Record ``tokens`` finished at ``ts`` (samples must come roughly in time order)."""
        if tokens <= 0:
            return
        backlogged = self._backlogged_at(model, ts)
        self._samples.setdefault(model, deque()).append((ts, tokens, backlogged))
        sums = self._sums.setdefault(model, [0, 0])
        sums[0] += tokens
        sums[1] += tokens if backlogged else 0

    def rate(self, model: str, now: float) -> float:
        """Tokens per second in ``(now - window_s, now]``: the plain average, or the
        backlogged rate when larger and measured over ``min_backlog_s`` at least."""
        self._expire(model, now)
        every, backlogged = self._sums.get(model, (0, 0))
        average = every / self.window_s
        busy = self.backlogged_s(model, now)
        if busy < self.min_backlog_s:
            return average
        return max(backlogged / busy, average)

    def backlogged_s(self, model: str, now: float) -> float:
        """Seconds of ``(now - window_s, now]`` during which ``model`` had a backlog."""
        horizon = now - self.window_s
        total = sum(max(0.0, min(end, now) - max(start, horizon))
                    for start, end in self._spans.get(model, ()))
        start = self._open.get(model)
        if start is not None:
            total += max(0.0, now - max(start, horizon))
        return total

    def models(self) -> list[str]:
        return sorted(self._samples.keys() | self._spans.keys() | self._open.keys())

    def _backlogged_at(self, model: str, ts: float) -> bool:
        start = self._open.get(model)
        if start is not None and ts >= start:
            return True
        return any(s <= ts <= e for s, e in reversed(self._spans.get(model, ())))

    def _expire(self, model: str, now: float) -> None:
        horizon = now - self.window_s
        samples = self._samples.get(model)
        if samples is not None:
            sums = self._sums[model]
            while samples and samples[0][0] <= horizon:
                _, tokens, backlogged = samples.popleft()
                sums[0] -= tokens
                sums[1] -= tokens if backlogged else 0
            if not samples:
                del self._samples[model], self._sums[model]
        spans = self._spans.get(model)
        if spans is not None:
            while spans and spans[0][1] <= horizon:
                spans.popleft()
            if not spans:
                del self._spans[model]
