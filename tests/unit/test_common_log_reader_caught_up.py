"""``LogReader.caught_up_at``: since when everything written to a topic was handled. The
consumer is a stand-in with aiokafka's ``highwater`` / ``last_poll_timestamp`` (its real
use, with a real broker, is in tests/integration/test_scheduler_replicas.py)."""

from __future__ import annotations

from aiokafka import TopicPartition

from services.common.guard import Guard
from services.common.log_reader import LogReader

A0, A1, B0 = TopicPartition("a", 0), TopicPartition("a", 1), TopicPartition("b", 0)


class Polled:
    def __init__(self, ends: dict[TopicPartition, tuple[int | None, int | None]]) -> None:
        self.ends = ends
        self.positions: dict[TopicPartition, int] = {}

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.ends[tp][0]

    def last_poll_timestamp(self, tp: TopicPartition) -> int | None:
        return self.ends[tp][1]

    async def position(self, tp: TopicPartition) -> int:
        return self.positions[tp]


async def _nowhere(key: bytes | None, value: bytes | None, headers: object) -> None: ...


def reader(ends: dict[TopicPartition, tuple[int | None, int | None]],
           handled: dict[TopicPartition, int]) -> LogReader:
    r = LogReader("127.0.0.1:1", {"a": lambda rec: None, "b": lambda rec: None},
                  Guard(_nowhere, name="test"))  # type: ignore[arg-type]
    r._consumer, r._tps, r._handled = Polled(ends), [A0, A1, B0], handled
    return r


def test_the_oldest_fetch_of_a_topic_read_to_its_end_counts() -> None:
    r = reader({A0: (5, 10_500), A1: (0, 10_200), B0: (9, 9_000)}, {A0: 5, B0: 3})
    assert r.caught_up_at("a") == 10.2  # both partitions at their end; the older fetch
    assert r.caught_up_at("b") == 0.0  # 3 of 9 handled: behind


async def test_a_partition_whose_last_records_were_compacted_away_counts_as_read() -> None:
    # "a"/1 ends at offset 7, but its records 3..6 were compacted away (a worker's
    # heartbeats, a week after it left): the consumer's position moved to 7 past the
    # empty batch the broker keeps, with only 3 records handled. Counted behind, it held
    # caught_up_at("a") at 0.0 for good (the code before), and with it every loss the
    # scheduler decides from the heartbeats.
    r = reader({A0: (5, 10_500), A1: (7, 10_200), B0: (9, 9_000)}, {A0: 5, A1: 3, B0: 3})
    assert r.caught_up_at("a") == 0.0
    r._consumer.positions = {A0: 5, A1: 7, B0: 3}  # type: ignore[attr-defined]
    await r._skip_empty_tails()  # between batches: every record before a position handled
    assert r.caught_up_at("a") == 10.2
    assert r.caught_up_at("b") == 0.0  # position 3 of 9: still behind


def test_unknown_until_every_partition_was_fetched() -> None:
    assert reader({A0: (5, 10_500), A1: (None, None), B0: (0, 1)}, {A0: 5}).caught_up_at(
        "a") == 0.0
    assert reader({A0: (0, 1), A1: (0, 1), B0: (0, 1)}, {}).caught_up_at("c") == 0.0


def test_read_up_to_is_per_partition_credits_an_earlier_fetch_and_only_moves_forward(
) -> None:
    r = reader({A0: (5, 10_500), A1: (7, 10_200), B0: (9, 9_000)}, {A0: 5, A1: 7, B0: 3})
    # A response is stamped when aiokafka processes it, maybe long after the broker built
    # it (a pause in between): the time credited is an earlier response's stamp, before
    # which the response in hand was built (a review: the current stamp let a pause
    # declare live workers dead).
    assert r.read_up_to("a") == {0: 0.0, 1: 0.0}  # one stamp seen: nothing credited yet
    r._consumer.ends = {A0: (5, 10_550), A1: (7, 10_250), B0: (9, 9_050)}  # type: ignore[attr-defined]
    assert r.read_up_to("a") == {0: 10.5, 1: 10.2}
    assert r.read_up_to("b") == {0: 0.0}  # 3 of 9 handled: never read to its end
    # A1's fetches stop (its leader offline: no new stamp) and A0's go on, its newest
    # response not handled yet: A0 holds, then moves once handled; A1 stays; none goes back.
    r._consumer.ends = {A0: (8, 12_000), A1: (7, 10_250), B0: (9, 9_050)}  # type: ignore[attr-defined]
    assert r.read_up_to("a") == {0: 10.5, 1: 10.2}  # A0: 5 of 8 handled
    r._handled[A0] = 8
    assert r.read_up_to("a") == {0: 10.55, 1: 10.2}  # the stamp before 12.0
