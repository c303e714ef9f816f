"""The Faust apps' producer is idempotent (DESIGN.md: acks=all, idempotent producer):
faust enables idempotence only inside transactions. No broker: the aiokafka producer it
would start is built and looked at."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.common.faust_app import make_app
from services.common.settings import Settings


async def test_the_apps_producer_is_idempotent_with_acks_all(tmp_path: Path) -> None:
    app = make_app("probe", Settings(home=tmp_path))
    producer = app.producer._new_producer()  # the aiokafka producer faust would start
    try:
        assert producer._txn_manager is not None  # aiokafka's idempotence state
        assert app.producer._settings_extra()["acks"] == "all"
    finally:
        await producer.stop()


def test_the_apps_topics_get_the_replication_factor_of_the_settings(tmp_path: Path) -> None:
    app = make_app("probe", Settings(home=tmp_path, replication_factor=3))
    assert app.conf.topic_replication_factor == 3


async def test_the_apps_producer_must_deliver_llmq_s_own_topics_not_replies(
    tmp_path: Path,
) -> None:
    app = make_app("ingest", Settings(home=tmp_path, topic_prefix="acme"))
    producer = app.producer._new_producer()
    try:
        must = producer._must_deliver
        assert must is not None
        for topic in ("acme.requests.high.short", "acme.intake", "acme.deadletter",
                      "acme-ingest-settle", "acme-ingest-buckets-changelog"):
            assert must(topic), topic
        for topic in ("acme.replies.tenant-a", "acme.replies.ingest-i1", "their.topic",
                      "llmq.requests.high.short"):
            assert not must(topic), topic
    finally:
        await producer.stop()


async def test_the_flush_before_a_commit_waits_for_the_table_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit of the commits: faust's flush gives up on its buffer of table
    writes after 0.1 s (ProducerBuffer.flush_atmost), and the commit that follows could
    pass the record of a reservation the broker never got. Faust's own buffer and flush
    are stood in for here: a write handed over but not yet acknowledged."""
    from faust.transport.drivers.aiokafka import Producer

    handed: list[Any] = []
    monkeypatch.setattr(Producer, "send_soon", lambda self, fut: handed.append(fut))

    async def faust_flush(self: Any) -> None:  # returns with the write still in flight
        return None

    monkeypatch.setattr(Producer, "flush", faust_flush)
    producer = make_app("probe", Settings(home=tmp_path)).producer
    write = asyncio.get_running_loop().create_future()
    producer.send_soon(write)
    assert handed == [write]
    flush = asyncio.create_task(producer.flush())
    await asyncio.sleep(0.05)
    assert not flush.done()  # the commit waits
    write.set_result("acknowledged")
    await asyncio.wait_for(flush, 1.0)
    await asyncio.wait_for(producer.flush(), 1.0)  # nothing left: at once


async def test_a_table_write_that_can_never_complete_ends_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a review of the wait above: a write whose send raised dies with faust's
    buffer task, never resolved, and the flush (a commit, a stop) waited for ever, holding
    the partitions. The process ends instead, nothing committed."""
    from types import SimpleNamespace

    from faust.transport.drivers.aiokafka import Producer

    import services.common.faust_app as faust_app

    monkeypatch.setattr(Producer, "send_soon", lambda self, fut: None)

    async def faust_flush(self: Any) -> None:
        return None

    monkeypatch.setattr(Producer, "flush", faust_flush)
    monkeypatch.setattr(faust_app, "_TABLE_WRITE_POLL_S", 0.01)
    ended: list[str] = []

    class _Exited(Exception):
        """What os._exit would do: nothing after it runs."""

    def exit_now(exc: Exception) -> None:
        ended.append(str(exc))
        raise _Exited

    monkeypatch.setattr(faust_app, "exit_now", exit_now)
    producer = make_app("probe", Settings(home=tmp_path)).producer
    producer.buffer = SimpleNamespace(state="crashed")  # its task died with the write
    producer.send_soon(asyncio.get_running_loop().create_future())
    with pytest.raises(_Exited):
        await asyncio.wait_for(producer.flush(), 1.0)
    assert ended and "crashed" in ended[0]


async def test_the_flush_waits_only_for_the_writes_made_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a review: the flush waited for every write, also those made while it
    waited (later records', for a later commit), and counted a second for each round: a
    healthy ingest clearing a backlog was ended after 6 s."""
    from faust.transport.drivers.aiokafka import Producer

    monkeypatch.setattr(Producer, "send_soon", lambda self, fut: None)

    async def faust_flush(self: Any) -> None:
        return None

    monkeypatch.setattr(Producer, "flush", faust_flush)
    producer = make_app("probe", Settings(home=tmp_path)).producer
    loop = asyncio.get_running_loop()
    owed = loop.create_future()
    producer.send_soon(owed)
    flush = asyncio.create_task(producer.flush())
    await asyncio.sleep(0.01)
    later = loop.create_future()
    producer.send_soon(later)  # a later record's, while the commit waits
    owed.set_result("acknowledged")
    await asyncio.wait_for(flush, 1.0)  # later is still in flight: not this commit's
    assert not later.done()
