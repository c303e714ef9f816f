"""Ingest settings: env names (including the ones `llmq up` sets), flags override env."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.topics import INSTANCE_REPLIES, reply_topic
from services.ingest.settings import IngestSettings


def test_env_names_and_flag_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMQ_HTTP_PORT", "9001")
    monkeypatch.setenv("LLMQ_TENANTS_FILE", "/etc/llmq/tenants.toml")
    monkeypatch.setenv("LLMQ_INGEST_APP_NAME", "ingest-b")
    settings = IngestSettings()
    assert settings.http_port == 9001 and settings.app_name == "ingest-b"
    assert settings.tenants_file == Path("/etc/llmq/tenants.toml")
    assert IngestSettings(http_port=9002, tenants_file=None).http_port == 9002
    monkeypatch.setenv("LLMQ_INGEST_HTTP_PORT", "9003")
    assert IngestSettings().http_port == 9003


def test_defaults_are_local(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LLMQ_HTTP_PORT", "LLMQ_INGEST_HTTP_PORT", "LLMQ_TENANTS_FILE"):
        monkeypatch.delenv(name, raising=False)
    settings = IngestSettings()
    assert (settings.http_host, settings.http_port, settings.tenants_file) == (
        "127.0.0.1", 8080, None,
    )


def test_default_instance_id_makes_a_valid_reply_topic() -> None:
    instance = IngestSettings(http_port=8123).resolved_instance_id()
    assert instance.endswith("-8123")
    assert reply_topic("llmq", INSTANCE_REPLIES + instance).startswith("llmq.replies.ingest-")
    assert IngestSettings(instance_id="a1").resolved_instance_id() == "a1"
