"""The hand-offs whose prompt KV a prefill worker's engine may still hold.

A prefill stage ends on its worker with ``event.prefilled``. The engine's KV connector then
keeps the prompt's KV until the decode stage pulls it (vLLM's NIXL connector frees it once
the decode side has read it, or after its own timeout). A draining prefill worker that
exits before then takes that KV with it (or lets its operator stop the engine), and the
decode stage fails. So a draining worker waits until ``HeldHandoffs.held(now)`` is 0
(``services.worker.app``), and counts the held ones in its heartbeat meanwhile.

A hand-off is held from its ``event.prefilled`` (attempt k), once that may be in the log:
acknowledged, or sent and then cut short by a fence (``RequestRun.handed_off``), until one
of:

* an event of the request at a later attempt that shows the KV is no longer wanted:
  ``event.first_token`` (the decode stage has the KV: it computed a token from it; after a
  start-over, the whole re-run computed its own), ``event.prefilled`` (a start-over went
  through two stages again), or a terminal (``done``, ``failed``, ``aborted``);
* a terminal event at attempt k itself (the scheduler ends a request between its stages
  at k + 1, but a terminal at k is just as final);
* its expiry: the request's deadline (no decode stage starts after it), or ``hold_s`` after
  the hand-off (the connector's own timeout: the engine has freed the KV by then anyway),
  whichever comes first.

``event.started`` of the decode stage does not end the hold: the decode engine starts
pulling the KV only once it admits the request. A fenced process (or one whose slot was
taken over) keeps its holds: the scheduler starts over only the hand-offs whose decode
stage it has not placed yet (their later attempt ends the hold), while a decode stage
already placed still pulls from this process's engine.

Holds are kept whether or not the worker drains (a drain needs to know them), and expired
ones are let go as new ones come, so memory is bounded by ``hold_s`` of hand-offs.

Pure: wall-clock ``now`` in, no I/O (the worker feeds it events from ``llmq.events``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

#: Event kinds that end a hold when they carry a later attempt than the hand-off's.
_LATER: Final = frozenset({"event.first_token", "event.prefilled", "event.done",
                           "event.failed", "event.aborted"})
#: Event kinds that end a hold at the hand-off's own attempt too.
_TERMINAL: Final = frozenset({"event.done", "event.failed", "event.aborted"})


@dataclass(frozen=True, slots=True)
class Hold:
    """One hand-off: its prefill attempt, a time no later than its ``event.prefilled`` was
    first written (where a reader of ``llmq.events`` starts), and when the hold ends."""

    attempt: int
    since: float
    expires: float


@dataclass(slots=True)
class HeldHandoffs:
    """Hand-offs by request id, oldest first (see the module docstring)."""

    hold_s: float
    _held: dict[str, Hold] = field(default_factory=dict)

    def hold(self, request_id: str, attempt: int, deadline: float, now: float,
             since: float | None = None) -> None:
        """``request_id``'s prefill stage at ``attempt`` handed its KV on: acknowledged at
        ``now``, its ``event.prefilled`` first written no earlier than ``since``."""
        self._forget_old(now)
        if self.hold_s <= 0:
            return
        current = self._held.get(request_id)
        if current is not None and current.attempt >= attempt:
            return
        self._held.pop(request_id, None)  # re-inserted last: the dict stays oldest first
        start = now if since is None else min(since, now)
        self._held[request_id] = Hold(attempt, start, min(deadline, now + self.hold_s))

    def observe(self, kind: str, request_id: str, attempt: int) -> bool:
        """Read one lifecycle event; True if it ended a hold."""
        current = self._held.get(request_id)
        if current is None:
            return False
        if (attempt > current.attempt and kind in _LATER) or \
                (attempt == current.attempt and kind in _TERMINAL):
            del self._held[request_id]
            return True
        return False

    def held(self, now: float) -> int:
        """How many hand-offs are still held at ``now`` (expired ones are let go)."""
        for rid in [rid for rid, h in self._held.items() if h.expires <= now]:
            del self._held[rid]
        return len(self._held)

    def since(self) -> float | None:
        """When the oldest hand-off still held was handed off (None: none held)."""
        return min((h.since for h in self._held.values()), default=None)

    def _forget_old(self, now: float) -> None:
        # Oldest acknowledgement first, and each expires within hold_s of it: dropping
        # expired ones from the front keeps at most hold_s worth of hand-offs.
        while self._held:
            rid, first = next(iter(self._held.items()))
            if first.expires > now:
                return
            del self._held[rid]
