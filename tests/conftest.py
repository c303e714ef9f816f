"""Shared fixtures. Kafka tests use the real broker that `make test` starts."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.common.kafka import broker_answers
from services.common.settings import Settings


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


@pytest.fixture
def topic_prefix() -> str:
    """A unique topic prefix per test, so tests never see each other's messages."""
    return f"t{uuid.uuid4().hex[:10]}"
