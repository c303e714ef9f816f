"""What `llmq up` refuses before anything starts (services.stack.config_problem), and the
metrics ports the services get."""

from __future__ import annotations

from typing import Any

import pytest

from services.stack import StackConfig, config_problem, metrics_ports, stack_services


def cfg(**changes: Any) -> StackConfig:
    return StackConfig(**changes)  # defaults: 2 short + 1 long workers, 6 services


@pytest.mark.parametrize(
    ("config", "option", "says"),
    [
        (cfg(metrics_base_port=65531), "--metrics-base-port", "give at most 65530"),
        (cfg(short_workers=16), "--short-workers", "17 workers need 17 slots"),
        (cfg(health_port=8080), "--health-port", "is --http-port too"),
        (cfg(http_port=9400), "--http-port", "one of the metrics ports 9400-9405"),
        (cfg(health_port=9405), "--health-port", "one of the metrics ports 9400-9405"),
    ],
)
def test_config_problems(config: StackConfig, option: str, says: str) -> None:
    problem = config_problem(config, slots=16)
    assert problem is not None
    assert option in problem[0] and says in problem[1]


@pytest.mark.parametrize("config", [cfg(), cfg(metrics_base_port=65530), cfg(short_workers=13),
                                    cfg(http_port=9406), cfg(health_port=9399)])
def test_configs_that_run(config: StackConfig) -> None:
    assert config_problem(config, slots=16) is None


def test_one_metrics_port_per_service_however_many_workers() -> None:
    big = cfg(short_workers=1000, long_workers=0, metrics_base_port=20_000)
    ports = [dict(s.env)["LLMQ_METRICS_PORT"] for s in stack_services(big)]
    assert ports == [str(p) for p in metrics_ports(big)] and len(ports) == 1003
