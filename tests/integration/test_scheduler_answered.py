"""``services.scheduler.runtime.answered`` against the real broker: which lost attempts
already have a terminal reply on their reply partition, among other requests' replies."""

from __future__ import annotations

import time

import pytest

from schemas.codec import encode
from services.common.kafka import TopicRequest, ensure_topics, make_producer
from services.scheduler.runtime.answered import CLOCK_MARGIN_S, answered
from tests.builders_schemas import make_chunk, make_done, make_error

pytestmark = pytest.mark.kafka


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
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        for key, reply in records:
            await producer.send(topic, encode(reply), key=key.encode(), partition=0)
        await producer.flush()
    finally:
        await producer.stop()

    def wanted(rid: str, attempt: int, assigned_at: float = now) -> tuple[
            tuple[str, int], tuple[str, bytes, float]]:
        return (rid, attempt), (topic, rid.encode(), assigned_at)

    found = await answered(bootstrap, dict([
        wanted("done-1", 1), wanted("err-2", 2), wanted("old-attempt", 2),
        wanted("chunk-only", 1), wanted("misfiled", 1), wanted("never-seen", 1),
    ]), timeout_s=30)
    assert found == {("done-1", 1), ("err-2", 2)}

    # Read from the assignment time less the clock margin: a reply written before it
    # is not this attempt's.
    later = now + CLOCK_MARGIN_S + 60
    assert await answered(bootstrap, dict([wanted("done-1", 1, later)]), timeout_s=30) == set()
