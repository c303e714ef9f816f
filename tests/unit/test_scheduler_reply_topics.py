"""Reply topics made on first use, in the background (``runtime.topics.ReplyTopics``).

``ensure`` stands in for ``services.common.kafka.ensure_topics`` (its real calls against a
broker are in tests/integration/test_scheduler_service.py).
"""

from __future__ import annotations

import asyncio

from services.common.kafka import TopicRequest
from services.scheduler.runtime.topics import ReplyTopics, SchedulerTopics

TOPICS = SchedulerTopics.of("llmq")


class Maker:
    """Makes topics when told to; refuses them while ``refusing``."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.refusing = False
        self.woken = 0

    async def ensure(self, request: TopicRequest) -> None:
        await asyncio.sleep(0)
        if self.refusing:
            raise RuntimeError("broker says no")
        self.made.append(request.name)

    def wake(self) -> None:
        self.woken += 1


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_new_reply_topic_is_held_until_made_and_the_cycle_is_woken() -> None:
    maker, now = Maker(), [0.0]
    topics = ReplyTopics(TOPICS, maker.ensure, maker.wake, clock=lambda: now[0])
    wanted = {"llmq.replies.acme", TOPICS.assignments}
    assert topics.held(wanted) == {"llmq.replies.acme"}  # llmq's own exist from the start
    assert topics.held(wanted) == {"llmq.replies.acme"}  # one creation in flight, not two
    await settle()
    assert maker.made == ["llmq.replies.acme"] and maker.woken == 1
    assert topics.held(wanted) == set()


async def test_a_failed_creation_is_tried_again_after_a_growing_wait() -> None:
    maker, now = Maker(), [0.0]
    topics = ReplyTopics(TOPICS, maker.ensure, maker.wake, backoff_s=1.0, clock=lambda: now[0])
    maker.refusing = True
    topics.held({"llmq.replies.acme"})
    await settle()
    now[0] = 0.5
    topics.held({"llmq.replies.acme"})  # too soon: no new try
    await settle()
    now[0] = 1.0
    topics.held({"llmq.replies.acme"})  # tried again at 1 s, fails: next at 3 s
    await settle()
    maker.refusing = False
    now[0] = 2.9
    assert topics.held({"llmq.replies.acme"}) == {"llmq.replies.acme"}
    await settle()
    assert maker.made == []
    now[0] = 3.0
    topics.held({"llmq.replies.acme"})
    await settle()
    assert maker.made == ["llmq.replies.acme"]
    assert topics.held({"llmq.replies.acme"}) == set()


async def test_a_topic_a_record_failed_on_is_checked_again_but_never_llmq_s_own() -> None:
    maker = Maker()
    topics = ReplyTopics(TOPICS, maker.ensure, maker.wake)
    topics.held({"llmq.replies.acme"})
    await settle()
    topics.recheck({"llmq.replies.acme", TOPICS.assignments})
    assert topics.held({"llmq.replies.acme", TOPICS.assignments}) == {"llmq.replies.acme"}
    await settle()
    assert maker.made == ["llmq.replies.acme", "llmq.replies.acme"]


async def test_a_name_outside_llmq_s_prefix_is_someone_else_s_to_make() -> None:
    maker = Maker()
    topics = ReplyTopics(TOPICS, maker.ensure, maker.wake)
    assert topics.held({"other.replies"}) == set()
    await settle()
    assert maker.made == []


async def test_stop_cancels_creations_in_flight() -> None:
    started = asyncio.Event()

    async def hang(request: TopicRequest) -> None:
        started.set()
        await asyncio.Event().wait()

    topics = ReplyTopics(TOPICS, hang, lambda: None)
    topics.held({"llmq.replies.acme"})
    await started.wait()
    await asyncio.wait_for(topics.stop(), 1.0)
