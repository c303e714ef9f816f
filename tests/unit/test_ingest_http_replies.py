"""ReplyStream / ReplyRouter client rules (no broker): dedupe, newest attempt, one terminal."""

from __future__ import annotations

import asyncio

import pytest

from schemas.replies import Done, Error, TokenChunk
from services.common.replies import DuplicateRequestError, Reply, ReplyRouter, ReplyStream
from tests.builders_schemas import make_chunk, make_done, make_error


def chunk(seq: int, attempt: int = 1, rid: str = "r1", text: str | None = None) -> TokenChunk:
    return make_chunk(request_id=rid, attempt=attempt, seq=seq, text=text or f"t{seq}")


def done(attempt: int = 1, rid: str = "r1") -> Done:
    return make_done(request_id=rid, attempt=attempt)


def error(attempt: int = 0, rid: str = "r1") -> Error:
    return make_error(request_id=rid, attempt=attempt, code="rate_limited", retry_after_s=1.0)


def _drain(stream: ReplyStream) -> list[Reply]:
    out = []
    while (msg := stream.get_nowait()) is not None:
        out.append(msg)
    return out


def _offer_all(stream: ReplyStream, msgs: list[Reply]) -> list[bool]:
    return [stream.offer(m) for m in msgs]


def test_duplicate_chunks_are_dropped() -> None:
    stream = ReplyStream("r1")
    accepted = _offer_all(stream, [chunk(0), chunk(0), chunk(1), chunk(0), chunk(1), done()])
    assert accepted == [True, False, True, False, False, True]
    assert [getattr(m, "seq", "end") for m in _drain(stream)] == [0, 1, "end"]


def test_chunks_come_out_in_seq_order_whatever_order_they_landed_in() -> None:
    """Found by an audit: a worker sends a chunk whose delivery failed again before its
    reply, after the chunks that followed it; clients joined the text in arrival order."""
    stream = ReplyStream("r1")
    accepted = _offer_all(stream, [chunk(0), chunk(2), chunk(3), chunk(2)])
    assert accepted == [True, True, True, False]
    assert [m.seq for m in _drain(stream) if isinstance(m, TokenChunk)] == [0]  # 2, 3 held
    assert stream.offer(chunk(1)) and stream.offer(chunk(4)) and stream.offer(done())
    assert [getattr(m, "seq", "end") for m in _drain(stream)] == [1, 2, 3, 4, "end"]


def test_the_terminal_lets_held_chunks_out_and_a_newer_attempt_voids_them() -> None:
    stream = ReplyStream("r1")
    _offer_all(stream, [chunk(0), chunk(2), chunk(5)])
    stream.offer(done())  # a gap no chunk will fill any more: what is held, in order
    assert [getattr(m, "seq", "end") for m in _drain(stream)] == [0, 2, 5, "end"]
    newer = ReplyStream("r1")
    _offer_all(newer, [chunk(1), chunk(0, attempt=2), done(attempt=2)])
    assert [(m.attempt, getattr(m, "seq", "end")) for m in _drain(newer)] == [
        (2, 0), (2, "end")]


def test_stale_attempts_are_dropped_and_newer_ones_supersede() -> None:
    stream = ReplyStream("r1")
    accepted = _offer_all(stream, [
        chunk(0, attempt=2), chunk(0, attempt=1), done(attempt=1),  # old attempt: dropped
        chunk(1, attempt=2), chunk(0, attempt=3), chunk(0, attempt=3), done(attempt=3),
    ])
    assert accepted == [True, False, False, True, True, False, True]
    assert stream.attempt == 3
    assert isinstance(stream.terminal, Done) and stream.terminal.attempt == 3


def test_terminal_is_accepted_once() -> None:
    stream = ReplyStream("r1")
    assert stream.offer(error(attempt=0))
    assert stream.finished
    assert not stream.offer(done())  # a later terminal, even of a newer attempt
    assert not stream.offer(error(attempt=0))
    assert not stream.offer(chunk(5, attempt=4))
    assert [type(m) for m in _drain(stream)] == [Error]


def test_foreign_request_ids_are_refused() -> None:
    assert not ReplyStream("r1").offer(chunk(0, rid="r2"))


async def test_iteration_ends_at_the_terminal() -> None:
    stream = ReplyStream("r1")
    for msg in [chunk(0), chunk(1), done(), chunk(2)]:
        stream.offer(msg)
    got = [msg async for msg in stream]
    assert [type(m) for m in got] == [TokenChunk, TokenChunk, Done]


async def test_get_times_out() -> None:
    with pytest.raises(TimeoutError):
        await ReplyStream("r1").get(timeout=0.01)


async def test_get_wakes_on_offer() -> None:
    stream = ReplyStream("r1")
    waiter = asyncio.create_task(stream.get(timeout=5))
    await asyncio.sleep(0)
    stream.offer(chunk(0))
    assert isinstance(await waiter, TokenChunk)


def test_router_routes_by_request_id() -> None:
    router = ReplyRouter("127.0.0.1:1", "llmq.replies.x")  # never started: route() is pure
    a, b = router.open("a"), router.open("b")
    assert router.route(chunk(0, rid="a"))
    assert not router.route(chunk(0, rid="a"))  # duplicate
    assert router.route(done(rid="b"))
    assert not router.route(chunk(0, rid="nobody"))
    assert [m.request_id for m in _drain(a)] == ["a"] and isinstance(_drain(b)[0], Done)
    with pytest.raises(DuplicateRequestError):
        router.open("a")
    router.close("a")
    router.close("a")  # idempotent
    assert not router.route(chunk(1, rid="a"))
    assert router.open_requests == 1 and not router.assigned


def test_a_newer_attempt_drops_what_is_queued_of_the_older_one() -> None:
    # Attempt 1's chunks were accepted but not read yet when attempt 2 started: they are
    # void, so the reader never sees them (before, it got them and then attempt 2's).
    stream = ReplyStream("r1")
    _offer_all(stream, [chunk(0, attempt=1), chunk(1, attempt=1), chunk(0, attempt=2),
                        chunk(1, attempt=2), done(attempt=2)])
    assert [(m.attempt, getattr(m, "seq", "end")) for m in _drain(stream)] == [
        (2, 0), (2, 1), (2, "end")]


async def test_close_ends_the_readers_after_what_was_accepted() -> None:
    stream = ReplyStream("r1")
    waiting = asyncio.create_task(stream.get(timeout=30))
    await asyncio.sleep(0)
    stream.close("client stopped")
    with pytest.raises(RuntimeError, match="client stopped"):  # woken at once
        await asyncio.wait_for(waiting, 1)
    stream = ReplyStream("r1")
    stream.offer(chunk(0))
    stream.close("client stopped")
    stream.close("again")  # idempotent: the first reason stands
    assert not stream.offer(chunk(1))
    assert isinstance(await stream.get(), TokenChunk)  # accepted before close: still read
    for _ in range(2):  # and every later read ends the same way
        with pytest.raises(RuntimeError, match="client stopped"):
            await stream.get(timeout=1)
    with pytest.raises(RuntimeError, match="client stopped"):
        stream.get_nowait()
