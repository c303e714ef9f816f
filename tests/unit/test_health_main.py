"""``python -m services.health`` refuses bad configuration in one line naming the flag or
variable, exit 2, before it binds or reads anything."""

from __future__ import annotations

import pytest

from services.health.__main__ import main


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LLMQ_HEALTH_PORT", "LLMQ_CONSUL_ADDR", "LLMQ_HEALTH_CONSUL_ADDR",
                 "LLMQ_METRICS_PORT", "LLMQ_HEALTH_STALENESS", "LLMQ_KAFKA_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--port", "99999"], {}, "--port=99999: Input should be less than or equal to 65535"),
        (["--consul-addr", "ftp://x"], {}, "--consul-addr='ftp://x'"),
        ([], {"LLMQ_HEALTH_STALENESS": "abc"}, "LLMQ_HEALTH_STALENESS='abc'"),
        ([], {"LLMQ_CONSUL_ADDR": "ftp://x"}, "LLMQ_CONSUL_ADDR='ftp://x': Value error, "
                                              "not a Consul address"),
        ([], {"LLMQ_METRICS_PORT": "0"}, "LLMQ_METRICS_PORT='0'"),
        ([], {"LLMQ_KAFKA_PORT": "abc"}, "LLMQ_KAFKA_PORT='abc'"),
    ],
)
def test_bad_configuration_is_one_line_naming_it(
    argv: list[str], env: dict[str, str], named: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert line.startswith("health: invalid configuration: ") and named in line
    assert "pydantic" not in line


def test_a_malformed_flag_is_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--port", "abc"])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "argument --port: invalid int value: 'abc'" in line


def test_help_names_the_log_level_setting_the_port_range_and_the_exit_status(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # as wrapped for any terminal width
    assert "LLMQ_HEALTH_LOG_LEVEL" in out and "1-65535" in out and "2 on bad" in out
