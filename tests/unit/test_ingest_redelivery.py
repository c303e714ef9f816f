"""RedeliveryCheck: which intake records read again were answered the first time.

The Kafka reads are the check's own injected interfaces (the real ones are tested against
the broker in tests/integration/test_ingest_redelivery.py); here a list of records stands
for the partition and a set of ids for what the reply topics hold.
"""

from __future__ import annotations

import asyncio

import pytest

from schemas.codec import encode
from schemas.requests import InferenceRequest
from services.ingest.redelivery import RedeliveryCheck
from tests.builders_schemas import make_prompt_request

TOPIC = "llmq.intake"
Wanted = dict[tuple[str, int], tuple[str, bytes, float]]  # (request_id, offset) -> ...


def _request(rid: str, tenant: str = "acme") -> InferenceRequest:
    return make_prompt_request("hi", request_id=rid, tenant=tenant, model="m", max_tokens=4,
                               created_at=1_000.0)


class Partition:
    """Partition 0 of the intake topic: records at offsets 0.., the offsets whose answer
    (naming its record) is on a reply topic, and the requests holding a reservation."""

    def __init__(self, records: list[tuple[bytes | None, bytes | None]], *,
                 answered: set[int] = frozenset(), reserved: set[str] = frozenset()) -> None:
        self.records = records
        self.answered = set(answered)
        self.reserved = set(reserved)
        self.reads: list[tuple[int, int]] = []
        self.asked: list[Wanted] = []
        self.ends_asked = 0
        self.fail_reads = False

    async def end_offsets(self, topic: str, partitions: list[int]) -> dict[int, int]:
        assert topic == TOPIC
        self.ends_asked += 1
        return {p: len(self.records) if p == 0 else 0 for p in partitions}

    async def read_range(self, topic: str, partition: int, low: int,
                         high: int) -> list[tuple[int, bytes | None, bytes | None, int]]:
        assert (topic, partition) == (TOPIC, 0)
        if self.fail_reads:
            raise OSError("broker away")
        self.reads.append((low, high))
        return [(o, *self.records[o], 1_000_000 + o) for o in range(low, high)]

    async def find(self, partition: int, wanted: Wanted) -> set[int]:
        assert partition == 0
        self.asked.append(wanted)
        return {offset for _, offset in wanted if offset in self.answered}

    def check(self, batch: int = 2) -> RedeliveryCheck:
        return RedeliveryCheck(
            TOPIC, target=lambda req: f"llmq.replies.{req.tenant}",
            reserved=self.reserved.__contains__, end_offsets=self.end_offsets,
            read_range=self.read_range, find_answered=self.find, batch=batch,
        )


def _records(*ids: str) -> list[tuple[bytes | None, bytes | None]]:
    return [(b"acme", encode(_request(rid))) for rid in ids]


async def test_records_past_the_end_at_assignment_are_new_and_not_checked() -> None:
    part = Partition(_records("a", "b"), answered={0, 1})
    check = part.check()
    check.assigned([0])
    assert not await check.answered_before(0, 2, "c")
    assert not await check.answered_before(1, 0, "x")  # a partition with nothing below
    assert part.reads == [] and part.asked == []


async def test_a_record_answered_before_is_found_and_one_never_answered_is_not() -> None:
    part = Partition(_records("refused", "new"), answered={0})
    check = part.check()
    check.assigned([0])
    assert await check.answered_before(0, 0, "refused")
    assert not await check.answered_before(0, 1, "new")
    # One batch, read from the first record asked about; each record looked for where its
    # refusal went, from its own time on.
    assert part.reads == [(0, 2)]
    [wanted] = part.asked
    assert wanted == {("refused", 0): ("llmq.replies.acme", b"refused", 1_000.0),
                      ("new", 1): ("llmq.replies.acme", b"new", 1_000.001)}


async def test_a_retry_under_a_refused_id_is_decided_whatever_batch_it_is_in() -> None:
    # r1 refused (its answer names offset 0), then the client retried it with the same id
    # before the crash: the retry was never read. Same batch, or a later one.
    for batch in (10, 1):
        part = Partition(_records("r1", "r2", "r1"), answered={0})
        check = part.check(batch=batch)
        check.assigned([0])
        assert await check.answered_before(0, 0, "r1")
        assert not await check.answered_before(0, 1, "r2")
        assert not await check.answered_before(0, 2, "r1")
        assert not await check.answered_before(0, 0, "r9")  # another id at that offset


async def test_batches_go_on_while_the_old_owner_had_got_there_and_stop_after() -> None:
    # The old owner read 0..4 (refused two, admitted one) and stopped; 5.. it never read.
    ids = [f"r{i}" for i in range(12)]
    part = Partition(_records(*ids), answered={1, 3}, reserved={"r4"})
    check = part.check(batch=2)
    check.assigned([0])
    seen = [await check.answered_before(0, i, rid) for i, rid in enumerate(ids)]
    assert seen == [i in (1, 3) for i in range(12)]
    # [0,2) found r1, [2,4) found r3, [4,6) held r4's reservation, [6,8) nothing: done.
    assert part.reads == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert check.batches == 4
    # The reserved request is not looked up: the handler sends its admission again.
    assert all(("r4", 4) not in w for w in part.asked)


