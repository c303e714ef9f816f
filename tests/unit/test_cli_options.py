"""Every number an ``llmq`` command takes is range-checked by click: nan, inf and negatives
are usage errors (exit 2) before anything is sent or started. No broker needed: the
commands run against a port nothing listens on, where a value let through would fail
later with exit 1 instead."""

from __future__ import annotations

import fcntl
import socket
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from services.cli import main
from services.ops.params import FiniteFloatRange


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens here once the socket is closed


def _options(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[
        tuple[str, click.Parameter]]:
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _options(cmd, (*path, name))
            continue
        for param in cmd.params:
            yield " ".join((*path, name, param.opts[0])), param


FLOAT_OPTIONS = [(n, p) for n, p in _options(main)
                 if isinstance(p.type, click.types.FloatParamType)]
INT_OPTIONS = [(n, p) for n, p in _options(main)
               if isinstance(p.type, click.types.IntParamType) and p.name != "seed"]


def _cases() -> Iterator[object]:
    for name, param in FLOAT_OPTIONS:
        for bad in ("nan", "inf", "-inf", "-1"):
            yield pytest.param(param, bad, id=f"{name} {bad}")


@pytest.mark.parametrize(("param", "bad"), list(_cases()))
def test_every_float_option_refuses_nan_inf_and_negatives(param: click.Parameter,
                                                          bad: str) -> None:
    with pytest.raises(click.BadParameter):
        param.type.convert(bad, param, None)


@pytest.mark.parametrize("param", [pytest.param(p, id=n) for n, p in INT_OPTIONS])
def test_every_count_and_port_refuses_negatives(param: click.Parameter) -> None:
    with pytest.raises(click.BadParameter):
        param.type.convert("-1", param, None)


@pytest.mark.parametrize(("name", "bad"), [
    ("demo --max-prompt", "0"), ("demo --max-output", "0"),
    ("bench decide --workers", "0"), ("bench decide --pending", "0"),
    ("bench decide --repeats", "0"),
    ("up --http-port", "0"), ("up --http-port", "70000"), ("up --health-port", "65536"),
    ("up --metrics-base-port", "0"),
    ("drain --timeout", "0"), ("submit --timeout", "0"), ("dev kafka ping --timeout", "0"),
    ("top --interval", "1e9"), ("demo --rate", "1e9"),
])
def test_zero_and_out_of_range_values_are_refused(name: str, bad: str) -> None:
    param = dict(_options(main))[name]
    with pytest.raises(click.BadParameter):
        param.type.convert(bad, param, None)


def test_a_finite_range_takes_ordinary_numbers() -> None:
    assert FiniteFloatRange(0, 10, min_open=True).convert("2.5", None, None) == 2.5


# -- end to end: refused with exit 2 before Kafka is asked anything ----------------------
@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"LLMQ_KAFKA_BOOTSTRAP": f"127.0.0.1:{_closed_port()}",
            "LLMQ_HOME": str(tmp_path / "home")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [
    ["drain", "w1", "--timeout", "nan"], ["drain", "w1", "--timeout", "-5"],
    ["drain", "w1", "--timeout", "0"], ["top", "--once", "--interval", "inf"],
    ["dev", "kafka", "ping", "--timeout", "nan"], ["submit", "hi", "--timeout", "nan"],
])
def test_bad_numbers_are_usage_errors(args: list[str], env: dict[str, str]) -> None:
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--" in result.output


@pytest.mark.timeout(60)
def test_a_reason_over_the_wire_limit_is_refused_up_front(env: dict[str, str]) -> None:
    result = CliRunner().invoke(main, ["drain", "w1", "--reason", "x" * 4097], env=env)
    assert result.exit_code == 2, result.output
    assert "--reason" in result.output and "at most 4096 characters" in result.output
    assert "Traceback" not in result.output and "pydantic" not in result.output
    assert "4096" in CliRunner().invoke(main, ["drain", "--help"]).output


def test_drain_help_names_every_outcome_and_its_exit_status() -> None:
    out = " ".join(CliRunner().invoke(main, ["drain", "--help"]).output.split())
    assert "already gone (nothing is sent)" in out
    assert "lost: the worker stopped, or went silent (stale), without a clean drain" in out
    assert "the wait timed out" in out and "2 a bad option" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "named"), [
    (["--http-port", "0"], "--http-port"),
    (["--http-port", "70000"], "--http-port"),
    (["--metrics-base-port", "65531"], "--metrics-base-port"),  # 6 services: 65531..65536
    (["--health-port", "8080"], "--health-port"),
    (["--http-port", "9401"], "--http-port"),                    # a metrics port
    (["--short-workers", "16"], "--short-workers"),              # 17 workers, 16 slots
])
def test_up_refuses_ports_and_workers_it_cannot_run(args: list[str], named: str,
                                                      env: dict[str, str]) -> None:
    result = CliRunner().invoke(main, ["up", *args], env=env)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {named}" in result.output.replace("'", "")


def test_every_option_says_what_it_does() -> None:
    # --help is the operator's manual: an option listed bare (name and default only) is
    # one they must read the source for.
    bare = [name for name, param in _options(main)
            if isinstance(param, click.Option) and not param.help]
    assert bare == []


@pytest.mark.timeout(60)
def test_up_refuses_while_another_up_is_starting(env: dict[str, str], tmp_path: Path) -> None:
    """services.json is written only once a start is done (minutes, the first time): a
    second `llmq up` started meanwhile overwrote it, then deleted it on failing, and the
    first stack ran on unrecorded (`llmq down` stopped nothing)."""
    lock = tmp_path / "home" / "stack" / "up.lock"
    lock.parent.mkdir(parents=True)
    with lock.open("a") as held:  # the first `llmq up`, still starting
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = CliRunner().invoke(main, ["up", "--detach"], env=env)
    assert result.exit_code == 1, result.output
    assert "another `llmq up` is starting or running" in result.output
    assert not (tmp_path / "home" / "stack" / "services.json").exists()
