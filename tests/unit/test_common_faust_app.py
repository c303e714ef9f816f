"""The Faust apps' producer is idempotent (DESIGN.md: acks=all, idempotent producer):
faust enables idempotence only inside transactions. No broker: the aiokafka producer it
would start is built and looked at."""

from __future__ import annotations

from pathlib import Path

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
