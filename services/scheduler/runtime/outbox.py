"""The outbox: effects waiting to be produced, sent in batches, acked when durable.

:meth:`Outbox.submit` queues :class:`Effect` values; :meth:`Outbox.flush` hands every
record that is due to the producer at once (no waiting per record), then waits — bounded
by ``timeout_s`` — for the broker to acknowledge the batch, and returns the tickets of the
effects that are now complete. An effect's ``then`` records go out only after its
``first`` records were acknowledged (a terminal event after its reply). A record that
failed or was not acknowledged in time is sent again on the next flush; its source record
stays unacknowledged meanwhile, so a crash redelivers rather than loses it. (A retry may
duplicate a record the broker did take: workers and clients drop duplicates by
``(request_id, attempt)``.)

Bounded through an outage: an effect submitted with a ``key`` (a periodic snapshot, such
as the queue statuses) replaces any effect of that key still waiting, so the newest one
alone goes out and the outbox does not grow by one per period while the broker is away.
And one flush round has one deadline, ``timeout_s`` from its start, for every send and
ack in it: records it had no time to hand over wait, untouched, for the next flush, so a
round takes about ``timeout_s`` however many records wait (not records × ``timeout_s``).

Knows nothing of Kafka: ``send`` enqueues one record and returns its delivery future (an
aiokafka producer's ``send`` does exactly that).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass

from services.scheduler.runtime.messages import Outgoing
from services.scheduler.runtime.results import Effect, Ticket

#: Enqueue one record; the returned awaitable resolves once the broker acknowledged it.
Send = Callable[[Outgoing], Awaitable[Awaitable[object]]]

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    effect: Effect
    stage: int = 0  # 0: first, 1: then, 2: complete
    failures: int = 0
    not_before: float = 0.0  # monotonic time of the next try after a failure
    key: Hashable | None = None  # a newer effect of the same key replaces this one

    def due(self) -> tuple[Outgoing, ...]:
        if self.stage == 0:
            return self.effect.first
        return self.effect.then if self.stage == 1 else ()

    def advance(self) -> None:
        self.stage += 1
        while self.stage < 2 and not self.due():
            self.stage += 1


class Outbox:
    """Effects in flight (module docstring). One ``flush`` runs at a time."""

    def __init__(
        self,
        send: Send,
        timeout_s: float = 10.0,
        *,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._queue: list[_Pending] = []
        self._lock = asyncio.Lock()
        #: Records that failed or timed out since start (for metrics and tests).
        self.failures = 0

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, effects: Iterable[Effect], *, key: Hashable | None = None) -> None:
        """Queue ``effects``. With a ``key``, they replace every effect of that key still
        waiting (module docstring): only snapshots, which carry no tickets, should have one.
        One still in flight in a running flush is dropped from the queue all the same."""
        if key is not None:
            self._queue = [p for p in self._queue if p.key != key]
        for effect in effects:
            pending = _Pending(effect, -1, key=key)
            pending.advance()
            self._queue.append(pending)

    def topics(self) -> set[str]:
        """Topics of every record still due (to create missing reply topics first)."""
        return {out.topic for p in self._queue for out in p.due()}

    async def flush(self) -> list[Ticket]:
        """Send what is due, wait for the broker, return tickets of completed effects."""
        async with self._lock:
            done: list[Ticket] = []
            for _ in range(2):  # at most two stages per effect
                progressed = await self._round()
                kept: list[_Pending] = []
                for pending in self._queue:
                    if pending.stage >= 2:
                        done.extend(pending.effect.tickets)
                    else:
                        kept.append(pending)
                self._queue = kept
                if not progressed:
                    break
            return done

    async def _round(self) -> bool:
        """One send-and-wait over every due stage; True if a stage completed and the
        effect still has another to send."""
        now = self._clock()
        batch = [p for p in self._queue if p.stage < 2 and p.not_before <= now]
        if not batch:
            return False
        deadline = now + self._timeout_s  # one for the whole round (module docstring)
        futures: dict[int, list[asyncio.Future[object]]] = {}
        failed: set[int] = set()
        untried: set[int] = set()
        for i, pending in enumerate(batch):
            if deadline - self._clock() <= 0:
                untried.add(i)  # no time left this round: as it was, for the next flush
                continue
            for out in pending.due():
                left = deadline - self._clock()
                try:
                    if left <= 0:
                        raise TimeoutError("the flush round's time ran out")
                    delivery = await asyncio.wait_for(self._send(out), left)
                except Exception:  # timeout or producer error: retried next flush
                    _log.warning("outbox: could not send to %s", out.topic, exc_info=True)
                    failed.add(i)
                    break
                futures.setdefault(i, []).append(asyncio.ensure_future(delivery))
        every = [f for fs in futures.values() for f in fs]
        if every:
            # asyncio.wait, not wait_for: a timeout must not cancel deliveries in flight.
            await asyncio.wait(every, timeout=max(0.0, deadline - self._clock()))
        more = False
        for i, pending in enumerate(batch):
            if i in untried:
                continue
            # Look at every future (retrieving each exception keeps asyncio quiet).
            acked = [_acknowledged(f) for f in futures.get(i, [])]
            ok = i not in failed and all(acked)
            if not ok:
                # Resend later, backing off while the broker keeps refusing.
                self.failures += 1
                pending.failures += 1
                delay = self._backoff_s * 2 ** min(pending.failures - 1, 16)
                pending.not_before = now + min(self._max_backoff_s, delay)
                if i not in failed:
                    _log.warning("outbox: %d record(s) not acknowledged, will resend",
                                 len(pending.due()))
                continue
            pending.failures = 0
            pending.advance()
            more = more or pending.stage < 2
        return more


def _acknowledged(future: asyncio.Future[object]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
