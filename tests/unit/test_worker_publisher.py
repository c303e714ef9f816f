"""Publisher.acked: every delivery future acknowledged, or False — never an exception."""

from __future__ import annotations

import asyncio

from aiokafka.errors import KafkaTimeoutError

from services.worker.kafka_io import Publisher


def _future(result: object = None, exc: BaseException | None = None,
            cancelled: bool = False, pending: bool = False) -> asyncio.Future[object]:
    future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    if cancelled:
        future.cancel()
    elif exc is not None:
        future.set_exception(exc)
    elif not pending:
        future.set_result(result)
    return future


async def test_all_acknowledged() -> None:
    publisher = Publisher(producer=None, timeout_s=1.0)
    assert await publisher.acked([]) is True
    assert await publisher.acked([_future("a"), _future("b")]) is True


async def test_a_failed_cancelled_or_late_delivery_is_not_an_ack() -> None:
    publisher = Publisher(producer=None, timeout_s=0.05)
    assert await publisher.acked([_future(), _future(exc=KafkaTimeoutError())]) is False
    assert await publisher.acked([_future(), _future(exc=RuntimeError("bug"))]) is False
    assert await publisher.acked([_future(cancelled=True)]) is False
    late = _future(pending=True)
    assert await publisher.acked([_future(), late]) is False
    assert not late.done()  # still the producer's: it may yet be delivered
