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


def test_scheduler_replicas_get_an_id_each_and_ports_after_the_workers() -> None:
    alone = {s.name: dict(s.env) for s in stack_services(cfg())}
    assert "LLMQ_SCHEDULER_SCHEDULER_ID" not in alone["scheduler"]  # the default id
    three = stack_services(cfg(schedulers=3))
    env = {s.name: dict(s.env) for s in three}
    schedulers = [s.name for s in three if s.argv[-1] == "services.scheduler"]
    assert schedulers == ["scheduler", "scheduler-2", "scheduler-3"]
    assert [s.name for s in three][:3] == schedulers  # before ingest, as one was
    assert [env[n]["LLMQ_SCHEDULER_SCHEDULER_ID"] for n in schedulers] == [
        "scheduler-1", "scheduler-2", "scheduler-3"]
    # The default stack's ports stay where prometheus.yml scrapes them.
    for name in ("scheduler", "ingest", "health", "worker-0", "worker-1", "worker-2"):
        assert env[name]["LLMQ_METRICS_PORT"] == alone[name]["LLMQ_METRICS_PORT"]
    assert [env[n]["LLMQ_METRICS_PORT"] for n in schedulers[1:]] == ["9406", "9407"]
    ports = sorted(int(e["LLMQ_METRICS_PORT"]) for e in env.values())
    assert ports == list(metrics_ports(cfg(schedulers=3)))
    assert config_problem(cfg(schedulers=3, http_port=9407), slots=16) == (
        "--http-port", "9407 is one of the metrics ports 9400-9407 (--metrics-base-port and "
        "up): give another port")


@pytest.mark.parametrize(("config", "option", "says"), [
    (cfg(http_port=9092), "--http-port", "9092 is Kafka's port"),
    (cfg(health_port=16686), "--health-port", "16686 is Jaeger's query_http port"),
    (cfg(metrics_base_port=9090), "--metrics-base-port", "9092 is Kafka's port"),
])
def test_a_port_the_broker_or_jaeger_takes_is_refused_before_anything_starts(
    config: StackConfig, option: str, says: str
) -> None:
    """Found by an audit: these collided only once the broker had started."""
    taken = {9092: "Kafka's port (LLMQ_KAFKA_PORT)", 16686: "Jaeger's query_http port"}
    problem = config_problem(config, slots=16, taken=taken)
    assert problem is not None and problem[0] == option and says in problem[1]
    assert config_problem(config, slots=16) is None  # an external broker, no Jaeger


def test_up_refuses_kafkas_port_for_ingest(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from services.cli import main
    from services.dev.kafka_broker import KafkaBroker

    def no_broker(self: KafkaBroker, *args: object, **kwargs: object) -> None:
        raise AssertionError("refused before anything starts: no broker")

    monkeypatch.setattr(KafkaBroker, "up", no_broker)
    monkeypatch.setattr(KafkaBroker, "status", no_broker)
    monkeypatch.delenv("LLMQ_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("LLMQ_KAFKA_PORT", "1")  # nothing listens there either
    result = CliRunner().invoke(main, ["up", "--http-port", "1"])
    assert result.exit_code == 2 and "1 is Kafka's port" in " ".join(result.output.split())
