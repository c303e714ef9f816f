"""The real worker process against the real broker; the test plays the scheduler.

Each test starts ``python -m services.worker`` (sim engine, 100x faster than real time
unless said otherwise) on a unique topic prefix with two slots, produces assignments to its
partition with :class:`tests.fakes.worker_scheduler.FakeScheduler` (a fake of the
scheduler), and checks what comes back on the reply, events, heartbeats and dead-letter
topics.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from schemas.replies import Done, Error, TokenChunk
from schemas.topics import DEADLETTER_REASON_HEADER, DEADLETTER_SOURCE_HEADER
from schemas.workers import EventFailed
from services.worker.slot import slot_group
from tests.fakes import sender_fault
from tests.fakes.worker_scheduler import TENANT, FakeScheduler, WorkerProcess

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

SLOT = 1
WID = "worker-under-test"


@pytest.fixture
async def scheduler(bootstrap: str, topic_prefix: str) -> AsyncIterator[FakeScheduler]:
    fake = FakeScheduler(bootstrap, topic_prefix)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@pytest.fixture
def spawn(topic_prefix: str) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes; they are stopped (and their logs shown on failure) after."""
    started: list[WorkerProcess] = []

    def start(worker_id: str = WID, slot: int = SLOT, **options: object) -> WorkerProcess:
        proc = WorkerProcess(topic_prefix, slot, worker_id, **options)  # type: ignore[arg-type]
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
        print(f"--- log of {proc.worker_id} (exit {proc.proc and proc.proc.returncode}) ---")
        print(proc.tail())


async def ready(scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess],
                **options: object) -> WorkerProcess:
    proc = spawn(**options)
    await scheduler.heartbeat(str(options.get("worker_id", WID)))
    return proc


def done_events(scheduler: FakeScheduler, request_id: str) -> list[Any]:
    return [e for e in scheduler.events_of(request_id) if e.kind == "event.done"]


def chunks_of(scheduler: FakeScheduler, request_id: str) -> list[TokenChunk]:
    return [r for r in scheduler.replies_of(request_id) if isinstance(r, TokenChunk)]


