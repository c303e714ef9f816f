"""Fetched records that aiokafka cannot decode: a header key that is not UTF-8.

Kafka header keys are strings, but the broker does not check them: any producer may write
arbitrary bytes there. aiokafka decodes every key as strict UTF-8 while it unpacks a fetched
batch, so one such record makes ``getmany`` raise ``UnicodeDecodeError`` — at the same
position on every retry — and takes with it the records of other partitions drained in the
same call (their positions have already moved on: they are lost to this consumer). Faust's
fetcher crashes on it, so one record on ``llmq.intake`` stopped ingest, and, never
committed past, stopped it again after every restart.

:func:`install` (called when ``services.common.kafka`` is imported, so by every service and
client) makes aiokafka's fetcher wrap each fetched batch: records are read with aiokafka's
own (C) parser as before; only when that raises ``UnicodeDecodeError`` is the batch read
again with aiokafka's pure-Python parser, header keys decoded with U+FFFD for the bytes that
are not UTF-8, and the records not yet returned are returned from there. Nothing is lost and
nothing is skipped: the record goes on to its consumer, which validates its value as usual
(header keys it does not know it ignores). A warning names the record.

Written against aiokafka 0.12–0.14 (``aiokafka.consumer.fetcher.MemoryRecords`` and the
private ``_DefaultRecordBatchPy``); ``tests/unit/test_common_kafka_records.py`` fails if a
new aiokafka changes either.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from typing import Any, SupportsIndex

import aiokafka.consumer.fetcher as _fetcher
from aiokafka.record.default_records import _DefaultRecordBatchPy
from aiokafka.record.memory_records import MemoryRecords

log = logging.getLogger(__name__)

#: Each batch in a fetched record set starts with its base offset (int64) and its length
#: (int32, the bytes after these 12).
_LOG_ENTRY = struct.Struct(">qi")


class _ReplacingBuffer(bytearray):
    """A record buffer whose slices decode with U+FFFD for bytes that are not UTF-8."""

    def __getitem__(self, key: SupportsIndex | slice) -> Any:
        item = super().__getitem__(key)
        return _ReplacingBuffer(item) if isinstance(key, slice) else item

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytearray.decode(self, encoding, "replace")


class _Batch:
    """One fetched batch: aiokafka's, plus a second reading when a header key is bad."""

    def __init__(self, batch: Any, raw: memoryview) -> None:
        self._batch = batch
        self._raw = raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def __next__(self) -> Any:  # aiokafka reads a control batch's marker with next()
        return next(self._batch)

    def __iter__(self) -> Iterator[Any]:
        last = -1
        try:
            for record in self._batch:
                last = record.offset
                yield record
        except UnicodeDecodeError:
            yield from self._reread(last)

    def _reread(self, last: int) -> Iterator[Any]:
        batch = _DefaultRecordBatchPy(self._raw)  # magic 2: older formats have no headers
        iter(batch)  # decompresses
        batch._buffer = _ReplacingBuffer(batch._buffer)
        for record in batch:
            if record.offset <= last:
                continue
            if any("\ufffd" in key for key, _ in record.headers):
                log.warning("record at offset %d has a header key that is not UTF-8; read "
                            "with U+FFFD in its place", record.offset)
            yield record


class TolerantMemoryRecords:
    """aiokafka's ``MemoryRecords`` over one fetched record set, batches as :class:`_Batch`."""

    def __init__(self, data: bytes) -> None:
        self._records = MemoryRecords(data)
        self._raw = memoryview(data)
        self._pos = 0

    def size_in_bytes(self) -> int:
        return int(self._records.size_in_bytes())

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> _Batch | None:
        batch = self._records.next_batch()
        if batch is None:
            return None
        _, length = _LOG_ENTRY.unpack_from(self._raw, self._pos)
        end = self._pos + _LOG_ENTRY.size + length
        raw, self._pos = self._raw[self._pos:end], end
        return _Batch(batch, raw)


def install() -> None:
    """Make aiokafka's fetcher read every fetched record set through
    :class:`TolerantMemoryRecords` (idempotent)."""
    _fetcher.MemoryRecords = TolerantMemoryRecords
