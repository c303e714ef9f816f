"""Outbox: batched sends, ``then`` after ``first``, tickets once durable, resends.

``FakeBroker`` stands in for an aiokafka producer: ``send`` enqueues and returns a delivery
future the test resolves (or fails, or leaves hanging).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from services.scheduler.runtime.messages import Outgoing
from services.scheduler.runtime.outbox import Outbox
from services.scheduler.runtime.results import Effect


class FakeBroker:
    """Acknowledges everything, except topics told to fail or to hang."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.failing: set[str] = set()
        self.hanging: set[str] = set()

    async def send(self, out: Outgoing) -> Awaitable[object]:
        self.sent.append(out.topic)
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if out.topic in self.failing:
            future.set_exception(RuntimeError("broker says no"))
        elif out.topic not in self.hanging:
            future.set_result(None)
        return future


def rec(topic: str) -> Outgoing:
    return Outgoing(topic, b"k", b"v")


async def test_tickets_come_back_once_every_stage_is_acknowledged() -> None:
    broker = FakeBroker()
    outbox = Outbox(broker.send, timeout_s=1.0)
    outbox.submit([
        Effect(first=(rec("assignments"),), tickets=(("tp", 1),)),
        Effect(first=(rec("reply"),), then=(rec("events"),), tickets=(("tp", 2),)),
        Effect(tickets=(("tp", 3),)),  # nothing to send: done at the next flush
    ])
    assert sorted(await outbox.flush()) == [("tp", 1), ("tp", 2), ("tp", 3)]
    assert broker.sent == ["assignments", "reply", "events"]  # the event after its reply
    assert len(outbox) == 0


async def test_then_waits_for_first_and_failures_are_resent() -> None:
    broker = FakeBroker()
    outbox = Outbox(broker.send, timeout_s=1.0, backoff_s=0.0)
    broker.failing.add("reply")
    outbox.submit([Effect(first=(rec("reply"),), then=(rec("events"),), tickets=(("tp", 0),))])
    assert await outbox.flush() == []
    assert broker.sent == ["reply"] and outbox.failures == 1  # no event before the reply
    broker.failing.clear()
    assert await outbox.flush() == [("tp", 0)]
    assert broker.sent == ["reply", "reply", "events"]


async def test_an_unacknowledged_send_times_out_and_is_retried_after_a_backoff() -> None:
    broker = FakeBroker()
    now = [0.0]
    outbox = Outbox(broker.send, timeout_s=0.05, backoff_s=1.0, clock=lambda: now[0])
    broker.hanging.add("assignments")
    outbox.submit([Effect(first=(rec("assignments"),), tickets=(("tp", 0),))])
    assert await outbox.flush() == []
    assert await outbox.flush() == [] and broker.sent == ["assignments"]  # backing off
    broker.hanging.clear()
    now[0] = 1.5
    assert await outbox.flush() == [("tp", 0)]
    assert broker.sent == ["assignments", "assignments"]
    assert outbox.topics() == set()


async def test_topics_lists_what_is_due() -> None:
    outbox = Outbox(FakeBroker().send)
    outbox.submit([Effect(first=(rec("a"),), then=(rec("b"),)), Effect(then=(rec("c"),))])
    assert outbox.topics() == {"a", "c"}


class ValueBroker(FakeBroker):
    """A ``FakeBroker`` that also keeps the value of each record it acknowledged."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[bytes] = []

    async def send(self, out: Outgoing) -> Awaitable[object]:
        if out.topic not in self.failing:
            self.values.append(out.value)
        return await super().send(out)


async def test_a_newer_keyed_effect_replaces_the_one_still_waiting() -> None:
    # A status snapshot each second through a broker outage: one waits, not one per second.
    broker = ValueBroker()
    outbox = Outbox(broker.send, timeout_s=0.05, backoff_s=0.0)
    broker.failing.add("status")
    outbox.submit([Effect(first=(rec("reply"),), tickets=(("tp", 0),))])
    for n in range(50):
        outbox.submit([Effect(first=(Outgoing("status", b"m", str(n).encode()),))],
                      key="status")
        await outbox.flush()
    assert len(outbox) == 1  # the reply went; one status waits
    broker.failing.clear()
    await outbox.flush()
    assert broker.values == [b"v", b"49"] and len(outbox) == 0  # the newest status only


class StalledBroker:
    """``send`` itself never returns (aiokafka waiting for metadata of an unreachable
    cluster)."""

    def __init__(self) -> None:
        self.tries = 0

    async def send(self, out: Outgoing) -> Awaitable[object]:
        self.tries += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_one_flush_round_is_bounded_by_one_timeout_however_many_records_wait() -> None:
    broker = StalledBroker()
    outbox = Outbox(broker.send, timeout_s=0.1, backoff_s=0.0)
    outbox.submit([Effect(first=(rec(f"reply{i}"),), tickets=(("tp", i),))
                   for i in range(20)])
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await outbox.flush() == []
    assert loop.time() - started < 0.5  # was 20 × 0.1 s
    assert len(outbox) == 20  # every one waits for the next flush
    assert broker.tries == 1 and outbox.failures == 1  # the rest had no time: untouched
