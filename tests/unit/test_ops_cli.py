"""The click commands when Kafka is down: one clear line, exit 1 (no broker needed)."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from services.common.settings import Settings
from services.ops.cli import drain, status


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens here once the socket is closed


@pytest.fixture
def no_kafka() -> Settings:
    return Settings(kafka_bootstrap=f"127.0.0.1:{_closed_port()}", topic_prefix="nokafka")


@pytest.mark.timeout(30)
def test_status_without_kafka(no_kafka: Settings) -> None:
    result = CliRunner().invoke(status, ["--json"], obj=no_kafka)
    assert result.exit_code == 1
    assert "error: no Kafka broker answers at 127.0.0.1:" in result.output


@pytest.mark.timeout(30)
def test_drain_without_kafka(no_kafka: Settings) -> None:
    result = CliRunner().invoke(drain, ["w1", "--no-wait"], obj=no_kafka)
    assert result.exit_code == 1
    assert "error: no Kafka broker answers" in result.output


def test_help_names_the_options() -> None:
    assert "--group" in CliRunner().invoke(status, ["--help"]).output
    out = CliRunner().invoke(drain, ["--help"]).output
    for option in ("--wait / --no-wait", "--timeout", "--reason", "--json"):
        assert option in out
