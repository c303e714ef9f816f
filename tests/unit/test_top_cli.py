"""``llmq top`` without a broker and its options (no Kafka needed): Kafka down is one clear
line and exit 1, whatever the metrics endpoints say; a malformed endpoint URL is that
endpoint's error."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from services.common.settings import Settings
from services.ops.status import services_file
from services.ops.top import scrape_round, top


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens here once the socket is closed


@pytest.fixture
def no_kafka(tmp_path: Path) -> Settings:
    return Settings(kafka_bootstrap=f"127.0.0.1:{_closed_port()}", topic_prefix="nokafka",
                    home=tmp_path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args", [["--once", "--json"], ["--once"], []])
def test_kafka_down_is_one_line_and_exit_1(no_kafka: Settings, args: list[str]) -> None:
    path = services_file(no_kafka.home)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"scheduler": {"pid": 1, "metrics_url":
                                              f"http://127.0.0.1:{_closed_port()}/metrics"}}))
    result = CliRunner().invoke(top, args, obj=no_kafka)
    assert result.exit_code == 1, result.output
    assert f"error: no Kafka broker answers at {no_kafka.bootstrap}" in result.output
    assert "Traceback" not in result.output


def test_json_needs_once() -> None:
    result = CliRunner().invoke(top, ["--json"])
    assert result.exit_code == 2
    assert "--json needs --once" in result.output


def test_interval_is_bounded() -> None:
    assert CliRunner().invoke(top, ["--once", "--interval", "0"]).exit_code == 2


def test_help_names_the_options() -> None:
    out = CliRunner().invoke(top, ["--help"]).output
    for option in ("--interval", "--once", "--json", "--group"):
        assert option in out


async def test_a_malformed_metrics_url_is_that_endpoints_error() -> None:
    metrics = httpx.MockTransport(lambda _: httpx.Response(200, text="up 1\n"))
    urls = {"scheduler": "http://127.0.0.1:9400/metrics", "bad": "http://[::1/metrics"}
    async with httpx.AsyncClient(transport=metrics) as client:
        round_ = await scrape_round(client, urls, clock=lambda: 1.0)
    assert set(round_.scrapes) == {"scheduler"}
    errors = {ep.name: ep.error for ep in round_.endpoints}
    assert errors["scheduler"] is None
    assert errors["bad"] is not None and errors["bad"].startswith("bad URL (")
