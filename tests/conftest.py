"""Shared fixtures. Kafka tests use the real broker that `make test` starts."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import pytest

from services.common.kafka import broker_answers
from services.common.settings import Settings
from tests.prefixes import is_ours, unique_prefix


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings()


@pytest.fixture(scope="session")
def bootstrap(settings: Settings) -> str:
    """The real broker's address; fails loudly (not a skip) when none answers."""
    if not asyncio.run(broker_answers(settings.bootstrap, 5.0)):
        pytest.fail(
            f"no Kafka broker answers on {settings.bootstrap}: run `make test`, or start one "
            "with `.venv/bin/llmq dev kafka up`"
        )
    return settings.bootstrap


async def _delete_topics(
    bootstrap: str, keep: set[str] | None, prefix: str | None, *, only_ours: bool = False
) -> None:
    """Delete the topics a test (or the session) created, so the broker stays small."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=30_000)
    await admin.start()
    try:
        names = [
            t for t in await admin.list_topics()
            if not t.startswith("__")
            and (prefix is None or t.startswith(prefix))
            and (keep is None or t not in keep)
            and (not only_ours or is_ours(t))
        ]
        for i in range(0, len(names), 200):
            await admin.delete_topics(names[i : i + 200], timeout_ms=30_000)
    finally:
        await admin.close()


async def _topic_names(bootstrap: str) -> set[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


@pytest.fixture(scope="session", autouse=True)
def _clean_topics_after_session(settings: Settings) -> Iterator[None]:
    """Every topic the test session created under its prefixes (tests/prefixes.py) is
    deleted at its end: thousands of partitions left behind would exhaust a small broker
    heap. Topics of another session on the same broker are left alone."""
    if not asyncio.run(broker_answers(settings.bootstrap, 3.0)):
        yield
        return
    before = asyncio.run(_topic_names(settings.bootstrap))
    yield
    asyncio.run(_delete_topics(settings.bootstrap, keep=before, prefix=None, only_ours=True))


@pytest.fixture
def topic_prefix(settings: Settings) -> Iterator[str]:
    """A unique topic prefix per test, so tests never see each other's messages; the
    test's topics are deleted afterwards, and so are the Faust data dirs of its apps
    (``<home>/faust/<prefix>-<app>``: one per app and test, they added up to hundreds)."""
    prefix = unique_prefix("t")
    yield prefix
    for data_dir in (settings.home / "faust").glob(f"{prefix}-*"):
        shutil.rmtree(data_dir, ignore_errors=True)
    if asyncio.run(broker_answers(settings.bootstrap, 3.0)):
        asyncio.run(_delete_topics(settings.bootstrap, keep=None, prefix=prefix + "."))
