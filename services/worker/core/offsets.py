"""Which offset of the worker's partition is safe to commit, with requests finishing out of
order; and the commit metadata that lets a restarted worker skip finished requests.

An assignment's offset is *finished* once its terminal reply and event were acknowledged
by the broker (or it was dropped: duplicate, stale, undecodable and dead-lettered). The
commit point is the lowest offset still open (every offset below it is finished), or one
past the highest offset seen when none is open. Offsets need not be contiguous (a
transactional producer leaves gaps for its control records), so the tracker reasons about
the offsets it was given, never about ``offset + 1``.

Requests finished *above* the commit point would be run again after a restart. The
worker puts them into the commit's metadata string (``encode_done``) and a restarted worker
skips them (``decode_done``): at-least-once, with as few repeats as the metadata bound
allows (Kafka's ``offset.metadata.max.bytes`` defaults to 4096).

Memory is bounded: at most ``max_finished`` finished offsets above the commit point are
kept (the lowest ones go first once there are more: the metadata lists a few hundred at
most anyway). One forgotten is merely not skipped if it is delivered again, which the
at-least-once contract allows (the worker's dedupe ledger still drops a repeat it knows).
"""

from __future__ import annotations

from typing import Final

#: Prefix of the metadata format ("finished offsets, as deltas from the commit point").
_DONE_PREFIX: Final = "llmq-done:"


class OffsetTracker:
    """Open and finished offsets of one partition; :meth:`commit_point` is safe to commit."""

    def __init__(self, committed: int | None = None, done: set[int] | None = None,
                 max_finished: int = 1 << 14) -> None:
        if max_finished < 1:
            raise ValueError("max_finished must be >= 1")
        self._max_finished = max_finished
        #: Offsets below this are finished (the last committed point).
        self._floor = committed if committed is not None else -1
        self._open: set[int] = set()
        self._finished: set[int] = {o for o in (done or ()) if o >= self._floor}
        # Restart hints do not count as seen: the records between the floor and them
        # are read again first.
        self._last_seen = self._floor - 1

    @property
    def open(self) -> int:
        return len(self._open)

    def begin(self, offset: int) -> bool:
        """Track a record; False if it was seen already (a redelivery): skip it then."""
        if offset < self._floor or offset in self._open:
            return False
        self._last_seen = max(self._last_seen, offset)
        if offset in self._finished:
            return False
        self._open.add(offset)
        return True

    def finish(self, offset: int) -> None:
        """The record at ``offset`` needs nothing more. Unknown offsets are ignored."""
        if offset in self._open:
            self._open.remove(offset)
            self._finished.add(offset)
            if len(self._finished) > self._max_finished:
                # Forget the lowest quarter at once: amortised O(1) per finish.
                keep = self._max_finished - self._max_finished // 4
                self._finished = set(sorted(self._finished)[-keep:])

    def commit_point(self) -> int | None:
        """Offset to commit (the next record to read after a restart); None before any."""
        if self._open:
            return min(self._open)
        if self._last_seen < 0 and self._floor < 0:
            return None
        return max(self._floor, self._last_seen + 1)

    def done_above(self) -> list[int]:
        """Finished offsets above the commit point, ascending (for the commit metadata)."""
        point = self.commit_point()
        if point is None:
            return []
        return sorted(o for o in self._finished if o >= point)

    def committed(self, offset: int) -> None:
        """Record that ``offset`` was committed."""
        self._floor = max(self._floor, offset)
        # Finished offsets below it are covered by it now: forget them. Not before: until a
        # commit succeeds, a rebalance may deliver them again, and they must be skipped.
        self._finished = {o for o in self._finished if o >= self._floor}


def encode_done(point: int, done: list[int], max_chars: int = 4000) -> str:
    """Metadata listing finished offsets above ``point`` (as deltas), cut to ``max_chars``."""
    out = _DONE_PREFIX
    for i, offset in enumerate(done):
        piece = ("," if i else "") + str(offset - point)
        if len(out) + len(piece) > max_chars:
            break  # the rest will simply be run again after a restart
        out += piece
    return out


def decode_done(point: int, metadata: str | None) -> set[int]:
    """Offsets listed by :func:`encode_done`; empty for anything else (never raises)."""
    if not metadata or not metadata.startswith(_DONE_PREFIX):
        return set()
    body = metadata.removeprefix(_DONE_PREFIX)
    out: set[int] = set()
    for part in body.split(","):
        if part.isdigit():
            out.add(point + int(part))
    return out
