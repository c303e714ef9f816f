"""Faust wiring of the scheduler: agents, the log reader, the dispatch loop. No decisions —
every input goes to :class:`~services.scheduler.runtime.state.SchedulerState`, which calls
the core; this module moves records between Kafka and it.

What runs (one process, one event loop):

1. **log reader** (:class:`~services.common.log_reader.LogReader`, plain aiokafka,
   no group): ``llmq.heartbeats`` → fleet view, ``llmq.assignments`` + ``llmq.events`` →
   assignment log → ledger. This is the documented equivalent of a ``GlobalTable`` of
   workers (faust 0.15 wants a table to own its changelog; the heartbeat topic is the
   workers' own compacted topic), and it is also how a restart rebuilds the ledger: the
   reader replays all three topics from the beginning, the ledger is rebuilt from the
   active assignments (``SchedulerState.restore``), and only then are requests consumed.
   Every replica reads every event, so releases reach whichever replica holds a
   reservation.
2. **agent ``scheduler-requests``** on the six request topics, ``stream.noack()``: each
   admitted request goes into the pending queue unacknowledged; its record is acked once
   the assignment (or terminal reply + event) produced for it was acknowledged by the
   broker, strictly in offset order per partition (:class:`OrderedAcks`: faust 0.15 would
   otherwise commit past a pending record). A redelivered request that was already
   assigned or finished is acked and skipped. After a rebalance the agent first waits
   until the reader has caught up with the assignments and events topics, so a request
   the previous owner assigned is recognised (a failing read is tried again; a record
   that waited through yet another rebalance is left to its partition's owner).
3. **``llmq.control``**, read by the log reader too (every replica reads every command):
   cancels go to the state, where the replica holding the request pending ends it and
   the others remember it; drains need nothing here (the worker's heartbeat says
   ``draining`` and the core's not-draining filter does the rest).
4. **dispatch loop**: every ``dispatch_interval_s`` and whenever woken (an arrival, a
   release, a cancel, a reader batch; with several replicas and requests waiting, a log
   read newer than the last cycle's, as a worker's turn may have opened): worker loss
   (on faust's leader only: every replica reads every assignment, one acts on a loss),
   one ``schedule()`` call, effects into the outbox, one batched flush, acks,
   pause/resume of request topics, and every ``status_interval_s`` a ``QueueStatus`` per
   model.

Every record is handled inside a :class:`~services.common.guard.Guard`: one bad record goes
to ``llmq.deadletter`` and the agent goes on. Records are consumed raw
(``value_serializer="raw"``) and decoded with ``schemas.codec.decode`` inside the guard.

Faust settings beyond ``make_app``'s (why):

- ``stream_wait_empty=False``: requests stay unacked while they wait in the queue, for
  as long as their deadline allows. Faust would wait for every one of them before a
  rebalance or a stop completes; they are redelivered instead (and recognised).
- ``broker_commit_livelock_soft_timeout`` = one hour: a partition whose head request waits
  for capacity commits nothing meanwhile, by design; faust's 5-minute "commit did not
  advance" warning would fire for every such partition.

Pausing: ``app.consumer.pause_partitions`` drops records of a just-paused partition that
faust had already fetched into the batch it is iterating, while the fetch position has
moved past them (faust would later count them as a gap and commit past them). So a
partition is paused only once the agent has received a record from it, and resumed only
after seeking it back to one past the last record received (copies that follow are
ignored by offset). A rebalance resumes every partition and seeks to the committed
offsets; the next cycle pauses again what the queue still wants paused. A partition also
pauses while it holds ``max_held_per_partition`` records not yet committed: a head that
waits keeps every record done behind it in memory (``runtime.flow.OrderedAcks.over``).

Producing: one idempotent aiokafka producer (``acks=all``) for everything the scheduler
writes; sends are batched per cycle and bounded by ``send_timeout_s``. A client's reply
topic is made on first use in the background (``runtime.topics.ReplyTopics``); records to
it wait meanwhile, and are given up after ``reply_give_up_s`` or at once on an error no
retry mends (``runtime.outbox``), so one tenant's topic never holds back the rest.

Observability: each cycle's figures go to :class:`SchedulerMetrics` (queue depth, wait at
placement, ``schedule()`` latency, deferrals by reason, requeues, worker losses, reserved
KV per worker, the scheduler's own terminals). Trace context comes in with each request
and assignment record's headers and goes out on every record produced for the request;
the state writes the ``llmq.queue`` and ``llmq.placement`` spans through
:class:`~services.common.tracing.HeaderSpans`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import faust
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    InvalidTopicError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
)
from mode import Service

from schemas.codec import FieldError, SchemaError, decode
from schemas.control import CancelRequest
from schemas.messages import (
    ASSIGNMENT_ADAPTER,
    CONTROL_ADAPTER,
    EVENT_ADAPTER,
    HEARTBEAT_ADAPTER,
    REQUEST_ADAPTER,
)
from services.common import tracing
from services.common.answered import answered
from services.common.faust_app import make_app
from services.common.groups import group_members
from services.common.guard import Guard, Headers
from services.common.kafka import ProducerFailed, ensure_topics, exit_now, make_producer
from services.common.log_reader import LogReader
from services.common.settings import Settings
from services.scheduler import build_pipeline
from services.scheduler.runtime.flow import OrderedAcks, PauseLadder
from services.scheduler.runtime.messages import Outgoing
from services.scheduler.runtime.metrics import SchedulerMetrics
from services.scheduler.runtime.outbox import Outbox
from services.scheduler.runtime.results import Effect, HeldRequeue, RuntimeConfig, Ticket
from services.scheduler.runtime.state import SchedulerState
from services.scheduler.runtime.topics import ReplyTopics, SchedulerTopics
from services.scheduler.runtime.turns import shared, turns_of
from services.scheduler.settings import SchedulerSettings

_log = logging.getLogger("services.scheduler")
#: Besides at every rebalance, a replica re-reads the group's members this often.
_TURNS_EVERY_S = 30.0
#: How often a paused dispatch loop looks for a newer log read (several replicas only).
_READ_CHECK_S = 0.005
#: A worker heartbeating a partition the topic lacks is logged again every so many beats.
_STRAY_LOG_EVERY = 60
#: Stray worker processes remembered (one dead letter each); beyond, the oldest is
#: forgotten and dead-lettered again if it still beats (an audit: one per process, kept).
_STRAYS_KEPT = 1_000
#: A heartbeats partition not read to its end this long is warned of (_warn_unread).
_UNREAD_WARN_S = 60.0
_RAW: dict[str, Any] = {
    "key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw",
}


@dataclass(frozen=True, slots=True)
class SchedulerRuntime:
    """What the scheduler is built from (``__main__`` makes it)."""

    settings: Settings
    scheduler: SchedulerSettings
    topics: SchedulerTopics
    clock: Callable[[], float] = time.time

    @property
    def app_id(self) -> str:
        return app_id(self.settings, self.scheduler)


@dataclass(frozen=True, slots=True)
class SchedulerApp:
    """The built Faust app and the scheduler it runs."""

    app: faust.App
    scheduler: Scheduler


def app_id(settings: Settings, scheduler: SchedulerSettings) -> str:
    """Faust app id (= consumer group): ``<topic_prefix>-<app_name>``, as make_app names it."""
    return f"{settings.topic_prefix}-{scheduler.app_name}"


def build_app(rt: SchedulerRuntime) -> SchedulerApp:
    """The Faust app with its agents, rebalance hooks and the scheduler service."""
    app = make_app(
        rt.scheduler.app_name, rt.settings,
        datadir=str(rt.settings.home / "faust" / rt.app_id),
        # Members of the group are told apart by it: the replicas' turns (runtime.turns).
        broker_client_id=rt.scheduler.resolved_scheduler_id(),
        stream_wait_empty=False,
        broker_commit_livelock_soft_timeout=3600.0,
    )
    sched = Scheduler(rt, app)

    @app.agent(app.topic(*rt.topics.request_names, **_RAW), name="scheduler-requests")
    async def requests(stream: Any) -> None:
        await sched.ready.wait()
        async for event in stream.noack().events():
            await sched.on_request_event(event)

    # cast: mode types receivers with mypy_extensions' VarArg/NamedArg, which mypy 2 no
    # longer matches against any function; the receivers have the documented signature.
    app.on_partitions_revoked.connect(cast(Any, sched.on_revoked))
    app.on_partitions_assigned.connect(cast(Any, sched.on_assigned))
    app.service(_scheduler_service(sched))
    return SchedulerApp(app, sched)


class Scheduler:
    """The scheduler's I/O around one :class:`SchedulerState` (module docstring)."""

    def __init__(self, rt: SchedulerRuntime, app: faust.App) -> None:
        cfg, topics = rt.scheduler, rt.topics
        self.rt = rt
        self.app = app
        self.clock = rt.clock
        self.state = SchedulerState(
            RuntimeConfig(
                scheduler_id=cfg.resolved_scheduler_id(),
                assignments_topic=topics.assignments,
                events_topic=topics.events,
                status_topic=topics.status,
                control_topic=topics.control,
                replies_prefix=f"{topics.prefix}.replies.",
                default_block_size=cfg.default_block_size,
                max_placements=cfg.max_placements_per_cycle,
                kv_safety_margin=cfg.kv_safety_margin,
                turn_slot_s=cfg.turn_slot_s,
                turn_guard_s=cfg.turn_guard_s,
                heartbeat_staleness=cfg.heartbeat_staleness,
                handoff_ttl_s=cfg.handoff_ttl_s,
                takeover_s=cfg.takeover_s,
                drain_window_s=cfg.drain_window_s,
                cancel_memory_s=cfg.cancel_memory_s,
                finished_memory_s=cfg.finished_memory_s,
            ),
            cfg.queue_config(),
            build_pipeline(cfg.profile()),
            random.Random(cfg.seed),
            tracing.HeaderSpans("services.scheduler"),
        )
        self.metrics = SchedulerMetrics()
        self.acks: OrderedAcks[Any] = OrderedAcks()
        self.ladder = PauseLadder(cfg.max_pending, cfg.pause_band, cfg.resume_hysteresis)
        own = topics.own()
        self.outbox = Outbox(self._send, cfg.send_timeout_s,
                             expendable=lambda topic: topic not in own,
                             give_up_s=cfg.reply_give_up_s, refused=_refused_for_good)
        self.reply_topics = ReplyTopics(
            topics, lambda request: ensure_topics(
                rt.settings.bootstrap, [request],
                replication_factor=rt.settings.replication_factor),
            self._wake)
        self.guard = Guard(self._dead_letter, name="scheduler", logger=_log)
        self.reader = LogReader(
            rt.settings.bootstrap,
            {
                topics.heartbeats: self._on_heartbeat,
                topics.assignments: self._on_assignment,
                topics.events: self._on_event,
                topics.control: self._on_control,
            },
            self.guard,
            on_batch=self._wake,
            name="scheduler-log-reader",
        )
        self.ready = asyncio.Event()
        self.wake = asyncio.Event()
        self._stopping = False  # the dispatch loop ends at its next turn (request_stop)
        self._unread_warned_at = -math.inf  # _warn_unread
        self._topic_keys = dict((topic, key) for key, topic in topics.requests)
        self._paused: set[Any] = set()
        self._full: set[Any] = set()  # request partitions paused for the records they hold
        self._barrier_needed = False
        # Bumped by every rebalance: a record that waited through one (in the barrier) is
        # no longer ours to handle; its partition's owner reads it again.
        self._generation = 0
        self._producer: Any = None
        self._main_task: asyncio.Task[None] | None = None
        self._turns_task: asyncio.Task[None] | None = None
        self._turns_read: asyncio.Future[None] | None = None  # started at the last rebalance
        # Reads of the turns overlap (one per rebalance, one every _TURNS_EVERY_S): each is
        # numbered as it starts, and one started before the last applied is not applied.
        self._turns_reads = self._turns_read_applied = 0
        self._led_until_revoked = False  # held faust's leader partition until the revoke
        self._led_in: int | None = None  # the group generation it was assigned it in
        # Set, or from the group at the first rebalance (alone until then, and not warning
        # of others' placements for a moment: they may be replicas it has not read yet).
        static = cfg.static_turns()
        turns = static or (1, 0)
        self.state.set_turns(turns, build_pipeline(cfg.profile(turns)),
                             0.0 if static else rt.clock())
        # worker_lost endings being checked against their reply topics (services.common.answered)
        self._checks: set[asyncio.Task[None]] = set()
        # (worker id, started_at) of heartbeats naming no partition of the assignments
        # topic: each one's first was dead-lettered; how many came since (_on_heartbeat).
        self._strays: dict[tuple[str, float], int] = {}

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.rt.scheduler
        self._stopping = False
        if cfg.takeover_s <= cfg.send_timeout_s:
            _log.warning("scheduler: LLMQ_SCHEDULER_TAKEOVER_S (%g s) is not above "
                         "LLMQ_SCHEDULER_SEND_TIMEOUT_S (%g s): a new leader may decide a loss "
                         "again while the previous leader's decision is still being sent",
                         cfg.takeover_s, cfg.send_timeout_s)
        self._producer = make_producer(self.rt.settings.bootstrap,
                                       on_failure=self._producer_failed)
        await self._producer.start()
        await self.reader.start()
        self._main_task = asyncio.create_task(self._main(), name="scheduler-dispatch")
        self._main_task.add_done_callback(self._main_ended)
        if self.rt.scheduler.static_turns() is None:
            self._turns_task = asyncio.create_task(self._follow_turns(), name="scheduler-turns")

    def _main_ended(self, task: asyncio.Task[None]) -> None:
        """The dispatch task only ends by cancellation (stop); anything else is a crash of
        the whole process (so a supervisor restarts it), not a scheduler that silently
        stops scheduling while its agents wait for ``ready``."""
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            return
        _log.error("scheduler: the dispatch task failed", exc_info=exc)
        asyncio.ensure_future(self.app.crash(exc))  # noqa: RUF006  # the app ends with it

    def request_stop(self) -> None:
        """End the dispatch loop at its next turn, whatever happens to the cancel that
        follows: Python 3.11's ``asyncio.wait_for`` (in aiokafka and here) returns its
        result and drops a cancel that comes as it ends (gh-86296), and the loop then ran
        on until the stop's bound ran out (exit 1)."""
        self._stopping = True
        self.wake.set()

    def _producer_failed(self, exc: ProducerFailed) -> None:
        """Nothing placed, ended or reported would leave any more: exit 1 at once so a
        supervisor restarts the process with a producer that sends; what was not acked is
        redelivered to it or to another replica."""
        exit_now(exc)

    async def stop(self) -> None:
        """Every wait here is bounded by ``send_timeout_s``; one that runs out is logged by
        name, and the stop's phases and their durations are logged at its end, so a stop
        slower than an orchestrator's grace period says where its time went."""
        limit = self.rt.scheduler.send_timeout_s
        began = time.monotonic()
        took: list[str] = []

        async def phase(name: str, work: Awaitable[Any]) -> None:
            start = time.monotonic()
            try:
                await asyncio.wait_for(work, limit)
            except TimeoutError:
                _log.warning("scheduler: stopping: %s did not end within %.0f s; going on",
                             name, limit)
            except Exception:
                _log.warning("scheduler: stopping: %s failed; going on", name, exc_info=True)
            took.append(f"{name} {time.monotonic() - start:.1f} s")

        self.request_stop()
        tasks = [t for t in (self._main_task, self._turns_task, self._turns_read) if t]
        for task in tasks:
            task.cancel()
        if tasks:
            start = time.monotonic()
            _, stuck = await asyncio.wait(tasks, timeout=limit)
            for task in stuck:  # cancelled, and still not done: say where it waits
                name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
                _log.warning("scheduler: stopping: task %s did not end within %.0f s of its "
                             "cancel; going on. It waits in:\n%s", name, limit, _stack(task))
            took.append(f"tasks {time.monotonic() - start:.1f} s")
        if self._checks:  # the endings they hold would otherwise wait for the next scheduler
            await phase("reply-topic checks", asyncio.wait(self._checks))
            for check in list(self._checks):  # past the bound: they must not outlive the
                check.cancel()  # producer (their effects would go to a dead outbox)
            await asyncio.gather(*self._checks, return_exceptions=True)
        # Unacked requests are redelivered if this does not get through.
        await phase("final flush", self._flush())
        await phase("reply topics", self.reply_topics.stop())
        await phase("log reader", self.reader.stop())
        if self._producer is not None:
            await phase("producer", self._producer.stop())
        _log.info("scheduler: stopped in %.1f s (%s)", time.monotonic() - began,
                  ", ".join(took))

    async def _main(self) -> None:
        cfg = self.rt.scheduler
        try:
            await asyncio.wait_for(self.reader.caught_up.wait(), cfg.catchup_timeout_s)
        except TimeoutError as exc:
            _log.error("scheduler: heartbeats/assignments/events not read to their end "
                       "within %.0f s", cfg.catchup_timeout_s)
            await self.app.crash(exc)
            return
        restored = self.state.restore()
        self.ready.set()
        _log.info(
            "scheduler ready: id %s | app id %s | %d workers known | %d reservations "
            "restored | max_pending %d", self.state.config.scheduler_id, self.rt.app_id,
            len(self.state.fleet), restored, cfg.max_pending,
        )
        await self._dispatch_loop()

    # -- the dispatch loop --------------------------------------------------------------

    def _wake(self) -> None:
        self.wake.set()

    async def _dispatch_loop(self) -> None:
        cfg = self.rt.scheduler
        next_status = 0.0
        read_at = 0.0  # the log read the last cycle placed with
        while not self._stopping:
            await self._pause(read_at)
            if self._stopping:
                return
            self.wake.clear()
            if not self.reader.running:
                # The fleet view and the ledger would freeze: every worker would look lost.
                raise RuntimeError("the heartbeats/assignments/events reader stopped")
            try:
                now = self.clock()
                read_at = self._log_read_at()
                if now >= next_status:
                    next_status = now + cfg.status_interval_s
                    self._publish_status(now)
                await self._cycle(now, read_at)
            except Exception:
                # A bug in one cycle must not stop scheduling: log it, try again shortly.
                _log.exception("scheduler: dispatch cycle failed")
                await asyncio.sleep(0.5)

    async def _pause(self, read_at: float) -> None:
        """Until woken (an arrival, a release, a batch read) or ``dispatch_interval_s``.
        With several replicas and requests pending, also until a log read newer than
        ``read_at`` (the last cycle's) is answered: a worker's turn opens for placement
        only with a fetch answered a guard into it (filter ``replica-turn``), and a
        request waiting for that turn is placed at that fetch, not at the next timer
        (which added up to ``dispatch_interval_s`` to its wait). So while requests wait, a
        cycle follows each fetch answered (about every 50 ms on a quiet topic, the
        reader's poll), whatever ``dispatch_interval_s``; the check for it is finer only
        around the moment the next is due. A reader behind (read 0.0) wakes the loop with
        its batch, so the pause then waits for that."""
        interval = self.rt.scheduler.dispatch_interval_s
        if self.state.turns[0] == 1 or not len(self.state.pending):
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the wait's result
            # when a cancel comes as the wake-up does, and drops the cancel (gh-86296): a
            # stop mid-burst then found the loop running on, and the process exited 1.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.wake.wait()
            return
        deadline = time.monotonic() + interval
        woken = asyncio.ensure_future(self.wake.wait())
        try:
            while (left := deadline - time.monotonic()) > 0 \
                    and (last := self._log_read_at()) <= read_at:
                # The next fetch is answered about a poll after the last (on a quiet
                # topic): look often only from a little before then.
                due = last + self.reader.poll_s - self.clock() if last > 0 else left
                step = max(_READ_CHECK_S, due - _READ_CHECK_S)
                done, _ = await asyncio.wait((woken,), timeout=min(left, step))
                if done:
                    return
        finally:
            woken.cancel()

    async def _cycle(self, now: float, log_read_at: float) -> None:
        # One replica handles worker loss: faust's leader (the leader-assignor partition's
        # owner; a single replica is always it once assigned). Not between a revoke of that
        # partition and the next assignment: faust still answers is_leader() from the old
        # assignment then, and such a tick, after leadership_lapsed, restarted the takeover
        # wait of a leadership that continues (found by a review of c21e40e).
        leads = self.app.is_leader() and not self._led_until_revoked
        heard = self.reader.read_up_to(self.rt.topics.heartbeats)
        self._warn_unread(heard, now)
        result = self.state.tick(now, handle_losses=leads, log_read_at=log_read_at,
                                 heard=heard)
        m = self.metrics
        m.tick(result)
        for worker_id in result.lost_workers:
            _log.warning("scheduler: worker %s is dead (stale heartbeat)", worker_id)
        for worker_id in result.restarted_workers:
            _log.warning("scheduler: worker %s restarted; the work placed on its earlier "
                         "process is requeued (or ended worker_lost if it streamed)", worker_id)
        checked = [e for e in result.effects if e.unless_answered is not None]
        self.outbox.submit([e for e in result.effects if e.unless_answered is None])
        if checked or result.held:  # read in the background: reply topics may take a while
            task = asyncio.create_task(self._send_unless_answered(checked, result.held))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
        await self._flush()
        await self._apply_pauses()
        m.set_depth(self.state.depth())
        m.set_reserved(self.state.reserved_by_worker())
        m.ended(self.state.ended, self.state.requeued)
        if result.more:
            self.wake.set()

    def _warn_unread(self, heard: Mapping[int, float], now: float) -> None:
        """Say (once a minute) which heartbeats partitions have not been read to their end
        for a minute: the losses of their workers wait for them."""
        behind = sorted(p for p, at in heard.items() if 0.0 < at < now - _UNREAD_WARN_S)
        if behind and now >= self._unread_warned_at + _UNREAD_WARN_S:
            self._unread_warned_at = now
            _log.warning("scheduler: heartbeats partition(s) %s not read to their end for "
                         "over %.0f s (leader offline?): losses of the workers there wait "
                         "until they are", behind, _UNREAD_WARN_S)

    def _log_read_at(self) -> float:
        """Up to when the assignments are read: with several replicas, one places on a
        worker in its turn (filter ``replica-turn``) only once its log reader has read the
        assignments written up to that turn's start, so that the last placements of the
        replica whose turn ended are in its ledger (their writes take less than the guard).
        Alone, its own ledger is the truth: no wait."""
        if self.state.turns[0] == 1:
            return math.inf
        return self.reader.caught_up_at(self.rt.topics.assignments)

    async def _send_unless_answered(self, effects: list[Effect],
                                    held: tuple[HeldRequeue, ...] = ()) -> None:
        """Lost attempts whose worker may have answered them and died before the terminal
        event (or a scheduler between its own reply and event), checked against their
        reply topics first (``services.common.answered``): a ``worker_lost`` ending of an answered
        attempt keeps only its terminal event, and a held requeue of one is not requeued.
        A replica that stopped leading meanwhile sends neither: the leader decides them
        (``SchedulerState.settle_endings``, ``SchedulerState.release``)."""
        checks = [c for c in (e.unless_answered for e in effects) if c is not None]
        checks += [h.check for h in held]
        wanted = {(c[0], c[1]): (c[2], c[3], c[4]) for c in checks}
        check = await answered(self.rt.settings.bootstrap, wanted,
                               self.rt.scheduler.send_timeout_s)
        found = check.found
        if not check.complete:
            _log.warning("scheduler: the reply-topic check of %d lost attempt(s) was cut "
                         "short (%.0f s limit, or the error above) after %d records, newest "
                         "first, %d found answered: the rest are ended or requeued as if "
                         "unanswered", len(wanted), self.rt.scheduler.send_timeout_s,
                         check.records_read, len(found))
        now = self.clock()
        out = self.state.settle_endings(effects, found, now)
        for h in held:
            out.extend(self.state.release(h, h.check[:2] in found, now))
        self.outbox.submit(out)
        self.wake.set()  # the next cycle flushes them (and places the requeues)

    def _publish_status(self, now: float) -> None:
        statuses = self.state.statuses(now)
        if statuses:
            topic = self.rt.topics.status
            # Keyed: a newer snapshot replaces one a broker outage still holds back
            # (the topic is compacted by model; only the newest counts).
            self.outbox.submit([Effect(first=tuple(Outgoing.of(topic, s) for s in statuses))],
                               key=topic)
        self.metrics.forget_workers(self.state.prune(now))

    async def _flush(self) -> None:
        outbox = self.outbox
        # Records to a reply topic not made yet wait; the rest go (runtime.outbox).
        held = self.reply_topics.held(outbox.topics())
        failures, given_up = outbox.failures, outbox.given_up
        tickets = await outbox.flush(held)
        self.reply_topics.recheck(outbox.failed_topics)
        outbox.failed_topics.clear()
        self.metrics.plumbing(len(self.ladder.paused), len(outbox),
                              outbox.failures - failures, outbox.given_up - given_up)
        self._ack(tickets)

    def _ack(self, tickets: list[Ticket]) -> None:
        for tp, offset in tickets:
            for event in self.acks.done(tp, offset):
                event.ack()

    # -- backpressure -------------------------------------------------------------------

    async def _apply_pauses(self) -> None:
        self.ladder.update(len(self.state.pending))
        consumer = self.app.consumer
        try:
            assigned = consumer.assignment()
        except Exception:  # not started or between generations: next cycle
            return
        # Only partitions that delivered a record since they were assigned are paused: for
        # them the agent knows where to resume (module docstring). One that delivered
        # nothing yet is paused right after its first record.
        cfg = self.rt.scheduler
        cap = cfg.max_held_per_partition
        full = self.acks.over(cap, max(1, cap - math.ceil(cfg.resume_hysteresis * cap)))
        for tp in full - self._full:
            _log.warning("scheduler: %s holds %d records not yet committed (behind a request "
                         "still waiting): paused until it holds fewer", tp,
                         self.acks.outstanding(tp))
        self._full = full
        wanted = {
            tp for tp in assigned
            if (self._topic_keys.get(tp.topic) in self.ladder.paused or tp in full)
            and self.acks.next_offset(tp) is not None
        }
        if wanted:
            consumer.pause_partitions(wanted)  # idempotent; a rebalance resumes everything
        resume = {tp for tp in self._paused - wanted if tp in assigned}
        self._paused = wanted
        if resume:
            try:
                await self._resume(resume)
            except Exception:
                self._paused |= resume  # retried next cycle
                raise

    async def _resume(self, tps: set[Any]) -> None:
        """Seek back to one past the last record received, then resume (module docstring)."""
        consumer = self.app.consumer
        for tp in tps:
            offset = self.acks.next_offset(tp)
            if offset is not None:
                await consumer.seek(tp, offset)
        consumer.resume_partitions(tps)
        _log.info("scheduler: resumed %d request partition(s)", len(tps))

    # -- agents -------------------------------------------------------------------------

    async def on_request_event(self, event: Any) -> None:
        generation = self._generation
        if self._barrier_needed:
            await self._catch_up(generation)
            if self._generation != generation:
                # Another rebalance while this record waited: its partition was revoked
                # (and maybe given back), so it is redelivered to whoever owns it now.
                # Handling it here too could place it twice.
                return
        message = event.message
        if not self.acks.received(message.tp, message.offset, event):
            return  # a copy of a record already received (redelivery after a seek)
        ticket: Ticket = (message.tp, message.offset)
        handled = await self.guard.run(message, partial(self._on_request, message, ticket))
        if handled is None:  # dead-lettered: answered if it says who waits, and done with
            try:
                done = self.state.on_unreadable(message.value, ticket, self.clock())
            except Exception:  # a bug there must not leave the ticket unacked (commits stall)
                _log.exception("scheduler: answering an unreadable request record failed")
                done = [Effect(tickets=(ticket,))]
            self.outbox.submit(done)
        self.wake.set()

    async def _catch_up(self, generation: int) -> None:
        """Read assignments and events up to their end before the first request after a
        rebalance. Nothing may escape here: this runs before the record is tracked, so an
        exception would lose it (faust restarts the agent without it, and later offsets'
        acks commit past it). A failing read (the broker away) is tried again until
        ``catchup_timeout_s``; after that the agent goes on as not caught up."""
        topics = {self.rt.topics.assignments, self.rt.topics.events}
        timeout_s = self.rt.scheduler.catchup_timeout_s
        deadline = time.monotonic() + timeout_s
        caught_up = failed = False
        while not caught_up and self._generation == generation:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                caught_up = await self.reader.barrier(topics, left)
            except Exception:
                if not failed:  # once: it fails the same way every half second
                    _log.warning("scheduler: reading up to the log's end failed; trying "
                                 "again until caught up", exc_info=True)
                failed = True
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            else:
                break
        if self._turns_read is not None:  # a replica may have joined or left: its turns
            try:
                await asyncio.shield(self._turns_read)
            except Exception:
                _log.exception("scheduler: reading the replicas' turns failed")
        if self._generation == generation:
            self._barrier_needed = False
            if not caught_up:
                _log.warning("scheduler: assignments/events not caught up after rebalance "
                             "(%.0f s)", timeout_s)

    # -- replicas' turns ----------------------------------------------------------------

    async def _read_turns(self) -> None:
        """Take this replica's turn (``runtime.turns``) from the consumer group's members,
        unless set (``LLMQ_SCHEDULER_REPLICAS``). Read at every rebalance (every replica
        joining or leaving causes one), waited for before the first request after it, and
        every ``_TURNS_EVERY_S`` besides. A failed read keeps the turns as they were (alone, at
        start) and says so."""
        cfg = self.rt.scheduler
        if cfg.static_turns() is not None:
            return
        self._turns_reads += 1
        read = self._turns_reads
        admin = AIOKafkaAdminClient(bootstrap_servers=self.rt.settings.bootstrap,
                                    request_timeout_ms=5_000)
        try:
            await asyncio.wait_for(admin.start(), 5.0)
            members = await asyncio.wait_for(group_members(admin, self.rt.app_id, 5.0), 10.0)
        except Exception as exc:
            _log.warning("scheduler: could not read the replicas of group %s (%r); placing in "
                         "the turns of %d replica(s) as before", self.rt.app_id, exc,
                         self.state.turns[0])
            return
        finally:
            await admin.close()
        ids = [m.client_id for m in members]
        if shared(ids):
            _log.error("scheduler: replicas %s share a scheduler id: they take the same turns "
                       "and can overcommit workers; give each its own "
                       "LLMQ_SCHEDULER_SCHEDULER_ID", shared(ids))
        if read < self._turns_read_applied:
            return  # a read started later (a newer rebalance's) answered first: it stands
        self._turns_read_applied = read
        turns = turns_of(ids, self.state.config.scheduler_id)
        if turns is None or turns == self.state.turns:
            return
        self.state.set_turns(turns, build_pipeline(cfg.profile(turns)), self.clock())
        _log.info("scheduler: %d replica(s) in group %s, this one places in turn %d%s",
                  turns[0], self.rt.app_id, turns[1],
                  "" if turns[0] > 1 else " (alone: no turns)")

    async def _follow_turns(self) -> None:
        while True:
            await asyncio.sleep(_TURNS_EVERY_S)
            try:
                await self._read_turns()
            except Exception:
                _log.exception("scheduler: reading the replicas' turns failed")

    async def _on_request(self, message: Any, ticket: Ticket) -> bool:
        admitted = decode(message.value, REQUEST_ADAPTER)
        trace = tuple(tracing.headers_of(message))
        self.outbox.submit(self.state.on_request(admitted, ticket, self.clock(), trace))
        return True

    async def on_revoked(self, sender: Any, *args: Any, signal: Any, **_: Any) -> None:
        """Pending requests of revoked partitions go to their new owner (never acked by us
        from now on); what is in flight is flushed so the new owner reads it back. What of
        theirs did not get through by then is taken back, not sent later: the new owner,
        having read the log to its end without it, decides those requests again. Never
        handed to the producer, it is forgotten here too (the log and ledger read as if it
        had never been decided); handed over but not acknowledged, it may still land: a
        request run twice at worst, as before, but no longer for every later flush.
        (A faust signal receiver: ``args[0]`` is the set of revoked partitions.)"""
        self._generation += 1
        revoked: set[Any] = set(args[0]) if args else set()
        self._led_until_revoked = self._leader_tp() in revoked
        if self._led_until_revoked:
            self.state.leadership_lapsed(self.clock())
        mine = {tp for tp in revoked if tp.topic in self._topic_keys}
        dropped = self.state.drop_sources(mine, self.clock())
        self.acks.forget(mine)
        self._paused -= mine
        if dropped:
            _log.info("scheduler: %d pending request(s) left with revoked partitions", dropped)
        began = time.monotonic()
        try:
            await asyncio.wait_for(self._flush(), self.rt.scheduler.send_timeout_s)
        except Exception:
            _log.warning("scheduler: flush at rebalance incomplete", exc_info=True)
        if (took := time.monotonic() - began) >= 1.0:
            _log.info("scheduler: the flush at the rebalance took %.1f s", took)
        unsent, uncertain = await self.outbox.withdraw(mine, self.rt.scheduler.send_timeout_s)
        now = self.clock()
        taken_back = sum(self.state.withdraw(effect, now) for effect in unsent)
        if unsent:
            _log.warning("scheduler: %d decision(s) for revoked partitions did not get through "
                         "before the rebalance (%d taken back; %d of them sent but not "
                         "acknowledged, so they may yet land: such a request may run twice); "
                         "their requests go to the new owner", len(unsent), taken_back,
                         uncertain)

    def _leader_tp(self) -> tuple[str, int]:
        """The partition whose owner is faust's leader (``LeaderAssignor._leader_tp``, of
        the app whose id is ``app_id``; a faust TP is a (topic, partition) tuple)."""
        return (f"{self.rt.app_id}-__assignor-__leader", 0)

    async def on_assigned(self, sender: Any, *args: Any, signal: Any, **_: Any) -> None:
        """Before the next request: read assignments and events up to their end now."""
        self._generation += 1
        self._barrier_needed = True
        assigned: set[Any] = set(args[0]) if args else set()
        # Leading still, and in the generation right after the one it led in (a replica
        # dropped from the group, and led by another meanwhile, comes back at a later one).
        found = getattr(self.app, "consumer_generation_id", None)
        generation = found if isinstance(found, int) else None
        leads = self._leader_tp() in assigned and generation is not None
        continued = leads and self._led_until_revoked and self._led_in is not None \
            and generation == self._led_in + 1
        self.state.leadership_continued(continued)  # False too: no flag left from before
        if continued:
            _log.info("scheduler: still leading in generation %d: no takeover wait",
                      generation)
        self._led_in = generation if leads else None
        self._led_until_revoked = False
        if self.rt.scheduler.static_turns() is None:  # read now, waited for by the barrier
            self._turns_read = asyncio.ensure_future(self._read_turns())

    # -- log reader handlers (synchronous; the reader runs them in its guard) -----------

    def _on_heartbeat(self, record: Any) -> None:
        if record.value is None:
            if record.key is not None:
                self.state.forget_worker(record.key.decode(errors="replace"))
            return
        hb = decode(record.value, HEARTBEAT_ADAPTER)
        slots = self.reader.partitions(self.rt.topics.assignments)
        if hb.partition not in slots:
            # Placements there could never be sent (nor read back): the request would
            # wait on a worker that never gets it. Workers check their slot at start, so
            # this is a worker of a bigger topic (partitions added after this scheduler
            # started) or not one of llmq's. Its first heartbeat is dead-lettered; the
            # rest of the same process only counted, not one dead letter a second.
            stray = (hb.worker_id, hb.started_at)
            if stray in self._strays:
                self._strays[stray] += 1
                if self._strays[stray] % _STRAY_LOG_EVERY == 0:
                    _log.warning("scheduler: worker %s still heartbeats partition %d, which "
                                 "%s does not have (%d heartbeats since the dead letter)",
                                 hb.worker_id, hb.partition, self.rt.topics.assignments,
                                 self._strays[stray])
                return
            self._strays[stray] = 0
            while len(self._strays) > _STRAYS_KEPT:  # the oldest first: an id per restart
                del self._strays[next(iter(self._strays))]
            raise SchemaError((FieldError(
                "partition", "out_of_range",
                f"{hb.partition} is not a partition of {self.rt.topics.assignments} "
                f"(0 to {len(slots) - 1} when this scheduler started): worker "
                f"{hb.worker_id!r} was not added to the fleet. Give it a slot of the topic, "
                "or restart the schedulers after adding partitions"),))
        self.state.observe_heartbeat(hb, read_at=self.clock(), source=record.partition)
        if hb.renew:
            self.wake.set()  # a worker holds its output until the next cycle answers it

    def _on_assignment(self, record: Any) -> None:
        assigned = decode(record.value, ASSIGNMENT_ADAPTER)
        self.outbox.submit(
            self.state.observe_assignment(assigned, tuple(tracing.headers_of(record)))
        )

    def _on_event(self, record: Any) -> None:
        # Headers too: a scheduler's terminal event names the admission it ended there.
        self.state.observe_event(decode(record.value, EVENT_ADAPTER),
                                 tuple(tracing.headers_of(record)), read_at=self.clock())

    def _on_control(self, record: Any) -> None:
        # Every replica reads every cancel: the one holding the request pending ends it,
        # the leader its requeues and hand-offs, the others remember it. (Read by a group,
        # a cancel reached one replica, rarely the one holding the request, and a request
        # that waited past the workers' cancel memory then ran to its end.) Replayed ones
        # older than the cancel memory are dropped (RecentCancels.add).
        command = decode(record.value, CONTROL_ADAPTER)
        if isinstance(command, CancelRequest) and self.state.on_cancel(command, self.clock()):
            self.wake.set()

    # -- producing ----------------------------------------------------------------------

    async def _send(self, out: Outgoing) -> Any:
        return await self._producer.send(
            out.topic, out.value, key=out.key, partition=out.partition,
            headers=list(out.headers) or None,
        )

    async def _dead_letter(self, key: bytes | None, value: bytes | None, headers: Headers) -> Any:
        return await asyncio.wait_for(
            self._producer.send_and_wait(
                self.rt.topics.deadletter, value, key=key, headers=headers
            ),
            self.rt.scheduler.send_timeout_s,
        )


def _stack(task: asyncio.Future[Any]) -> str:
    """Where ``task`` waits, following its coroutine's awaits down, for a log line."""
    lines: list[str] = []
    coro: Any = task.get_coro() if isinstance(task, asyncio.Task) else None
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in "
                         f"{frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "\n".join(lines) or "  (no frames)"


def _refused_for_good(exc: BaseException) -> bool:
    """A send error no retry mends (a reply record to it is given up at once)."""
    return isinstance(exc, (TopicAuthorizationFailedError, InvalidTopicError,
                            MessageSizeTooLargeError, RecordTooLargeError))


def _scheduler_service(sched: Scheduler) -> type[Any]:
    """A mode Service (started with the app) that runs the scheduler's own tasks."""

    class SchedulerService(Service):
        async def on_start(self) -> None:
            await sched.start()

        async def on_stop(self) -> None:
            await sched.stop()

    return SchedulerService
