"""The worker loop: Kafka wiring around one engine (no decisions beyond the core's).

A :class:`Worker` owns slot p = partition p of ``llmq.assignments`` (``services.worker.slot``
explains the lock). Its tasks:

- **consume**: reads its partition, decodes each record (undecodable → dead letter, go
  on), drops what ``core.dedupe`` says to drop, answers late arrivals of recently cancelled
  requests with ``cancelled``, and starts a :class:`RequestRun` for the rest, at most
  ``max_in_flight`` at once (beyond that the partition is paused: Kafka is the queue);
- **control**: every ``CancelRequest`` aborts the matching run (and is remembered for a
  while); a ``DrainWorker`` for this worker starts the drain;
- **heartbeat**: a complete ``WorkerHeartbeat`` every interval, and at once when drain
  begins;
- **commit**: commits the offset below which every assignment is finished (terminal
  acknowledged, or dropped), with the finished offsets above it in the commit metadata
  (``core.offsets``): at-least-once, with as little redo after a restart as possible —
  and none of what was placed on an earlier process of this worker: an assignment stamped
  with another ``worker_started_at`` is dropped (the scheduler requeues or ends that work
  when it sees this process's heartbeat), and an unstamped one the scheduler already ended
  while the slot was down is dropped too (:mod:`services.worker.replay`).

Fencing (:mod:`services.worker.core.lease`): the worker answers its work only while its
newest acknowledged heartbeat is younger than ``lease_beats`` intervals, i.e. before the
scheduler can have declared it dead and given the work away. A process that finds its lease
lapsed (it was paused, frozen or cut off from the broker) first asks: its runs hold their
records, its heartbeats carry ``renew``, and the scheduler's ``LeaseAnswer`` on the control
topic decides — granted, the runs go on as if nothing happened; refused, or no answer within
``lease_ask_beats`` intervals, the process ends its runs unanswered and carries on as a new
incarnation: ``started_at`` moves forward by
:data:`INCARNATION_STEP_S`, so its next heartbeat reads as a restart to the scheduler
(which requeues or ends what the earlier incarnation held) and the assignments stamped for
the earlier incarnation are dropped like those of an earlier process. The step is tiny, so
the incarnation stays older than any process of this worker started after it (the slot's
rules, ``services.worker.slot``, keep their meaning).

Observability (:class:`~services.worker.metrics.WorkerMetrics`): capacity from each
heartbeat, tokens, TTFT, end-to-end latency and terminal outcomes per request. Each run is
a span under the context its assignment record carried (:mod:`services.worker.runner`).
A prefill stage (role ``prefill``, ``Assignment.phase``) counts none of tokens, TTFT,
latency or outcome: it streams nothing and sends no terminal (its one token is discarded;
its decode stage, on a decode worker, counts them all), so ``llmq_requests_total`` still
counts each request once and the heartbeat's ``tokens_per_s`` is tokens streamed.

Role (``WorkerSettings.role``, in every heartbeat): ``mixed`` runs requests whole,
``prefill`` and ``decode`` the stages the scheduler places on them; the worker runs
whatever phase an assignment names (the scheduler matches phases to roles).

Drain (SIGTERM or ``DrainWorker``): a draining heartbeat goes out at once so the scheduler
stops placing work here; the worker keeps reading its partition and serves whatever still
arrives (nothing is dropped), and exits once nothing is in flight (no run, no record being
handled), no assignment arrived for ``drain_quiet_s`` and the draining heartbeat was
acknowledged that long ago. A prefill worker also waits for its hand-offs: the engine holds
each prompt's KV until the decode stage takes it, so the worker follows ``llmq.events``
from its oldest hand-off on and stays (heartbeating ``draining``, nothing running) until
each one's decode stage has its first token, the request ended, or the hold expired
(``handoff_hold_s`` after the hand-off, or the request's deadline;
:mod:`services.worker.core.handoffs`); its heartbeats count them as ``waiting`` meanwhile.
Then: a final heartbeat, a final commit, leave the group, exit 0.

A dead engine (its capacity says it can run nothing more) stops the worker at once, exit 1:
its heartbeats end, so the scheduler declares it lost and requeues or ends its work, rather
than placing more on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any, Literal

from aiokafka import TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from schemas.codec import SALVAGE_ERRORS, decode, undecodable_json
from schemas.common import Pool, Role
from schemas.control import LeaseAnswer
from schemas.messages import ASSIGNMENT_ADAPTER
from schemas.replies import Error
from schemas.requests import Assignment
from schemas.workers import EventFailed, LifecycleEvent, WorkerHeartbeat
from services.common import metrics as m
from services.common import tracing
from services.common.guard import Guard, aiokafka_dead_letter
from services.common.kafka import ProducerFailed, ensure_topics, make_consumer, make_producer
from services.common.replies import topic_partitions
from services.common.settings import Settings
from services.worker.core import (
    AttemptLedger,
    HeartbeatFields,
    HeldHandoffs,
    OffsetTracker,
    RateMeter,
    RecentCancels,
    decode_done,
    encode_done,
    heartbeat_fields,
)
from services.worker.core.lease import Lease, Verdict
from services.worker.engines.base import Engine
from services.worker.gpu import NvmlProbe
from services.worker.kafka_io import (
    ControlMessage,
    ControlReader,
    EventFollower,
    Publisher,
    WorkerTopics,
)
from services.worker.metrics import WorkerMetrics
from services.worker.replay import already_ended, replayed_attempts
from services.worker.runner import Refusal, RequestRun, RunConfig
from services.worker.settings import WorkerSettings
from services.worker.slot import (
    SlotAssignorBase,
    SlotRefused,
    check_slot_free,
    committed_position,
    slot_assignor,
    slot_group,
)

_log = logging.getLogger("services.worker")

#: How far a fenced process moves its ``started_at`` (module docstring).
INCARNATION_STEP_S = 1e-3

#: How long a draining prefill worker waits for its ``llmq.events`` reader to start (then
#: it tries again 5 s later; the hand-offs' holds expire meanwhile).
_FOLLOW_START_S = 10.0

#: What happened to one assignment record: a run started, nothing more to do, or its
#: answer was not acknowledged (the offset stays uncommitted).
Admitted = Literal["running", "finished", "unacked"]


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Who this worker is, as its heartbeats say."""

    worker_id: str
    slot: int
    pool: Pool
    model: str
    model_version: str | None
    engine: str
    role: Role = "mixed"