async def test_records_moved_here_or_unreadable_are_not_looked_up() -> None:
    moved = (b"not-the-tenant", encode(_request("moved")))
    part = Partition([moved, (b"acme", b"{broken"), *_records("plain")], answered={0})
    check = part.check(batch=10)
    check.assigned([0])
    assert not await check.answered_before(0, 0, "moved")
    [wanted] = part.asked
    assert list(wanted) == [("plain", 2)]


async def test_the_first_asked_record_is_where_the_batch_begins() -> None:
    part = Partition(_records("a", "b", "c", "d"), answered={3})
    check = part.check(batch=2)
    check.assigned([0])
    assert await check.answered_before(0, 3, "d")  # committed at 3: 0..2 are not read
    assert part.reads == [(3, 4)]


async def test_a_failed_batch_decides_afresh_and_ends_the_checks_of_its_partition() -> None:
    part = Partition(_records("a", "b", "c"), answered={0, 1})
    part.fail_reads = True
    check = part.check(batch=1)
    check.assigned([0])
    assert not await check.answered_before(0, 0, "a")
    part.fail_reads = False
    assert not await check.answered_before(0, 1, "b")  # not tried again (each would wait)
    assert part.reads == []
    check.assigned([0])  # the next assignment checks again
    assert await check.answered_before(0, 1, "b")


async def test_no_end_offset_means_no_check() -> None:
    part = Partition(_records("a"), answered={0})

    async def down(topic: str, partitions: list[int]) -> dict[int, int]:
        raise OSError("broker away")

    check = RedeliveryCheck(TOPIC, target=lambda req: "t", reserved=lambda rid: False,
                            end_offsets=down, read_range=part.read_range,
                            find_answered=part.find)
    check.assigned([0])
    assert not await check.answered_before(0, 0, "a")
    assert part.reads == []


async def test_a_new_assignment_forgets_what_the_last_one_found() -> None:
    part = Partition(_records("a", "b"), answered={0})
    check = part.check(batch=10)
    check.assigned([0])
    assert await check.answered_before(0, 0, "a")
    part.answered.clear()  # (the new owner's view: asked again, from its own start)
    check.assigned([0])
    assert not await check.answered_before(0, 0, "a")
    assert part.ends_asked == 2 and part.reads == [(0, 2), (0, 2)]
    check.assigned([])
    assert not await check.answered_before(0, 0, "a")


async def test_records_asked_about_together_share_one_batch() -> None:
    part = Partition(_records("a", "b", "c"), answered={1})
    check = part.check(batch=10)
    check.assigned([0])
    found = await asyncio.gather(*(check.answered_before(0, i, rid)
                                   for i, rid in enumerate("abc")))
    assert found == [False, True, False] and check.batches == 1


def test_a_batch_of_no_records_is_refused() -> None:
    part = Partition([])
    with pytest.raises(ValueError, match="batch"):
        part.check(batch=0)


async def test_a_check_cancelled_with_its_caller_is_not_taken_for_a_new_assignment() -> None:
    part = Partition(_records("a", "b"), answered={0, 1})
    gate = asyncio.Event()
    ends = part.end_offsets

    async def slow_end(topic: str, partitions: list[int]) -> dict[int, int]:
        await gate.wait()
        return await ends(topic, partitions)

    part.end_offsets = slow_end  # type: ignore[method-assign]
    check = part.check()
    check.assigned([0])
    waiting = asyncio.ensure_future(check.answered_before(0, 0, "a"))
    await asyncio.sleep(0)
    waiting.cancel()  # the agent stopped: its cancel goes on up
    with pytest.raises(asyncio.CancelledError):
        await waiting
    gate.set()
    assert await check.answered_before(0, 1, "b")  # the partition's check still works


def test_an_answer_names_its_record_by_partition_and_offset() -> None:
    from aiokafka import ConsumerRecord

    from schemas.topics import INTAKE_RECORD_HEADER
    from services.ingest.redelivery import answered_record
    from tests.builders_schemas import make_error

    def record(*headers: tuple[str, bytes]) -> ConsumerRecord[bytes, bytes]:
        return ConsumerRecord("t", 0, 5, 0, 0, b"r1", b"", None, 0, 0, list(headers))

    reply = make_error(request_id="r1", attempt=0, code="rate_limited")
    assert answered_record(2, record((INTAKE_RECORD_HEADER, b"2/17")), reply) == ("r1", 17)
    assert answered_record(3, record((INTAKE_RECORD_HEADER, b"2/17")), reply) is None
    assert answered_record(2, record(("traceparent", b"x")), reply) is None
    assert answered_record(2, record((INTAKE_RECORD_HEADER, b"2/x")), reply) is None
    assert answered_record(2, record((INTAKE_RECORD_HEADER, None)), reply) is None  # type: ignore[arg-type]
