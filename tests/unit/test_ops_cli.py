"""The click commands when Kafka is down: one clear line, exit 1 (no broker needed)."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from services.cli import main, operator_error
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


# -- the root group: an error the operator can fix is one line, not a traceback ---------
@pytest.mark.parametrize(("env", "named"), [
    ({"LLMQ_KAFKA_PORT": "abc"}, "LLMQ_KAFKA_PORT='abc'"),
    ({"LLMQ_KAFKA_BOOTSTRAP": "localhost:abc"}, "'localhost:abc' is not host:port"),
    # the topic catalog's rule: a prefix it would refuse is refused here, named
    ({"LLMQ_TOPIC_PREFIX": "llmq."}, "LLMQ_TOPIC_PREFIX='llmq.'"),
    ({"LLMQ_TOPIC_PREFIX": "a..b"}, "LLMQ_TOPIC_PREFIX='a..b'"),
])
def test_a_bad_setting_is_named_by_its_variable(env: dict[str, str], named: str) -> None:
    result = CliRunner().invoke(main, ["status"], env=env)
    assert result.exit_code == 1
    assert "invalid setting" in result.output and named in result.output
    assert "Traceback" not in result.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["submit", "hi", "--timeout", "5"], ["dev", "topics"]])
def test_kafka_down_says_how_to_start_it(args: list[str]) -> None:
    result = CliRunner().invoke(
        main, args, env={"LLMQ_KAFKA_BOOTSTRAP": f"127.0.0.1:{_closed_port()}"})
    assert result.exit_code == 1, result.output
    assert "did not answer" in result.output and "llmq dev kafka up" in result.output


def test_bad_input_is_refused_before_anything_runs() -> None:
    runner = CliRunner()
    assert runner.invoke(main, ["demo", "--requests", "1"]).exit_code == 2
    assert runner.invoke(main, ["demo", "--rate", "0"]).exit_code == 2
    assert runner.invoke(main, ["submit", "hi", "--timeout", "0"]).exit_code == 2
    refused = runner.invoke(main, ["submit", "hi", "--tenant", "bad tenant"],
                            env={"LLMQ_KAFKA_BOOTSTRAP": f"127.0.0.1:{_closed_port()}"})
    assert refused.exit_code == 1 and "invalid input: invalid tenant" in refused.output


def test_a_bug_keeps_its_traceback() -> None:
    assert operator_error(KeyError("x"), None) is None
    assert operator_error(ValueError("bad"), None) == "invalid input: bad"


def test_up_with_prefill_workers_runs_no_lane_pool_workers_unless_asked() -> None:
    from services.cli import lane_workers

    assert lane_workers(0, 2, 1, set()) == (2, 1)  # no split: the defaults
    assert lane_workers(1, 2, 1, set()) == (0, 0)  # a split: nothing beside it
    assert lane_workers(1, 2, 3, {"long_workers"}) == (0, 3)  # ... unless asked for


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), 0.0, -5.0])
async def test_request_drain_refuses_a_timeout_it_could_not_keep(timeout_s: float) -> None:
    from services.ops.drain import request_drain

    # Refused before the broker is asked anything (nothing listens on port 1 anyway).
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        await request_drain("127.0.0.1:1", "nokafka", "w1", "", True, timeout_s)