class _SlotListener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is Any
    """Tells the worker what the slot group assigned it."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:
            await self._worker.commit()  # best effort before a rebalance moves the slot

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self._worker.on_assigned(set(assigned))


class Worker:
    """One worker process's state and tasks (see the module docstring)."""

    def __init__(self, settings: Settings, ws: WorkerSettings, engine: Engine,
                 identity: WorkerIdentity, *, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.ws = ws
        self.engine = engine
        self.id = identity
        self.topics = WorkerTopics.of(settings.topic_prefix, settings.assignment_partitions)
        self.tp = TopicPartition(self.topics.assignments, identity.slot)
        self.group = slot_group(settings.topic_prefix, identity.slot)
        self._clock = clock
        self.started_at = clock()
        self._process_started_at = self.started_at
        self._fences = 0
        self.lease = Lease(ws.lease_s(), time.monotonic(), ws.lease_ask_s())
        # Set whenever an asked renewal ends (granted, or fenced): held runs look again.
        self._lease_settled = asyncio.Event()
        self._lease_settled.set()
        # Renewing heartbeats sent while asking: seq -> monotonic creation time.
        self._renew_beats: dict[int, float] = {}
        self.metrics = WorkerMetrics(identity.worker_id)
        self.ledger = AttemptLedger(ws.dedupe_capacity)
        self.cancels = RecentCancels(ws.cancel_memory_s)
        self.tracker = OffsetTracker()
        self._resume: tuple[int | None, set[int]] = (None, set())
        self._ended_elsewhere: set[tuple[str, int]] = set()
        self.rate = RateMeter()
        self.draining = False
        self.handoffs = HeldHandoffs(ws.handoff_hold_s)
        self._events: EventFollower | None = None  # follows the hand-offs while draining
        self._events_tried_at = -math.inf
        self.runs: dict[str, RequestRun] = {}  # request_id -> its current run
        self._run_tasks: set[asyncio.Task[None]] = set()
        self._producer: Any = None
        self._consumer: Any = None
        self._publisher: Publisher | None = None
        self._control: ControlReader | None = None
        self._guard: Guard | None = None
        self._gpu: NvmlProbe | None = None
        self._assigned: set[TopicPartition] | None = None
        self._assignor: type[SlotAssignorBase] | None = None
        self._assigned_event = asyncio.Event()
        self._heartbeat_wake = asyncio.Event()
        self._commit_wake = asyncio.Event()
        self._done = asyncio.Event()
        self._hard_stop = False
        self._serving = False
        self._seq = 0
        self._last_commit: tuple[int, str] | None = None
        self._last_record_at = time.monotonic()
        self._records_in_hand = 0  # being handled by _on_record (a run not started yet)
        self._draining_acked_at: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._max_in_flight = ws.max_in_flight or engine.capacity().max_num_seqs
        self.run_cfg = RunConfig(
            worker_id=identity.worker_id, model=identity.model,
            events_topic=self.topics.events, chunk_tokens=ws.chunk_tokens,
            chunk_delay_s=ws.chunk_ms / 1000.0,
        )

    # ---- lifecycle ---------------------------------------------------------------------
    async def _start_engine(self) -> None:
        await self.engine.start()
        # The engine's own figure, known once it runs (vLLM's args may set max_num_seqs
        # above the profile's): capped at the profile's, the rest of what the scheduler
        # placed waited in Kafka, out of the engine's priority order and the heartbeat.
        self._max_in_flight = self.ws.max_in_flight or self.engine.capacity().max_num_seqs

    async def run(self) -> int:
        """Start, serve until drained (0) or stopped hard (1). SlotRefused and
        EngineMisconfigured propagate."""
        try:
            await self._start()
            await self._done.wait()
        finally:
            await self._shutdown()
        return 1 if self._hard_stop else 0

    async def _start(self) -> None:
        bootstrap = self.settings.bootstrap
        await ensure_topics(bootstrap, self.topics.to_create(),
                            replication_factor=self.settings.replication_factor)
        partitions = await topic_partitions(bootstrap, self.topics.assignments)
        if self.id.slot not in partitions:
            raise SlotRefused(f"slot {self.id.slot} does not exist: {self.topics.assignments} "
                              f"has partitions 0..{max(partitions)}")
        await self._check_slot(bootstrap)
        if self.ws.nvml == "auto" and self.id.engine != "sim":
            self._gpu = NvmlProbe.open(self.ws.gpu_index)
        await self._start_engine()
        self._producer = make_producer(bootstrap, on_failure=self._producer_failed)
        await self._producer.start()
        self._publisher = Publisher(self._producer, self.ws.send_timeout_s)
        self._guard = Guard(aiokafka_dead_letter(self._producer, self.topics.deadletter),
                            name=f"worker.slot{self.id.slot}", logger=_log)
        # Control first: a cancel sent while we join must not be missed.
        self._control = ControlReader(bootstrap, self.topics.control, self._on_control)
        await self._control.start()
        await self._join_slot(bootstrap)
        await self._find_ended_elsewhere(bootstrap)
        if self.ws.metrics_port is not None:
            # Rolling restart: the slot's previous process leaves the group (so this one
            # got the slot) a moment before it exits and frees the port.
            await m.serve_when_free(self.metrics.serve, self.ws.metrics_port)
        self.lease.restart(time.monotonic())  # nothing was placed on this process yet
        for coro in (self._control.run(), self._heartbeats(), self._commits(),
                     self._consume(), self._drain_watch(), self._lease_watch(),
                     self._engine_watch()):
            self._spawn(coro)
        self._serving = True  # only a worker that holds its slot heartbeats and commits
        _log.info("worker %s: slot %d (%s), pool %s, role %s, engine %s, model %s, group %s",
                  self.id.worker_id, self.id.slot, self.topics.assignments, self.id.pool,
                  self.id.role, self.id.engine, self.id.model, self.group)

    async def _check_slot(self, bootstrap: str) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
        await admin.start()
        try:
            wait = self.ws.session_timeout_ms / 1000 + 2.0
            await check_slot_free(admin, self.group, self.id.slot, self.id.worker_id, wait)
            offset, metadata = await committed_position(admin, self.group, self.tp)
        finally:
            await admin.close()
        done = decode_done(offset, metadata) if offset is not None else set()
        self.tracker = OffsetTracker(offset, done)
        self._resume = (offset, done)
        if done:
            _log.info("slot %d: %d request(s) above offset %s finished before the restart; "
                      "skipping them", self.id.slot, len(done), offset)

    async def _find_ended_elsewhere(self, bootstrap: str) -> None:
        """Uncommitted assignments this slot will read again that the scheduler already
        ended while the slot was down (``services.worker.replay``): they are dropped."""
        offset, done = self._resume
        assert self._guard is not None
        try:
            replay = await replayed_attempts(bootstrap, self.tp, offset, done)
            self._ended_elsewhere = await already_ended(
                bootstrap, self.topics.events, self.topics.assignments, replay, self._guard)
        except (KafkaError, TimeoutError, OSError):
            _log.warning("slot %d: could not check the replayed assignments against the "
                         "scheduler's log; running them all", self.id.slot, exc_info=True)
            return
        if self._ended_elsewhere:
            _log.info("slot %d: %d of %d replayed assignment(s) were ended by the scheduler "
                      "while this slot was down; dropping them", self.id.slot,
                      len(self._ended_elsewhere), len(replay))

    async def _join_slot(self, bootstrap: str) -> None:
        self._assignor = slot_assignor(self.id.slot, self.id.worker_id, self.started_at)
        self._consumer = make_consumer(
            bootstrap, group_id=self.group, client_id=self.id.worker_id,
            partition_assignment_strategy=(self._assignor,),
            session_timeout_ms=self.ws.session_timeout_ms,
            heartbeat_interval_ms=max(300, self.ws.session_timeout_ms // 5),
        )
        self._consumer.subscribe([self.topics.assignments], listener=_SlotListener(self))
        await self._consumer.start()
        # The group join runs in the background; a fetch drives it along.
        poll = asyncio.create_task(self._consumer.getmany(timeout_ms=100, max_records=1))
        try:
            await asyncio.wait_for(self._assigned_event.wait(),
                                   self.ws.session_timeout_ms / 1000 + 20)
        finally:
            poll.cancel()
            await asyncio.gather(poll, return_exceptions=True)
        if self.tp not in (self._assigned or set()):
            raise SlotRefused(f"slot {self.id.slot} is already held by another worker that "
                              f"joined group {self.group} at the same time; refusing to "
                              "start a second worker on the same slot")

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Group assignment callback: the first one tells if we hold the slot."""
        had = self._assigned is not None and self.tp in self._assigned
        self._assigned = assigned
        if self._assignor is not None:
            # Tell later rebalances that we hold the slot, so a newcomer cannot take it.
            self._assignor.holding = self.tp in assigned
        self._assigned_event.set()
        if had and self.tp not in assigned:
            # Only a process that dropped out of the group (paused, frozen, cut off past the
            # session timeout) loses its slot. By then the scheduler has ended its work, or
            # will once its heartbeats stop: finishing it would answer requests a second
            # time (requeued elsewhere, or already ended worker_lost). So its runs end
            # without a word, as superseded ones do, and it drains out.
            _log.error("slot %d was taken over while this process was out of its group; "
                       "ending its %d request(s) in flight unanswered (the scheduler "
                       "requeues or ends them) and draining", self.id.slot, len(self.runs))
            for run in list(self.runs.values()):
                run.stop("superseded", "slot taken over")
            self.begin_drain("slot taken over")

    def begin_drain(self, reason: str) -> None:
        """Stop taking new work (the scheduler learns it from the next heartbeat, sent now)."""
        if self.draining:
            return
        self.draining = True
        _log.info("worker %s: draining (%s); %d request(s) in flight",
                  self.id.worker_id, reason, len(self.runs))
        self._heartbeat_wake.set()

    def _producer_failed(self, exc: ProducerFailed) -> None:
        """Nothing more can be sent, heartbeats included (the lease would lapse and the
        worker fence itself for good): stop at once, exit 1, so a restart gets a producer
        that sends; the scheduler requeues or ends what was in flight."""
        _log.error("worker %s: %s", self.id.worker_id, exc)
        self.stop_now()

    def stop_now(self) -> None:
        """Second signal: stop without waiting; unfinished requests are redone elsewhere."""
        _log.warning("worker %s: stopping now; %d request(s) left unfinished",
                     self.id.worker_id, len(self.runs))
        self._hard_stop = True
        self._done.set()

    async def _shutdown(self) -> None:
        """Stop every task; after a drain, a final heartbeat (draining, nothing running).

        A hard stop sends no final heartbeat: the runs cancelled here are aborted in the
        engine without a terminal, so a beat now would read "draining, nothing running",
        which ``llmq drain --wait`` and the health service take for a clean drain. The last
        periodic beat, with the work still in flight, stays this process's last word, and
        both report it lost (fail closed), as the scheduler does once it goes stale.
        """
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in list(self._run_tasks):
            task.cancel()  # only left on a hard stop: their offsets stay uncommitted
        await asyncio.gather(*self._run_tasks, return_exceptions=True)
        if self._serving:
            if not self._hard_stop:
                await self._heartbeat()
            await self.commit()
        await self._close_clients()

    async def _close_clients(self) -> None:
        for closer in (
            self._control.stop() if self._control else None,
            self._events.stop() if self._events else None,
            self._consumer.stop() if self._consumer else None,
            self._producer.stop() if self._producer else None,
            self.engine.close(),
        ):
            if closer is None:
                continue
            try:
                await asyncio.wait_for(closer, 30)
            except Exception:
                _log.warning("shutdown step failed", exc_info=True)
        if self._gpu is not None:
            self._gpu.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(self._task_ended)
        self._tasks.append(task)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            _log.error("worker task %s died", task.get_name(), exc_info=exc)
            self._hard_stop = True
            self._done.set()

    # ---- assignments -------------------------------------------------------------------
    async def _consume(self) -> None:
        while True:
            room = self._max_in_flight - len(self._run_tasks)
            self._flow(room > 0)
            try:
                batches = await self._consumer.getmany(timeout_ms=100,
                                                       max_records=max(1, room))
            except KafkaError:
                _log.warning("slot %d: fetch failed", self.id.slot, exc_info=True)
                await asyncio.sleep(0.5)
                continue
            for tp, records in batches.items():
                if tp != self.tp:
                    continue
                for record in records:
                    await self._on_record(record)

    def _flow(self, open_: bool) -> None:
        """Pause the partition at max_in_flight, resume below it (Kafka keeps the backlog)."""
        if self.tp not in self._consumer.assignment():
            return
        paused = self.tp in self._consumer.paused()
        if open_ and paused:
            self._consumer.resume(self.tp)
        elif not open_ and not paused:
            self._consumer.pause(self.tp)

    async def _on_record(self, record: Any) -> None:
        self._last_record_at = time.monotonic()
        if not self.tracker.begin(record.offset):
            return  # redelivered after a rebalance or restart: already handled
        assert self._guard is not None
        self._records_in_hand += 1  # the drain waits for it (it may yet start a run)
        try:
            state = await self._guard.run(record, lambda: self._admit(record))
        finally:
            self._records_in_hand -= 1
        if state is None:  # dead-lettered (the guard counts it)
            try:
                await self._answer_unreadable(record)
            except Exception:  # never skips the finish below (a stuck commit point)
                _log.exception("slot %d: answering unreadable assignment at offset %d failed",
                               self.id.slot, record.offset)
        if state in (None, "finished"):
            self.tracker.finish(record.offset)
            self._commit_wake.set()

    async def _answer_unreadable(self, record: Any) -> None:
        """An assignment that did not decode (a newer wire schema than this worker's, during
        a rolling upgrade that reached the scheduler first; a bug), dead-lettered: ended
        ``worker_lost`` (the fleet's fault, retryable) when it is for this process and names
        who waits, reply first, its event once the reply is acknowledged, as a run ends.
        Finished unanswered, its attempt stayed active in the scheduler's log, its KV booked
        on this worker until the worker restarted, and its client waited out its timeout.
        Not when this process is fenced: the scheduler then ends or requeues its work."""
        found = unreadable_ending(record.value, worker_id=self.id.worker_id,
                                  started_at=self.started_at,
                                  replies_prefix=f"{self.settings.topic_prefix}.replies.",
                                  now=self._clock())
        publisher = self._publisher
        if found is None or publisher is None:
            return
        reply_topic, reply, event, admitted_at = found
        rid, attempt = reply.request_id, event.attempt
        # The gate a readable assignment passes (_admit): not an attempt that ended while
        # this slot was down, nor a copy of one taken already (a run of it may be going).
        if (rid, attempt) in self._ended_elsewhere:
            return
        verdict = self.ledger.admit(rid, attempt, admitted_at)
        if verdict in ("duplicate", "stale") or (verdict == "reused" and rid in self.runs):
            return
        if not await self.may_answer(self.started_at):
            return
        try:
            if await publisher.acked([await publisher.send(reply_topic, reply)]):
                # Only now: an older run stopped before the reply went would leave the
                # request with no terminal if it did not go.
                older = self.runs.get(rid)
                if older is not None:
                    older.stop("superseded", f"attempt {attempt} replaces it")
                await publisher.acked([await publisher.send(self.topics.events, event)])
        except Exception:  # the dead letter holds it; nothing more to do here
            _log.warning("slot %d: the worker_lost ending of unreadable assignment %s#%d "
                         "could not be sent", self.id.slot, reply.request_id, event.attempt,
                         exc_info=True)

    async def _admit(self, record: Any) -> Admitted:
        a: Assignment = decode(record.value, ASSIGNMENT_ADAPTER)
        rid, attempt = a.request_id, a.attempt
        if a.worker_id != self.id.worker_id:
            _log.warning("slot %d: assignment of %s#%d is for worker %s, not us: dropped",
                         self.id.slot, rid, attempt, a.worker_id)
            return "finished"
        if a.worker_started_at is not None and a.worker_started_at != self.started_at:
            _log.info("slot %d: %s#%d was placed on an earlier process of this worker "
                      "(started %.3f): the scheduler requeues or ends it; dropped",
                      self.id.slot, rid, attempt, a.worker_started_at)
            return "finished"
        if (rid, attempt) in self._ended_elsewhere:
            _log.info("slot %d: %s#%d already ended (worker_lost or requeued) while this slot "
                      "was down: dropped", self.id.slot, rid, attempt)
            return "finished"
        verdict = self.ledger.admit(rid, attempt, a.admitted.admitted_at)
        if verdict in ("duplicate", "stale") or (verdict == "reused" and rid in self.runs):
            _log.info("slot %d: %s assignment %s#%d dropped", self.id.slot, verdict, rid,
                      attempt)
            return "finished"
        headers = tracing.headers_of(record)
        older = self.runs.get(rid)
        if older is not None:
            older.stop("superseded", f"attempt {attempt} replaces it")
        # A late assignment of a cancelled request is answered without running it, by a
        # run like any other (its terminal is sent until acknowledged, or fenced).
        cancelled = "cancelled before it started" \
            if self.cancels.matches(rid, a.request.tenant, self._clock()) else None
        refused = self._cannot_serve(a, reused=verdict == "reused")
        if refused is not None:
            _log.warning("slot %d: %s#%d: %s; answered %s without running it",
                         self.id.slot, rid, attempt, refused[1], refused[0])
        self._start_run(a, record.offset, tracing.extract(headers), cancelled, refused)
        return "running"

    def _cannot_serve(self, a: Assignment, *, reused: bool = False) -> Refusal | None:
        """Why this worker cannot run ``a``, and the code it answers: a model or pinned
        version it does not serve (a misrouted or forged assignment: ``worker_lost``, the
        fleet's fault), or an id this worker ran for another admission (the scheduler forgot
        that one, the worker has not: ``invalid``, ids are single-use); None when it can."""
        request, me = a.request, self.id
        if request.model != me.model:
            return ("worker_lost",
                    f"assigned model {request.model!r} to a worker serving {me.model!r}")
        if request.model_version is not None and request.model_version != me.model_version:
            return ("worker_lost", f"assigned {request.model!r} version "
                    f"{request.model_version!r} to a worker serving version "
                    f"{me.model_version!r}")
        if reused:
            return ("invalid", f"request_id {a.request_id!r} was used by an earlier request "
                    "this worker ran; request ids must be unique: send it with a new one")
        return None

    def _start_run(self, a: Assignment, offset: int, parent: tracing.Context,
                   cancelled: str | None = None, refused: Refusal | None = None) -> None:
        assert self._publisher is not None
        priority, lane = a.admitted.priority, a.admitted.lane

        def first_token(ttft_s: float) -> None:
            self.metrics.first_token(priority, lane, ttft_s)

        incarnation = self.started_at

        async def may_send() -> bool:
            return await self.may_answer(incarnation)

        run = RequestRun(a, self.engine, self._publisher, self.run_cfg, clock=self._clock,
                         on_tokens=self._count_tokens, on_first_token=first_token,
                         trace_parent=parent, may_send=may_send, cancelled=cancelled,
                         refused=refused)
        self.runs[a.request_id] = run
        task = asyncio.create_task(self._run_one(run, offset), name=f"run:{run.engine_id}")
        self._run_tasks.add(task)
        task.add_done_callback(self._run_tasks.discard)

    async def _run_one(self, run: RequestRun, offset: int) -> None:
        started = self._clock()  # before any event.prefilled it writes
        try:
            outcome = await run.run()
        except Exception:  # run() answers every ending itself; this is a bug in it
            _log.exception("request %s: the run failed without an answer; offset %d stays "
                           "uncommitted and the request open until this worker is declared "
                           "lost", run.engine_id, offset)
            return
        finally:
            if self.runs.get(run.request_id) is run:
                del self.runs[run.request_id]
        if run.handed_off:  # acknowledged, or cut short by a fence: it may be in the log
            a = run.assignment
            self.handoffs.hold(a.request_id, a.attempt, a.deadline, self._clock(),
                               since=started)
        if outcome.terminal is not None:
            admitted = run.assignment.admitted
            self.metrics.finished(outcome.terminal, admitted.priority, admitted.lane,
                                  outcome.e2e_s)
        if outcome.acked:
            self.tracker.finish(offset)
            self._commit_wake.set()
        else:
            # Runs end acked once answered, given up for good (their event.failed sent as
            # far as it could be) or fenced; an Outcome that is not is a bug in the run.
            _log.error("request %s: its answer was not acknowledged; offset %d stays "
                       "uncommitted and the request open until this worker is declared "
                       "lost", run.engine_id, offset)

    def _count_tokens(self, n: int) -> None:
        self.rate.add(n, time.monotonic())
        self.metrics.tokens(n)

    # ---- control -----------------------------------------------------------------------
    async def _on_control(self, msg: ControlMessage) -> None:
        if msg.kind == "drain":
            if msg.worker_id == self.id.worker_id:
                self.begin_drain(f"drain command from {msg.issued_by}: {msg.reason}")
            return
        if msg.kind == "lease":
            if msg.worker_id == self.id.worker_id:
                self.on_lease_answer(msg)
            return
        self.cancels.add(msg.request_id, msg.tenant, self._clock())
        run = self.runs.get(msg.request_id)
        if run is not None and run.assignment.request.tenant == msg.tenant:
            run.stop("cancelled", msg.reason or f"cancelled by {msg.issued_by}")

    # ---- the lease --------------------------------------------------------------------
    async def may_answer(self, incarnation: float) -> bool:
        """May work given to ``incarnation`` still be answered? While a lapsed lease is
        being asked about, waits for the answer; False once fenced (then no earlier
        incarnation's work may be answered)."""
        while True:
            if incarnation != self.started_at:
                return False
            if self.check_lease() == "valid":
                return True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):  # not wait_for: it can drop a cancel
                    await self._lease_settled.wait()

    def check_lease(self) -> Verdict:
        """The lease now: starts asking (a renewing heartbeat at once) or fences."""
        now = time.monotonic()
        verdict = self.lease.check(now)
        self._on_verdict(verdict, now)
        return verdict

    def _on_verdict(self, verdict: Verdict, now: float) -> None:
        if verdict == "ask":
            _log.warning("worker %s: no acknowledged heartbeat for %.1f s (lease %.1f s): "
                         "holding the output of %d request(s) and asking the scheduler "
                         "whether they are still ours (up to %.1f s)", self.id.worker_id,
                         now - self.lease.beat_at, self.lease.limit_s, len(self.runs),
                         self.lease.ask_s)
            self._lease_settled.clear()
            self._heartbeat_wake.set()  # the renewing beat goes out now
        elif verdict == "fence":
            asked = self.lease.asking
            if asked:
                self.metrics.lease_asked("unanswered")
            self._fence(f"no acknowledged heartbeat for {now - self.lease.beat_at:.1f} s "
                        f"(lease {self.lease.limit_s:.1f} s)"
                        + (", and no answer from the scheduler" if asked else ""))

    def on_lease_answer(self, answer: LeaseAnswer) -> None:
        """The scheduler's answer to one of our renewing heartbeats."""
        beat_at = self._renew_beats.get(answer.seq)
        if answer.started_at != self.started_at or beat_at is None or not self.lease.asking:
            return  # for an earlier incarnation, or an asking already settled
        if not answer.granted:
            self.metrics.lease_asked("revoked")
            self._fence(f"the scheduler refused to renew the lease ({answer.reason})")
            return
        now = time.monotonic()
        if not self.lease.granted(beat_at, now):
            return  # granted too late to count: the next renewing beat asks again
        self.metrics.lease_asked("granted")
        self._renew_beats.clear()
        self._lease_settled.set()
        _log.warning("worker %s: the scheduler renewed the lease (heartbeat %d): its %d "
                     "request(s) go on", self.id.worker_id, answer.seq, len(self.runs))

    def _fence(self, why: str) -> None:
        """The lease is gone: end every run unanswered and become a new incarnation."""
        old = self.started_at
        self._fences += 1
        self.started_at = self._process_started_at + self._fences * INCARNATION_STEP_S
        self.lease.restart(time.monotonic())
        self._renew_beats.clear()
        self._lease_settled.set()
        self.metrics.fenced()
        _log.error("worker %s: %s: the scheduler may have declared it dead and given its "
                   "work away. Ending its %d request(s) in flight unanswered (the scheduler "
                   "requeues or ends them) and going on as incarnation %.3f (was %.3f)",
                   self.id.worker_id, why, len(self.runs), self.started_at, old)
        for run in list(self.runs.values()):
            run.stop("superseded", "this process was fenced")
        self._heartbeat_wake.set()  # announce the new incarnation now

    async def _lease_watch(self) -> None:
        """Ask (or fence) as soon as the lease lapses, even when nothing is being sent, and
        fence once an asking goes unanswered too long."""
        period = min(0.1, self.lease.limit_s / 10)
        while True:
            await asyncio.sleep(period)
            self.check_lease()

    # ---- heartbeats --------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        interval = self.ws.heartbeat_interval_s
        while True:
            began = time.monotonic()
            await self._heartbeat()
            # Every interval from the beat's creation, however long its ack took: the
            # lease counts from there too.
            wait = max(0.0, interval - (time.monotonic() - began))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):  # not wait_for: it can drop a cancel
                    await self._heartbeat_wake.wait()
            self._heartbeat_wake.clear()

    def heartbeat_fields(self) -> HeartbeatFields:
        sample = self._gpu.sample() if self._gpu is not None else None
        # Draining, the hand-offs whose KV the engine still holds count as waiting work: a
        # worker stopped hard while it waits for them did not drain cleanly.
        held = self.handoffs.held(self._clock()) if self.draining else 0
        return heartbeat_fields(self.engine.capacity(), sample, held_back=held,
                                tokens_per_s=self.rate.rate(time.monotonic()))

    async def _heartbeat(self) -> None:
        assert self._publisher is not None
        self.check_lease()  # lapsed: this beat asks, or announces the new incarnation
        beat_at = time.monotonic()
        renew = self.lease.asking
        fields = self.heartbeat_fields()
        draining = self.draining
        hb = WorkerHeartbeat(
            worker_id=self.id.worker_id, engine=self.id.engine, model=self.id.model,
            model_version=self.id.model_version, pool=self.id.pool, role=self.id.role,
            partition=self.id.slot,
            draining=draining, interval_s=self.ws.heartbeat_interval_s,
            started_at=self.started_at, seq=self._seq, ts=self._clock(), renew=renew,
            **asdict(fields),
        )
        if renew:
            self._renew_beats[hb.seq] = beat_at
        self._seq += 1
        self.metrics.observe(fields, draining)
        if not await self._publisher.send_acked(self.topics.heartbeats, hb):
            return
        acked_at = time.monotonic()
        if hb.started_at == self.started_at:
            # Visible only after the lease had lapsed: ask (or fence).
            self._on_verdict(self.lease.acked(beat_at, acked_at), acked_at)
        if draining and self._draining_acked_at is None:
            self._draining_acked_at = acked_at

    # ---- commits -----------------------------------------------------------------------
    async def _commits(self) -> None:
        while True:
            await self._commit_wake.wait()
            self._commit_wake.clear()
            if not await self.commit():
                await asyncio.sleep(0.5)
                self._commit_wake.set()  # retry
            await asyncio.sleep(0.02)  # coalesce bursts of finishing requests

    async def commit(self) -> bool:
        """Commit what the tracker allows; True when done (or nothing to do)."""
        point = self.tracker.commit_point()
        if point is None or self._consumer is None:
            return True
        metadata = encode_done(point, self.tracker.done_above())
        if self._last_commit == (point, metadata):
            return True
        try:
            await asyncio.wait_for(
                self._consumer.commit({self.tp: OffsetAndMetadata(point, metadata)}), 10
            )
        except (KafkaError, TimeoutError) as exc:
            _log.warning("slot %d: commit of offset %d failed (%r); will retry",
                         self.id.slot, point, exc)
            return False
        self.tracker.committed(point)
        self._last_commit = (point, metadata)
        return True

    # ---- the engine --------------------------------------------------------------------
    async def _engine_watch(self) -> None:
        """Raise once the engine died: ``_task_ended`` then stops the worker, exit 1."""
        while self.engine.capacity().alive:
            await asyncio.sleep(min(0.5, self.ws.heartbeat_interval_s))
        raise RuntimeError(f"the {self.id.engine} engine died: it can run nothing more")

    # ---- drain -------------------------------------------------------------------------
    async def _drain_watch(self) -> None:
        quiet = self.ws.resolved_drain_quiet_s()
        while True:
            await asyncio.sleep(0.05)
            if not self.draining or self.runs or self._run_tasks or self._records_in_hand:
                continue
            now = time.monotonic()
            if self._draining_acked_at is None or now - self._draining_acked_at < quiet:
                continue
            if now - self._last_record_at < quiet:
                continue
            held = self.handoffs.held(self._clock())
            if held:
                await self._follow_handoffs(held)
                continue
            _log.info("worker %s: drained; exiting", self.id.worker_id)
            self._done.set()
            return

    async def _follow_handoffs(self, held: int) -> None:
        """Drained but for hand-offs whose KV may still be pulled: follow ``llmq.events``
        from the oldest of them (once; a failed start is tried again every 5 s, and the
        holds expire meanwhile)."""
        now = time.monotonic()
        if self._events is not None or now - self._events_tried_at < 5.0:
            return
        self._events_tried_at = now
        since = self.handoffs.since()
        assert since is not None
        _log.info("worker %s: drained but for %d hand-off(s) whose KV the decode side may "
                  "still pull; waiting for their decode stages (at most %.0f s each)",
                  self.id.worker_id, held, self.ws.handoff_hold_s)
        follower = EventFollower(self.settings.bootstrap, self.topics.events,
                                 self._on_event)
        try:  # bounded: a broker gone mid-start would leave the holds unwatched
            await asyncio.wait_for(follower.start(since_s=since - 1.0),  # 1 s: producers'
                                   _FOLLOW_START_S)                      # clocks
        except (KafkaError, TimeoutError, OSError):
            _log.warning("worker %s: cannot read %s to follow the hand-offs; they are held "
                         "until they expire", self.id.worker_id, self.topics.events,
                         exc_info=True)
            return
        self._events = follower
        self._spawn(follower.run())

    async def _on_event(self, event: LifecycleEvent) -> None:
        if self.handoffs.observe(event.kind, event.request_id, event.attempt):
            _log.info("worker %s: hand-off %s taken over (%s at attempt %d); %d still held",
                      self.id.worker_id, event.request_id, event.kind, event.attempt,
                      self.handoffs.held(self._clock()))


def unreadable_ending(
    raw: object, *, worker_id: str, started_at: float, replies_prefix: str, now: float,
) -> tuple[str, Error, EventFailed, float] | None:
    """The reply topic, the ``worker_lost`` reply, its event and the admission time for an
    assignment record that does not decode (:meth:`Worker._answer_unreadable`); None when
    it decodes (its handling failed otherwise), is not for this process (another worker's,
    or stamped for an earlier process of this one) or does not name its request, attempt,
    tenant, admission and a reply topic under ``replies_prefix`` readably."""
    data = undecodable_json(raw, ASSIGNMENT_ADAPTER)
    if data is None:
        return None
    try:
        admitted = data["admitted"]
        request = admitted["request"]
        stamped = data.get("worker_started_at")
        if data["worker_id"] != worker_id or (stamped is not None and stamped != started_at):
            return None
        topic = admitted["reply_topic"]
        if not isinstance(topic, str) or not topic.startswith(replies_prefix):
            return None
        text = ("this worker could not read its assignment (it was dead-lettered; a newer "
                "wire schema than this worker's?)")
        reply = Error(request_id=request["request_id"], attempt=data["attempt"],
                      code="worker_lost", message=text, ts=now)
        event = EventFailed(request_id=request["request_id"], tenant=request["tenant"],
                            attempt=data["attempt"], worker_id=worker_id, ts=now,
                            code="worker_lost", message=text)
        admitted_at = float(admitted["admitted_at"])
        if not math.isfinite(admitted_at):  # NaN in the dedupe ledger refuses the id for good
            return None
    except SALVAGE_ERRORS:  # what odd bytes may hold
        return None
    except Exception:  # a bug here: said, not taken for a record that names nobody
        _log.exception("salvaging an undecodable record failed; it is left unanswered")
        return None
    return topic, reply, event, admitted_at