async def test_streams_ordered_chunks_then_exactly_one_done(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    await ready(scheduler, spawn)
    lengths = {"r-40": 40, "r-17": 17, "r-1": 1, "r-300": 300}
    for rid, n in lengths.items():
        await scheduler.send(scheduler.assignment(rid, worker_id=WID, slot=SLOT, max_tokens=n,
                                                  prompt_tokens=77))
    for rid, n in lengths.items():
        done = await scheduler.terminal(rid)
        assert isinstance(done, Done), done
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (77, n)
        assert done.finish_reason == "length" and done.attempt == 1
        assert done.timings.ttft_s is not None
        assert done.timings.queued_s <= done.timings.ttft_s <= done.timings.e2e_s
        chunks = chunks_of(scheduler, rid)
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert sum(c.tokens for c in chunks) == n
        assert all(c.tokens <= 16 for c in chunks)  # N = 16 tokens per chunk
        assert len(chunks) >= -(-n // 16)
        replies = scheduler.replies_of(rid)
        assert replies[-1] is done  # nothing after the terminal
        await scheduler.wait_until(partial(done_events, scheduler, rid),
                                   what=f"event.done of {rid}")
        kinds = [e.kind for e in scheduler.events_of(rid)]
        assert kinds == ["event.started", "event.first_token", "event.done"]
    # Batching: Kafka carried far fewer chunk messages than tokens.
    assert len(chunks_of(scheduler, "r-300")) < 300 / 4
    await asyncio.sleep(0.5)
    assert all(len(scheduler.terminals_of(rid)) == 1 for rid in lengths)


async def test_deadline_aborts_with_timeout(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    await ready(scheduler, spawn)
    # 100,000 tokens take ~6 s even at 100x: the 1.5 s budget runs out first.
    await scheduler.send(scheduler.assignment("slow", worker_id=WID, slot=SLOT,
                                              max_tokens=100_000, timeout_s=1.5))
    # A request whose deadline passed before it arrived is answered without running.
    await scheduler.send(scheduler.assignment("late", worker_id=WID, slot=SLOT,
                                              created_at=1_000.0, timeout_s=1.0))
    late = await scheduler.terminal("late")
    assert isinstance(late, Error) and late.code == "timeout"
    slow = await scheduler.terminal("slow", timeout_s=10)
    assert isinstance(slow, Error) and slow.code == "timeout", slow
    assert sum(c.tokens for c in chunks_of(scheduler, "slow")) > 0  # it did stream first
    aborted = await scheduler.wait_until(
        lambda: [e for e in scheduler.events_of("slow") if e.kind == "event.aborted"])
    assert aborted[0].code == "timeout"
    assert aborted[0].usage.completion_tokens == sum(c.tokens for c in chunks_of(scheduler,
                                                                                   "slow"))
    late_events = await scheduler.wait_until(lambda: scheduler.events_of("late"))
    assert [e.kind for e in late_events] == ["event.aborted"]
    hb = await scheduler.heartbeat(WID, where=lambda h: h.running == 0 and h.seq > 3)
    assert hb.kv_free_tokens == hb.kv_total_tokens  # the aborted request freed its KV


async def test_cancel_aborts_running_and_answers_a_late_assignment(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    await ready(scheduler, spawn)
    long_one = scheduler.assignment("cx", worker_id=WID, slot=SLOT, max_tokens=100_000)
    await scheduler.send(long_one)
    await scheduler.wait_until(lambda: chunks_of(scheduler, "cx"), what="first chunk")
    await scheduler.cancel("cx", tenant="someone-else")  # wrong tenant: ignored
    await scheduler.cancel("cx")
    err = await scheduler.terminal("cx")
    assert isinstance(err, Error) and err.code == "cancelled"
    aborted = await scheduler.wait_until(
        lambda: [e for e in scheduler.events_of("cx") if e.kind == "event.aborted"])
    assert aborted[0].code == "cancelled"
    # Cancelled before its assignment arrives: still exactly one terminal, nothing run.
    await scheduler.cancel("pre")
    await asyncio.sleep(0.3)  # the worker reads control independently of assignments
    await scheduler.send(scheduler.assignment("pre", worker_id=WID, slot=SLOT))
    pre = await scheduler.terminal("pre")
    assert isinstance(pre, Error) and pre.code == "cancelled"
    assert not chunks_of(scheduler, "pre")
    await asyncio.sleep(0.5)
    assert len(scheduler.terminals_of("cx")) == 1 and len(scheduler.terminals_of("pre")) == 1


async def test_duplicate_and_stale_assignments_get_no_second_terminal(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    await ready(scheduler, spawn)
    first = scheduler.assignment("dup", worker_id=WID, slot=SLOT, max_tokens=30)
    await scheduler.send(first)
    await scheduler.send(first)  # redelivered while it runs
    assert isinstance(await scheduler.terminal("dup"), Done)
    await scheduler.send(first)  # and again after it finished
    second = scheduler.assignment("re", worker_id=WID, slot=SLOT, max_tokens=10, attempt=2)
    await scheduler.send(second)
    await scheduler.send(second.evolve(attempt=1))  # stale: an older attempt
    assert isinstance(await scheduler.terminal("re"), Done)
    marker = scheduler.assignment("marker", worker_id=WID, slot=SLOT, max_tokens=5)
    await scheduler.send(marker)  # everything before it was read once this finishes
    await scheduler.terminal("marker")
    await asyncio.sleep(0.3)
    assert len(scheduler.terminals_of("dup")) == 1
    assert [t.attempt for t in scheduler.terminals_of("re")] == [2]
    assert sum(c.tokens for c in chunks_of(scheduler, "dup")) == 30
    assert [e.kind for e in scheduler.events_of("dup")].count("event.started") == 1


async def test_garbage_goes_to_deadletter_and_the_next_assignment_runs(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    await ready(scheduler, spawn)
    await scheduler.send_raw(b"this is not an assignment", SLOT)
    await scheduler.send(scheduler.assignment("after", worker_id=WID, slot=SLOT))
    assert isinstance(await scheduler.terminal("after"), Done)
    dead = await scheduler.wait_until(lambda: scheduler.seen.deadletters, what="dead letter")
    headers = dict(dead[0].headers)
    assert dead[0].value == b"this is not an assignment"
    assert headers[DEADLETTER_REASON_HEADER]
    assert headers[DEADLETTER_SOURCE_HEADER].decode().endswith(f".assignments/{SLOT}/0")


async def test_heartbeats_carry_slot_and_pool_and_running_rises_under_load(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    await ready(scheduler, spawn, pool="long", time_scale=0.2)
    first = await scheduler.heartbeat(WID)
    assert (first.partition, first.pool, first.engine, first.model) == \
        (SLOT, "long", "sim", "llama-3.1-8b")
    assert (first.draining, first.running, first.max_num_seqs) == (False, 0, 256)
    assert first.interval_s == pytest.approx(0.2)
    for i in range(6):
        await scheduler.send(scheduler.assignment(f"load-{i}", worker_id=WID, slot=SLOT,
                                                  max_tokens=600))
    busy = await scheduler.heartbeat(WID, where=lambda h: h.running >= 4)
    assert busy.kv_free_tokens < busy.kv_total_tokens and busy.started_at == first.started_at
    for i in range(6):
        assert isinstance(await scheduler.terminal(f"load-{i}", timeout_s=20), Done)
    own = [h for h in scheduler.seen.heartbeats if h.worker_id == WID]
    assert [h.seq for h in own] == sorted(h.seq for h in own)
    assert any(h.tokens_per_s > 0 for h in own)


async def test_metrics_endpoint_serves_worker_gauges_and_counters(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    await ready(scheduler, spawn, env={"LLMQ_METRICS_PORT": str(port)})
    await scheduler.send(scheduler.assignment("m1", worker_id=WID, slot=SLOT, max_tokens=25))
    await scheduler.terminal("m1")
    await scheduler.heartbeat(WID, where=lambda h: h.tokens_per_s > 0)
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    # One registry per process (services.common.metrics); worker series carry the worker id.
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.labels.get("worker") == WID or s.labels.get("outcome") == "done"}
    assert values["llmq_worker_kv_total_tokens"] > 0
    assert values["llmq_worker_running_sequences"] == 0
    assert values["llmq_generated_tokens_total"] == 25
    assert values["llmq_requests_total"] == 1


async def test_sigterm_finishes_in_flight_work_and_exits_zero(
    bootstrap: str, topic_prefix: str, scheduler: FakeScheduler,
    spawn: Callable[..., WorkerProcess],
) -> None:
    proc = await ready(scheduler, spawn, time_scale=0.2)
    ids = [f"drain-{i}" for i in range(3)]
    for rid in ids:  # ~1.2 s each at this time scale
        await scheduler.send(scheduler.assignment(rid, worker_id=WID, slot=SLOT,
                                                  max_tokens=1_000))
    await scheduler.wait_until(lambda: all(chunks_of(scheduler, r) for r in ids),
                               what="all three streaming")
    proc.signal(signal.SIGTERM)
    draining = await scheduler.heartbeat(WID, where=lambda h: h.draining)
    assert draining.running > 0  # said while the requests still ran
    for rid in ids:
        done = await scheduler.terminal(rid, timeout_s=20)
        assert isinstance(done, Done) and done.usage.completion_tokens == 1_000
    assert await asyncio.to_thread(proc.wait, 20) == 0
    last = [h for h in scheduler.seen.heartbeats if h.worker_id == WID][-1]
    assert last.draining and last.running == 0
    # Every assignment's offset was committed in the slot's group.
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        tp = TopicPartition(scheduler.topics.assignments, SLOT)
        offsets = await admin.list_consumer_group_offsets(slot_group(topic_prefix, SLOT),
                                                          partitions=[tp])
    finally:
        await admin.close()
    assert offsets[tp].offset == 3


async def test_drain_command_exits_zero(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    proc = await ready(scheduler, spawn)
    await scheduler.drain("some-other-worker")  # not for us
    await scheduler.send(scheduler.assignment("before", worker_id=WID, slot=SLOT))
    assert isinstance(await scheduler.terminal("before"), Done)
    assert proc.proc is not None and proc.proc.poll() is None
    await scheduler.drain(WID)
    assert await asyncio.to_thread(proc.wait, 20) == 0
    assert any(h.draining for h in scheduler.seen.heartbeats if h.worker_id == WID)


async def test_second_worker_on_the_same_slot_refuses_to_start(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    first = await ready(scheduler, spawn, worker_id="holder")
    second = spawn(worker_id="intruder")
    code = await asyncio.to_thread(second.wait, 30)
    assert code == 2
    assert "slot 1 is already held by worker 'holder'" in second.tail()
    # The holder is undisturbed and still serves its slot.
    await scheduler.send(scheduler.assignment("still", worker_id="holder", slot=SLOT))
    assert isinstance(await scheduler.terminal("still"), Done)
    assert first.proc is not None and first.proc.poll() is None
    assert not [h for h in scheduler.seen.heartbeats if h.worker_id == "intruder"]


async def test_two_workers_started_together_leave_exactly_one_on_the_slot(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    """Both may pass the start check; the slot group's assignor then picks one."""
    pair = {"twin-a": spawn(worker_id="twin-a"), "twin-b": spawn(worker_id="twin-b")}
    await scheduler.wait_until(lambda: scheduler.seen.heartbeats, timeout_s=20,
                               what="a heartbeat")
    for _ in range(300):
        if any(p.proc is not None and p.proc.poll() is not None for p in pair.values()):
            break
        await asyncio.sleep(0.1)
    exited = {w: p for w, p in pair.items() if p.proc is not None and p.proc.poll() is not None}
    assert len(exited) == 1, {w: p.tail() for w, p in pair.items()}
    loser = next(iter(exited.values()))
    assert loser.wait() == 2 and "already held by" in loser.tail()
    (winner,) = set(pair) - set(exited)
    await scheduler.send(scheduler.assignment("one", worker_id=winner, slot=SLOT))
    assert isinstance(await scheduler.terminal("one"), Done)
    assert {h.worker_id for h in scheduler.seen.heartbeats} == {winner}


async def test_a_killed_worker_restarts_and_redoes_only_unfinished_requests(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    """At-least-once with little redo: requests that finished above a still-open one are
    listed in the commit metadata, so the restarted worker (same id, waiting for its dead
    incarnation to leave the slot group) skips them and runs only the open one again."""
    first = await ready(scheduler, spawn)
    await scheduler.send(scheduler.assignment("open", worker_id=WID, slot=SLOT,
                                              max_tokens=20_000))  # ~1.2 s at 100x
    for i in range(3):
        await scheduler.send(scheduler.assignment(f"quick-{i}", worker_id=WID, slot=SLOT))
    for i in range(3):
        assert isinstance(await scheduler.terminal(f"quick-{i}"), Done)
    await asyncio.sleep(0.3)  # let the commit (offset 0, metadata: 1, 2, 3 finished) land
    assert not scheduler.terminals_of("open")
    first.signal(signal.SIGKILL)
    assert await asyncio.to_thread(first.wait, 10) == -signal.SIGKILL
    started_before = [h.started_at for h in scheduler.seen.heartbeats]
    await ready(scheduler, spawn)  # waits out the dead member (session timeout 6 s)
    done = await scheduler.terminal("open", timeout_s=20)
    assert isinstance(done, Done) and done.usage.completion_tokens == 20_000
    await scheduler.send(scheduler.assignment("fresh", worker_id=WID, slot=SLOT))
    assert isinstance(await scheduler.terminal("fresh"), Done)
    assert all(len(scheduler.terminals_of(f"quick-{i}")) == 1 for i in range(3))
    starts = [e for e in scheduler.events_of("open") if e.kind == "event.started"]
    assert len(starts) == 2  # the unfinished one ran again: at-least-once
    assert max(h.started_at for h in scheduler.seen.heartbeats) > max(started_before)


async def test_a_restarted_worker_drops_what_the_scheduler_ended_while_it_was_down(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    """The slot holds three uncommitted assignments (its previous process died), and the
    scheduler (played here) declared that process lost before this one started: it ended
    "streamed" worker_lost and requeued "moved" as attempt 2 on another slot. Only
    "pending" runs; the other two must not get a second terminal for attempt 1."""
    for rid in ("streamed", "moved", "pending"):
        await scheduler.send(scheduler.assignment(rid, worker_id=WID, slot=SLOT))
    await scheduler.send_event(EventFailed(
        request_id="streamed", tenant=TENANT, attempt=1, worker_id=WID, ts=time.time(),
        code="worker_lost", message="worker lost after streaming"))
    await scheduler.send(scheduler.assignment("moved", worker_id="elsewhere", slot=0,
                                              attempt=2))
    await ready(scheduler, spawn)
    assert isinstance(await scheduler.terminal("pending"), Done)
    await asyncio.sleep(1.0)  # what would have come for the other two by now
    assert scheduler.terminals_of("streamed") == [] and scheduler.terminals_of("moved") == []
    started = {e.request_id for e in scheduler.seen.events if e.kind == "event.started"}
    assert started == {"pending"}


async def test_a_worker_drops_assignments_stamped_for_another_process_of_itself(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    """Fencing: the slot holds two uncommitted assignments stamped for an earlier process
    of this worker (it died; the scheduler requeues or ends their work when it sees the new
    process's heartbeat) and one unstamped (an older scheduler's: the replay check finds it
    not ended, so it runs). After start, one stamped for this process runs, and a late one
    stamped for the old process (placed on a stale view) is dropped too: no run, no
    terminal, no event for any of the old process's work, whatever the timing."""
    old = time.time() - 50.0
    for rid in ("old-a", "old-b"):
        await scheduler.send(scheduler.assignment(rid, worker_id=WID, slot=SLOT,
                                                  worker_started_at=old))
    await scheduler.send(scheduler.assignment("legacy", worker_id=WID, slot=SLOT))
    spawn()
    hb = await scheduler.heartbeat(WID)
    await scheduler.send(scheduler.assignment("current", worker_id=WID, slot=SLOT,
                                              worker_started_at=hb.started_at))
    await scheduler.send(scheduler.assignment("stray", worker_id=WID, slot=SLOT,
                                              worker_started_at=old))
    await scheduler.send(scheduler.assignment("marker", worker_id=WID, slot=SLOT,
                                              worker_started_at=hb.started_at))
    for rid in ("legacy", "current", "marker"):
        assert isinstance(await scheduler.terminal(rid), Done)
    await asyncio.sleep(1.0)  # what would have come for the others by now
    for rid in ("old-a", "old-b", "stray"):
        assert scheduler.terminals_of(rid) == [] and scheduler.events_of(rid) == []


async def streaming(scheduler: FakeScheduler, started_at: float,
                    max_tokens: dict[str, int]) -> None:
    """Place one request per entry on the worker's ``started_at`` process and wait until
    each has streamed its first token."""
    for rid, tokens in max_tokens.items():
        await scheduler.send(scheduler.assignment(rid, worker_id=WID, slot=SLOT,
                                                  max_tokens=tokens, timeout_s=300.0,
                                                  worker_started_at=started_at))
    await scheduler.wait_until(
        lambda: all(any(e.kind == "event.first_token" for e in scheduler.events_of(rid))
                    for rid in max_tokens), 20, "all streaming")


async def pause(proc: WorkerProcess, seconds: float) -> float:
    """SIGSTOP the worker for ``seconds``; the time it was resumed."""
    proc.signal(signal.SIGSTOP)
    await asyncio.sleep(seconds)
    resumed_at = time.time()
    proc.signal(signal.SIGCONT)
    return resumed_at


async def test_a_worker_paused_past_its_lease_fences_itself_and_serves_on(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    """SIGSTOP longer than the scheduler's staleness bound (3 × 0.2 s here) but shorter than
    the 6 s session timeout: the worker keeps its slot, but a scheduler has declared it dead
    by then and requeued or ended its work. On SIGCONT it must not answer that work (a
    second terminal). It asks the scheduler first, and this fake never answers (as an older
    scheduler would not): after ``lease_ask_beats`` its runs end unanswered, and it goes on
    as a new incarnation (a newer ``started_at``), serving what is placed on that one and
    dropping what was stamped for the earlier one."""
    proc = await ready(scheduler, spawn, time_scale=0.1)
    old_started = (await scheduler.heartbeat(WID)).started_at
    # ~90 s and ~5 s of decode
    await streaming(scheduler, old_started, {"long": 100_000, "mid": 6_000})
    resumed_at = await pause(proc, 2.5)
    beat = await scheduler.heartbeat(WID, where=lambda hb: hb.started_at > old_started)
    assert beat.started_at - old_started < 0.01  # the same process, a new incarnation
    await scheduler.send(scheduler.assignment("stamped-old", worker_id=WID, slot=SLOT,
                                              worker_started_at=old_started))
    await scheduler.send(scheduler.assignment("after", worker_id=WID, slot=SLOT,
                                              worker_started_at=beat.started_at))
    assert isinstance(await scheduler.terminal("after"), Done)
    await asyncio.sleep(6.0)  # "mid" would have finished by now
    for rid in ("long", "mid", "stamped-old"):
        assert scheduler.terminals_of(rid) == [], (rid, scheduler.terminals_of(rid))
        assert [c for c in chunks_of(scheduler, rid) if c.ts >= resumed_at] == [], rid
    assert proc.proc is not None and proc.proc.poll() is None  # still serving


@pytest.mark.parametrize("granted", [True, False], ids=["granted", "refused"])
async def test_a_worker_past_its_lease_holds_its_output_and_asks_the_scheduler(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess], granted: bool
) -> None:
    """SIGSTOP past the lease: on SIGCONT the worker does not know whether the scheduler
    noticed, so it holds every run's output and asks (heartbeats with ``renew``). Granted
    (the scheduler had not declared it dead): the runs go on, each ends with one ``Done``,
    and the process stays the same incarnation. Refused: it fences as if nobody answered —
    no terminal, a new incarnation."""
    # Beats every 0.5 s: a grant counts only while the beat it answers is younger than the
    # lease (1.375 s), and this fake answers slower than the real scheduler.
    proc = await ready(scheduler, spawn, time_scale=0.1, heartbeat_s=0.5,
                       extra_args=("--lease-ask-beats", "10"))  # 5 s to answer in
    old_started = (await scheduler.heartbeat(WID)).started_at
    await streaming(scheduler, old_started, {"a": 6_000, "b": 6_000})  # ~5 s of decode each
    resumed_at = await pause(proc, 2.5)
    first = await scheduler.heartbeat(WID, where=lambda hb: hb.renew)
    assert first.started_at == old_started
    await asyncio.sleep(0.6)  # held: nothing of either run goes out before the answer
    for rid in ("a", "b"):
        assert [c for c in chunks_of(scheduler, rid) if c.ts >= resumed_at] == [], rid
        assert scheduler.terminals_of(rid) == [], rid
    ask = await scheduler.heartbeat(WID, where=lambda hb: hb.renew)  # the newest asking
    await scheduler.answer_lease(ask, granted)
    if granted:
        for rid in ("a", "b"):
            assert isinstance(await scheduler.terminal(rid), Done)
        assert [c for c in chunks_of(scheduler, "a") if c.ts >= resumed_at]  # went on
        await scheduler.heartbeat(WID, where=lambda hb: hb.seq > ask.seq and not hb.renew)
        assert {hb.started_at for hb in scheduler.seen.heartbeats if hb.worker_id == WID} \
            == {old_started}  # never fenced
    else:
        beat = await scheduler.heartbeat(WID, where=lambda hb: hb.started_at > old_started)
        assert not beat.renew
        await asyncio.sleep(6.0)  # both would have finished by now
        for rid in ("a", "b"):
            assert scheduler.terminals_of(rid) == [], (rid, scheduler.terminals_of(rid))
    for rid in ("a", "b"):
        assert len(scheduler.terminals_of(rid)) <= 1
    assert proc.proc is not None and proc.proc.poll() is None


async def test_a_paused_worker_whose_slot_was_taken_over_ends_its_runs_unanswered(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess]
) -> None:
    """SIGSTOP past the session timeout: the broker expires the process and a new process of
    the same worker takes the slot (the scheduler, seeing its heartbeat, requeues or ends the
    old one's work). On SIGCONT the old process must neither take the slot back nor finish
    its in-flight request (a second terminal): it ends it unanswered and drains out."""
    old = await ready(scheduler, spawn, time_scale=0.1)
    old_started = (await scheduler.heartbeat(WID)).started_at
    await scheduler.send(scheduler.assignment("long", worker_id=WID, slot=SLOT,
                                              max_tokens=100_000, timeout_s=300.0,
                                              worker_started_at=old_started))  # ~90 s
    await scheduler.wait_until(
        lambda: [e for e in scheduler.events_of("long") if e.kind == "event.started"],
        20, "long started")
    old.signal(signal.SIGSTOP)
    await asyncio.sleep(7.0)  # past the 6 s session timeout
    new = spawn()
    new_beat = await scheduler.heartbeat(WID, where=lambda hb: hb.started_at > old_started)
    old.signal(signal.SIGCONT)
    assert await asyncio.to_thread(old.wait, 40) == 0  # drained out
    assert scheduler.terminals_of("long") == [], scheduler.terminals_of("long")
    await scheduler.send(scheduler.assignment("after", worker_id=WID, slot=SLOT,
                                              worker_started_at=new_beat.started_at))
    assert isinstance(await scheduler.terminal("after"), Done)  # the new one has the slot
    assert new.proc is not None and new.proc.poll() is None


async def test_a_worker_whose_producer_can_no_longer_send_exits_1(
    scheduler: FakeScheduler, spawn: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """The broker answers OUT_OF_ORDER_SEQUENCE_NUMBER (FAULT INJECTION on the answer:
    tests/fakes/sender_fault), after which aiokafka fails every later batch to the
    partition. Before, the worker lived on without a voice: its heartbeats failing, its
    lease lapsed, fenced for good. Now it stops at once, exit 1, so a supervisor restarts
    it with a producer that sends."""
    trigger = tmp_path / "sender-fault"
    proc = await ready(scheduler, spawn, env=sender_fault.env(trigger))
    trigger.touch()  # the next heartbeat's produce request fails
    assert await asyncio.to_thread(proc.wait, 30) == 1, proc.tail()
    assert "can no longer send" in proc.tail()
