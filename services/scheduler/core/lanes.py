"""Weighted interleave of the short and long lanes on workers of pool ``any``.

Workers of pool ``short`` or ``long`` take only their lane, so the lanes never compete for
them. Workers of pool ``any`` take both; there the lanes share placements by weight
(default 3 short : 1 long), so a burst of long prompts cannot crowd short ones out of the
shared pool, nor the reverse.

Formula (virtual time, as in weighted fair queueing): each lane L keeps ``vt[L]``; a
placement of lane L on an ``any`` worker adds ``1 / weight[L]``. The next turn goes to the
lane with the smallest ``vt`` among lanes that have a placeable head (ties: short first).
With weights 3:1 the turns run S L S S S L S S S L ... A lane that was idle or blocked may
lag at most one step of the heaviest-stepping lane (``vt >= max(vt) - max(1 / weight)``),
so it cannot hoard credit and then burst.

Placements on dedicated workers (pool ``short`` or ``long``) cost no turn — the lanes do
not compete there — but the lane that just placed on one yields the next turn to the other
lane if that one has work. Without that, a caller placing one request per call
(``max_placements=1``) could serve a lane with a dedicated pool forever while the other
lane, ahead of it in virtual time, never got a look. Deterministic: no randomness.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Final

from schemas.common import LANES, Lane

DEFAULT_LANE_WEIGHTS: Final[Mapping[Lane, float]] = {"short": 3.0, "long": 1.0}


class LaneInterleave:
    """Turn-taking state between the lanes; owned by the pending queue."""

    __slots__ = ("_lag", "_step", "_vt", "_yield")

    def __init__(self, weights: Mapping[Lane, float] = DEFAULT_LANE_WEIGHTS) -> None:
        self._step = {lane: 1.0 / weights[lane] for lane in LANES}
        self._lag = max(self._step.values())
        self._vt: dict[Lane, float] = dict.fromkeys(LANES, 0.0)
        self._yield: Lane | None = None  # placed on a dedicated worker last: yields a turn

    def next_lane(self, ready: Collection[Lane]) -> Lane | None:
        """The lane whose turn it is among ``ready`` (lanes with a placeable head)."""
        if not ready:
            return None
        vt = self._vt
        floor = max(vt.values()) - self._lag
        for lane in LANES:
            if vt[lane] < floor:
                vt[lane] = floor
        best: Lane | None = None
        for lane in LANES:  # LANES order breaks ties: short first
            if lane in ready and (best is None or vt[lane] < vt[best]):
                best = lane
        if best is not None and best == self._yield and len(ready) > 1:
            return next(lane for lane in LANES if lane != best and lane in ready)
        return best

    def charge(self, lane: Lane, *, shared: bool = True) -> None:
        """Record one placement of ``lane``: on an ``any`` worker (``shared``) or not."""
        if not shared:
            self._yield = lane
            return
        self._yield = None
        self._vt[lane] += self._step[lane]
        low = min(self._vt.values())
        if low > 1e6:  # keep the floats small; only differences matter
            for key in LANES:
                self._vt[key] -= low

    def virtual_times(self) -> dict[Lane, float]:
        """A copy of the per-lane virtual times (for tests and metrics)."""
        return dict(self._vt)
