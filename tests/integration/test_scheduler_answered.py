"""``services.common.answered`` against the real broker: which lost attempts
already have a terminal reply on their reply partition, among other requests' replies,
read newest window first."""

from __future__ import annotations

import time

import pytest

from schemas.codec import encode
from services.common.answered import CLOCK_MARGIN_S, answered
from services.common.kafka import TopicRequest, ensure_topics, make_producer
from tests.builders_schemas import make_chunk, make_done, make_error
from tests.fakes.ports import free_port

pytestmark = pytest.mark.kafka

Wanted = tuple[tuple[str, int], tuple[str, bytes, float]]


async def _produce(bootstrap: str, topic: str, records: list[tuple[str, object]]) -> None:
    """``records`` ((key, reply)) onto partition 0 of ``topic``, in order."""
    await ensure_topics(bootstrap, [TopicRequest(topic, 1)])
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        for key, reply in records:
            await producer.send(topic, encode(reply), key=key.encode(), partition=0)
        await producer.flush()
    finally:
        await producer.stop()


def _chunks(n: int, ts: float) -> list[tuple[str, object]]:
    """``n`` chunk records of 50 other requests."""
    return [(f"r{i % 50}", make_chunk(request_id=f"r{i % 50}", attempt=1, seq=i // 50, ts=ts))
            for i in range(n)]


async def test_only_terminals_of_the_wanted_attempts_under_their_key_count(
    bootstrap: str, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.replies.acme"
    await ensure_topics(bootstrap, [TopicRequest(topic, 1)])
    now = time.time()
    # (key, reply): one partition, as a busy tenant's reply partition looks.
    records = [
        *[(f"r{i}", make_chunk(request_id=f"r{i}", attempt=1, seq=0, ts=now))
          for i in range(300)],
        ("done-1", make_done(request_id="done-1", attempt=1, ts=now)),
        ("err-2", make_error(request_id="err-2", attempt=2, code="cancelled", ts=now)),
        # Its attempt 1 ended, but the lost attempt is 2: not answered.
        ("old-attempt", make_done(request_id="old-attempt", attempt=1, ts=now)),
        # Chunks are not terminals.
        ("chunk-only", make_chunk(request_id="chunk-only", attempt=1, seq=0, ts=now)),
        # A terminal written under another request's key is on that request's partition,
        # not read as this one's (replies are keyed by request_id: DESIGN.md).
        ("r7", make_done(request_id="misfiled", attempt=1, ts=now)),
    ]
    await _produce(bootstrap, topic, records)

    def wanted(rid: str, attempt: int, assigned_at: float = now) -> Wanted:
        return (rid, attempt), (topic, rid.encode(), assigned_at)

    check = await answered(bootstrap, dict([
        wanted("done-1", 1), wanted("err-2", 2), wanted("old-attempt", 2),
        wanted("chunk-only", 1), wanted("misfiled", 1), wanted("never-seen", 1),
    ]), timeout_s=30)
    assert check.found == {("done-1", 1), ("err-2", 2)}
    assert check.complete

    # Read from the assignment time less the clock margin: a reply written before it
    # is not this attempt's.
    later = now + CLOCK_MARGIN_S + 60
    check = await answered(bootstrap, dict([wanted("done-1", 1, later)]), timeout_s=30)
    assert check.found == set()
    assert check.complete


async def test_windows_back_from_the_end_read_every_record_once(
    bootstrap: str, topic_prefix: str
) -> None:
    """Windows of 100, 400, 1,600 … records back from the end: terminals on either side of
    each boundary and at the very first offset are all found, and while one wanted attempt
    has no terminal, every record is read exactly once, down to the oldest."""
    topic = f"{topic_prefix}.replies.acme"
    now = time.time()
    total = 3_005
    # offset -> the terminal there: windows are [total-100, total), [total-500, total-100),
    # [total-2,100, total-500), then down to 0.
    terminals = {total - 100: "first-window-oldest", total - 101: "second-window-newest",
                 total - 500: "second-window-oldest", total - 501: "third-window-newest",
                 0: "very-first"}
    chunks = iter(_chunks(total - len(terminals), now))
    records = [(terminals[offset], make_done(request_id=terminals[offset], attempt=1, ts=now))
               if offset in terminals else next(chunks) for offset in range(total)]
    await _produce(bootstrap, topic, records)
    rids = ["first-window-oldest", "second-window-newest", "second-window-oldest",
            "third-window-newest", "very-first", "never-answered"]
    check = await answered(
        bootstrap, {(rid, 1): (topic, rid.encode(), now) for rid in rids},
        timeout_s=30, first_window=100)
    assert check.found == {(rid, 1) for rid in rids if rid != "never-answered"}
    assert check.complete
    assert check.records_read == len(records)


async def test_reading_stops_once_every_wanted_attempt_is_found(
    bootstrap: str, topic_prefix: str
) -> None:
    """A terminal written just before its worker died is at the end of the partition: the
    check finds it in the first window instead of reading the attempt's whole lifetime."""
    topic = f"{topic_prefix}.replies.acme"
    now = time.time()
    records = [*_chunks(5_000, now), ("late", make_done(request_id="late", attempt=1, ts=now)),
               *_chunks(20, now)]
    await _produce(bootstrap, topic, records)
    check = await answered(bootstrap, {("late", 1): (topic, b"late", now)}, timeout_s=30,
                           first_window=100)
    assert check.found == {("late", 1)}
    assert check.complete
    assert check.records_read <= 100


async def test_an_unreachable_broker_is_an_incomplete_check_not_an_exception(
    topic_prefix: str,
) -> None:
    """The caller treats what was not found as unanswered; it must not crash."""
    bootstrap = f"127.0.0.1:{free_port()}"
    check = await answered(
        bootstrap, {("x", 1): (f"{topic_prefix}.replies.acme", b"x", time.time())},
        timeout_s=3)
    assert check.found == set()
    assert not check.complete


async def test_a_reply_topic_that_is_not_there_leaves_only_its_own_attempts_unanswered(
    bootstrap: str, topic_prefix: str
) -> None:
    """Found by an audit: the partitions of every wanted topic were looked up first, each
    waiting up to 30 s for its topic, so one deleted reply topic outlasted the whole check
    and an answered attempt checked beside it got a second terminal."""
    topic = f"{topic_prefix}.replies.acme"
    now = time.time()
    await _produce(bootstrap, topic, [("done-1", make_done(request_id="done-1", attempt=1,
                                                           ts=now))])
    started = time.monotonic()
    check = await answered(bootstrap, {
        ("done-1", 1): (topic, b"done-1", now),
        ("gone-1", 1): (f"{topic_prefix}.replies.deleted", b"gone-1", now),
    }, timeout_s=10)
    assert check.found == {("done-1", 1)}
    assert not check.complete  # the deleted topic's attempt was not read
    assert time.monotonic() - started < 5
