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
