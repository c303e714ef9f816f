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
Records that failed before go last in a round, so one that keeps failing (a send that
waits for a topic's metadata until the deadline) does not hold back the others.

One tenant's reply topic cannot stop the rest. ``flush(held=...)`` names topics whose
records must wait (the app's: reply topics not created yet); the others go on. Records to
an *expendable* topic (the app's: reply topics, which a client named) are given up after
``give_up_s`` without getting through (held, failing or unacknowledged), or at once when
the producer refused them with an error no retry mends (``refused``). A given-up record is
dropped, logged and counted (``given_up``); the rest of its effect goes on, so a terminal
event still follows a reply nobody could receive, and the source record is acked. Records
to other topics (assignments, events, status: llmq's own) are never given up: without
them work would run twice or bookings leak, and only a broker outage stops them.

A rebalance takes effects back (:meth:`Outbox.withdraw`): those whose source records were
on revoked partitions and that did not get through before the revoke completed. Sent
later, they would land after the partition's new owner read the log to its end and
decided the same requests again: a request run twice.

Knows nothing of Kafka: ``send`` enqueues one record and returns its delivery future (an


aiokafka producer's ``send`` does exactly that).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Container, Hashable, Iterable
from dataclasses import dataclass, field

from services.scheduler.runtime.messages import Outgoing
from services.scheduler.runtime.results import Effect, Ticket

#: Enqueue one record; the returned awaitable resolves once the broker acknowledged it.
Send = Callable[[Outgoing], Awaitable[Awaitable[object]]]

_log = logging.getLogger(__name__)


def _never(_: object) -> bool:
    return False


@dataclass(slots=True)
class _Pending:
    effect: Effect
    stage: int = 0  # 0: first, 1: then, 2: complete
    failures: int = 0
    not_before: float = 0.0  # monotonic time of the next try after a failure
    key: Hashable | None = None  # a newer effect of the same key replaces this one
    #: When the current stage first failed or was held back (None: it has not).
    stuck_since: float | None = None
    #: Records of the current stage given up (module docstring).
    dropped: set[Outgoing] = field(default_factory=set)
    #: Delivery futures of every record of the current stage handed to the producer.
    deliveries: list[asyncio.Future[object]] = field(default_factory=list)
    #: A record of the first stage was written (False: none yet, or all given up).
    wrote_first: bool = False

    def due(self) -> tuple[Outgoing, ...]:
        if self.stage == 0:
            records = self.effect.first
        else:
            records = self.effect.then if self.stage == 1 else ()
        if self.dropped:
            return tuple(out for out in records if out not in self.dropped)
        return records

    def advance(self) -> None:
        if self.stage == 0:
            self.wrote_first = any(_acked(d) for d in self.deliveries)
        self.stage += 1
        self.failures = 0
        self.stuck_since = None
        self.dropped = set()
        self.deliveries = []
        while self.stage < 2 and not self.due():
            self.stage += 1

    def stuck(self, now: float) -> None:
        if self.stuck_since is None:
            self.stuck_since = now


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
        expendable: Callable[[str], bool] = _never,
        give_up_s: float = 60.0,
        refused: Callable[[BaseException], bool] = _never,
    ) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._expendable = expendable
        self._give_up_s = give_up_s
        self._refused = refused
        self._queue: list[_Pending] = []
        self._lock = asyncio.Lock()
        #: Records that failed or timed out since start (for metrics and tests).
        self.failures = 0
        #: Records given up since start (module docstring).
        self.given_up = 0
        #: Topics of records that failed since the caller last cleared it (a reply topic
        #: deleted after it was created: the app checks it exists again).
        self.failed_topics: set[str] = set()

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

    async def withdraw(self, sources: Container[Hashable],
                       wait_s: float = 0.0) -> tuple[list[Effect], int]:
        """Take out the effects whose every ticket is on ``sources`` (partitions revoked:
        their records go to a new owner, who must not find these written later) and whose
        first stage is not known written, for the caller to take back what it recorded of
        them. Deliveries still in flight are awaited up to ``wait_s`` first. Returns those
        effects — nothing handed to the producer, every hand-over failed, or still not
        acknowledged after the wait; or a reply given up and its event not handed yet — and
        how many of them were handed over and are still unacknowledged, so perhaps written
        (the producer may still deliver them; they are not sent again). Taken back, such
        a request may run twice, at worst; kept as decided, a delivery that then failed
        left it with no terminal at all when its partition came back to this replica (its
        redelivered record, found placed, was acked). One whose first stage was written
        goes on (a terminal event follows its durable reply)."""
        async with self._lock:
            if wait_s > 0:
                flying = [d for p in self._queue if p.stage == 0 and p.effect.tickets
                          and all(tp in sources for tp, _ in p.effect.tickets)
                          for d in p.deliveries if not d.done()]
                if flying:  # asyncio.wait: a timeout must not cancel deliveries in flight
                    await asyncio.wait(flying, timeout=wait_s)
            unsent: list[Effect] = []
            dropped = 0
            kept: list[_Pending] = []
            for pending in self._queue:
                tickets = pending.effect.tickets
                if not tickets or not all(tp in sources for tp, _ in tickets):
                    kept.append(pending)
                elif pending.stage == 0 and any(_acked(d) for d in pending.deliveries):
                    pending.advance()  # written after all (a flush cut short): it goes on
                    if pending.stage < 2:
                        kept.append(pending)
                elif pending.stage == 0 and any(not d.done() for d in pending.deliveries):
                    dropped += 1
                    unsent.append(pending.effect)
                elif pending.stage == 0 or (pending.stage == 1 and not pending.wrote_first
                                            and not pending.deliveries):
                    unsent.append(pending.effect)
                else:
                    kept.append(pending)
            self._queue = kept
            return unsent, dropped

    def topics(self) -> set[str]:
        """Topics of every record still due (to create missing reply topics first)."""
        return {out.topic for p in self._queue for out in p.due()}

    async def flush(self, held: Collection[str] = ()) -> list[Ticket]:
        """Send what is due, except to the ``held`` topics (module docstring), wait for
        the broker, return tickets of completed effects."""
        async with self._lock:
            done: list[Ticket] = []
            for _ in range(2):  # at most two stages per effect
                progressed = await self._round(held)
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

    async def _round(self, held: Collection[str]) -> bool:
        """One send-and-wait over every due stage; True if a stage completed and the
        effect still has another to send. What was acknowledged is booked even when the
        round is cancelled (a flush bounded by its caller's timeout, at a revoke, or cut
        at a stop); a stage whose sending the cancel cut stays due, as it was."""
        now = self._clock()
        batch: list[_Pending] = []
        for pending in self._queue:
            if pending.stage >= 2 or pending.not_before > now:
                continue
            if any(out.topic in held for out in pending.due()):
                pending.stuck(now)
                self._give_up_stuck(pending, now, "its topic could not be created")
                if pending.stage >= 2 or any(out.topic in held for out in pending.due()):
                    continue
            batch.append(pending)
        batch.sort(key=lambda p: p.failures)  # stable: the healthy ones first
        deadline = now + self._timeout_s  # one for the whole round (module docstring)
        futures: dict[int, list[tuple[Outgoing, asyncio.Future[object]]]] = {}
        errors: dict[int, list[tuple[Outgoing, BaseException]]] = {}
        tried: list[int] = []
        cut: set[int] = set()  # cancelled while handing its records to the producer
        try:
            for i, pending in enumerate(batch):
                if deadline - self._clock() <= 0:
                    break  # no time left: the rest as they were, for the next flush
                tried.append(i)
                for out in pending.due():
                    left = deadline - self._clock()
                    try:
                        if left <= 0:
                            raise TimeoutError("the flush round's time ran out")
                        # asyncio.timeout, not wait_for, which can drop a cancel.
                        async with asyncio.timeout(left):
                            sent = await self._send(out)
                        delivery = asyncio.ensure_future(sent)
                    except Exception as exc:  # timeout or producer error: retried next flush
                        _log.warning("outbox: could not send to %s", out.topic, exc_info=True)
                        errors[i] = [(out, exc)]
                        break
                    except BaseException:
                        # Cancelled mid-send (aiokafka waiting for a new topic's metadata,
                        # or for room in a full batch): this stage was not all sent, and
                        # booking it as sent lost its records for good.
                        cut.add(i)
                        raise
                    pending.deliveries.append(delivery)
                    futures.setdefault(i, []).append((out, delivery))
            every = [f for fs in futures.values() for _, f in fs]
            if every:
                # asyncio.wait, not wait_for: a timeout must not cancel deliveries in flight.
                await asyncio.wait(every, timeout=max(0.0, deadline - self._clock()))
        finally:
            # A cut stage stays as it was, due at the next flush (the cancel is no failure
            # of the broker's: no backoff; a stop's final flush sends it at once).
            more = self._book(batch, [i for i in tried if i not in cut], futures, errors, now)
        return more

    def _book(self, batch: list[_Pending], tried: list[int],
              futures: dict[int, list[tuple[Outgoing, asyncio.Future[object]]]],
              errors: dict[int, list[tuple[Outgoing, BaseException]]], now: float) -> bool:
        """Book a round's outcome: stages acknowledged advance, the others back off (and
        their expendable records may be given up). Nothing awaits here."""
        more = got_through = False
        for i in tried:
            pending = batch[i]
            sent = i not in errors
            # Look at every future (retrieving each exception keeps asyncio quiet).
            for out, future in futures.get(i, []):
                error = _error(future)
                if error is None:
                    got_through = True
                else:
                    errors.setdefault(i, []).append((out, error))
            if i not in errors:
                pending.advance()
                more = more or pending.stage < 2
                continue
            # Resend later, backing off while the broker keeps refusing.
            self.failures += 1
            pending.failures += 1
            pending.stuck(now)
            delay = self._backoff_s * 2 ** min(pending.failures - 1, 16)
            pending.not_before = now + min(self._max_backoff_s, delay)
            if sent:
                _log.warning("outbox: %d record(s) not acknowledged, will resend",
                             len(errors[i]))
            for out, error in errors[i]:
                self.failed_topics.add(out.topic)
                if self._expendable(out.topic) and self._refused(error):
                    self._drop(pending, out, f"refused for good: {error!r}")
        failed = {out.topic for errs in errors.values() for out, _ in errs}
        if tried and not got_through and (
                len(failed) > 1 or any(not self._expendable(t) for t in failed)):
            # Nothing got through, on more than one topic or on one of llmq's own: the
            # broker is in trouble, not one topic. Its outage is not counted against a
            # record's time to give up (module docstring). One reply topic failing alone
            # (a quiet system, or its backoff never meeting other traffic) is not an
            # outage: counted so, its give-up clock restarted every try, and it was
            # retried for ever while its ticket held its request partition's commits.
            for pending in self._queue:
                if pending.stuck_since is not None:
                    pending.stuck_since = now
        for i in tried:
            pending = batch[i]
            if i in errors:
                self._give_up_stuck(pending, now, "not acknowledged")
                more = self._advance_if_dropped(pending) or more
        return more

    def _give_up_stuck(self, pending: _Pending, now: float, why: str) -> None:
        """Give up the expendable records of a stage stuck for ``give_up_s``."""
        if pending.stuck_since is None or now - pending.stuck_since < self._give_up_s:
            return
        for out in pending.due():
            if self._expendable(out.topic):
                self._drop(pending, out, f"{why} for {now - pending.stuck_since:.0f} s")
        self._advance_if_dropped(pending)

    def _drop(self, pending: _Pending, out: Outgoing, why: str) -> None:
        pending.dropped.add(out)
        self.given_up += 1
        _log.error("outbox: gave up a record to %s (key %r): %s; the rest of its effect "
                   "goes on", out.topic, out.key, why)

    @staticmethod
    def _advance_if_dropped(pending: _Pending) -> bool:
        """A stage whose every record is given up is complete: the next one goes now.
        True if there is one."""
        if pending.stage >= 2 or pending.due():
            return False
        pending.advance()
        pending.not_before = 0.0
        return pending.stage < 2


def _acked(future: asyncio.Future[object]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _error(future: asyncio.Future[object]) -> BaseException | None:
    """The future's failure (a timeout if it is still pending), None if acknowledged."""
    if not future.done():
        return TimeoutError("not acknowledged in time")
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception()
