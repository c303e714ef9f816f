"""`llmq status`, `drain` and `top` classify workers under the health service's settings
(LLMQ_HEALTH_STALENESS, LLMQ_HEALTH_GONE_AFTER_S), read at the command's entry, so that
they agree with it. The Kafka-reading functions are replaced by recorders of the policy."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

import services.ops.cli as ops_cli
import services.ops.top as ops_top
from services.cli import main
from services.health.core import HealthPolicy

_ENV = {"LLMQ_HEALTH_STALENESS": "7", "LLMQ_HEALTH_GONE_AFTER_S": "300",
        "LLMQ_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
_WANTED = HealthPolicy(staleness=7.0, gone_after_s=300.0)


class Stop(Exception):
    """Raised by the recorders: the command got as far as reading Kafka."""


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[HealthPolicy | None]:
    policies: list[HealthPolicy | None] = []

    async def record(*_args: Any, policy: HealthPolicy | None = None, **_kw: Any) -> Any:
        policies.append(policy)
        raise Stop

    monkeypatch.setattr(ops_cli, "cluster_status", record)
    monkeypatch.setattr(ops_cli, "request_drain", record)
    monkeypatch.setattr(ops_top, "run_top", record)
    return policies


@pytest.mark.parametrize("args", [["status"], ["drain", "w1"], ["top", "--once"]])
def test_the_commands_use_the_health_services_policy(
        args: list[str], seen: list[HealthPolicy | None]) -> None:
    result = CliRunner().invoke(main, args, env=_ENV)
    assert isinstance(result.exception, Stop), result.output
    assert seen == [_WANTED]


@pytest.mark.parametrize("args", [["status"], ["drain", "w1"], ["top", "--once"]])
def test_a_bad_health_setting_is_one_line_naming_it(
        args: list[str], seen: list[HealthPolicy | None]) -> None:
    result = CliRunner().invoke(main, args, env={**_ENV, "LLMQ_HEALTH_STALENESS": "abc"})
    assert result.exit_code == 1 and seen == []
    assert result.output.strip() == (
        "Error: invalid setting: LLMQ_HEALTH_STALENESS='abc': Input should be a valid "
        "number, unable to parse string as a number")
