"""Fetched batches with a header key that is not UTF-8 (services.common.kafka_records).

Batches are built with aiokafka's own pure-Python builder; a header key whose ``encode``
returns bytes that are not UTF-8 stands for what any other producer may write.
"""

from __future__ import annotations

from typing import Any

import aiokafka.consumer.fetcher as fetcher
import pytest
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy
from aiokafka.record.memory_records import MemoryRecords

import services.common.kafka  # noqa: F401  (installs the tolerant reader)
from services.common.kafka_records import TolerantMemoryRecords

NOT_UTF8 = b"\xff\xfekey"


class _RawKey(str):
    """A header key that encodes to bytes that are not UTF-8."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return NOT_UTF8


def batch(base: int, headers_of: dict[int, list[tuple[str, bytes]]], n: int = 3,
          compression: int = 0) -> bytes:
    builder = _DefaultRecordBatchBuilderPy(magic=2, compression_type=compression,
                                           is_transactional=0, producer_id=-1,
                                           producer_epoch=-1, base_sequence=-1,
                                           batch_size=1 << 20)
    for i in range(n):
        builder.append(i, timestamp=1_700_000_000_000, key=b"k", value=b"v%d" % (base + i),
                       headers=headers_of.get(i, []))
    raw = bytearray(builder.build())
    raw[0:8] = base.to_bytes(8, "big")  # the base offset, as the broker sets it
    return bytes(raw)


def records(data: bytes) -> list[tuple[int, bytes, list[tuple[str, Any]]]]:
    out = []
    memory = TolerantMemoryRecords(data)
    while memory.has_next():
        b = memory.next_batch()
        assert b is not None
        out.extend((r.offset, r.value, list(r.headers)) for r in b)
    return out


def test_aiokafka_alone_fails_on_the_record() -> None:
    """What the module works around (if aiokafka stops raising, it can go)."""
    data = batch(0, {1: [(_RawKey("x"), b"h")]})
    memory = MemoryRecords(data)
    with pytest.raises(UnicodeDecodeError):
        list(memory.next_batch())


@pytest.mark.parametrize("compression", [0, 1])  # none, gzip
def test_every_record_comes_once_in_order_the_bad_key_replaced(compression: int) -> None:
    good = batch(0, {0: [("traceparent", b"00-ab")]}, compression=compression)
    bad = batch(3, {1: [("ok", b"1"), (_RawKey("x"), b"h")]}, compression=compression)
    after = batch(6, {}, compression=compression)
    got = records(good + bad + after)
    assert [(offset, value) for offset, value, _ in got] == \
        [(i, b"v%d" % i) for i in range(9)]
    assert got[0][2] == [("traceparent", b"00-ab")]
    assert got[4][2] == [("ok", b"1"), ("\ufffd\ufffdkey", b"h")]
    assert all(headers == [] for _, _, headers in got[5:])


def test_a_bad_key_on_the_first_record_of_a_batch() -> None:
    got = records(batch(10, {0: [(_RawKey("x"), None)]}))  # type: ignore[list-item]
    assert [(offset, headers) for offset, _, headers in got] == \
        [(10, [("\ufffd\ufffdkey", None)]), (11, []), (12, [])]


def test_the_fetcher_reads_through_it() -> None:
    assert fetcher.MemoryRecords is TolerantMemoryRecords
