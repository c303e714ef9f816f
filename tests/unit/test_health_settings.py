"""Health settings: env names, Consul address parsing, loopback-only binding."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.health.settings import (
    BIND_HOST,
    ConsulAddress,
    HealthSettings,
    parse_consul_addr,
)


@pytest.mark.parametrize(
    ("addr", "parsed"),
    [
        ("127.0.0.1:8500", ConsulAddress("127.0.0.1", 8500)),
        ("consul.local", ConsulAddress("consul.local", 8500)),
        ("http://127.0.0.1:18500", ConsulAddress("127.0.0.1", 18500)),
        ("https://c.example:8501", ConsulAddress("c.example", 8501, "https")),
    ],
)
def test_parse_consul_addr(addr: str, parsed: ConsulAddress) -> None:
    assert parse_consul_addr(addr) == parsed


@pytest.mark.parametrize("addr", ["ftp://x:1", "http://", ":8500"])
def test_bad_consul_addr(addr: str) -> None:
    with pytest.raises(ValueError, match="Consul address"):
        parse_consul_addr(addr)


def test_env_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMQ_HEALTH_PORT", "9123")
    monkeypatch.setenv("LLMQ_CONSUL_ADDR", "127.0.0.1:8600")
    monkeypatch.setenv("LLMQ_METRICS_PORT", "9124")
    hs = HealthSettings()
    assert (hs.port, hs.metrics_port) == (9123, 9124)
    assert hs.consul() == ConsulAddress("127.0.0.1", 8600)
    assert hs.resolved_instance_id().endswith("-9123")


def test_defaults_run_without_consul(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LLMQ_HEALTH_PORT", "LLMQ_CONSUL_ADDR", "LLMQ_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)
    hs = HealthSettings()
    assert hs.port == 8081 and hs.consul() is None and hs.metrics_port is None
    assert BIND_HOST == "127.0.0.1"
    assert hs.policy().staleness == 3.0


def test_invalid_consul_addr_is_a_config_error() -> None:
    with pytest.raises(ValidationError):
        HealthSettings(consul_addr="ftp://x")
