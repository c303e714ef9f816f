"""Deadlines and timings of one request, from wall-clock Unix seconds.

The end-to-end budget of a request runs from its ``created_at`` (``timeout_s``, DESIGN.md
"Semantics"); the scheduler also stamps the assignment with a ``deadline``. The worker aborts
at the earlier of the two, so a scheduler bug cannot extend a client's budget, and a
request whose deadline already passed on arrival is answered ``timeout`` without running.

Timings are measured from ``created_at`` and clamped at 0: the client's clock and the
worker's may disagree by a little, and a negative duration is not valid on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass


def deadline_of(created_at: float, timeout_s: float, assigned_deadline: float | None) -> float:
    """The instant (Unix s) to abort at: ``created_at + timeout_s``, or earlier if assigned."""
    own = created_at + timeout_s
    return own if assigned_deadline is None else min(own, assigned_deadline)


@dataclass(frozen=True, slots=True)
class Timing:
    """``queued_s``: until the engine got it; ``ttft_s``: until the first token (None: no
    token); ``e2e_s``: until the terminal message."""

    queued_s: float
    ttft_s: float | None
    e2e_s: float


def timing(created_at: float, started_at: float, first_token_at: float | None,
           ended_at: float) -> Timing:
    """Durations from ``created_at`` to each milestone, never negative."""
    return Timing(
        queued_s=max(0.0, started_at - created_at),
        ttft_s=None if first_token_at is None else max(0.0, first_token_at - created_at),
        e2e_s=max(0.0, ended_at - created_at),
    )
