"""Worker configuration and the slot lock's pure parts: settings, CLI, engine registry,
which member keeps a slot."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.settings import unknown_env
from services.health.settings import HealthSettings
from services.ingest.settings import IngestSettings
from services.scheduler.settings import SchedulerSettings
from services.worker.__main__ import _parse, build
from services.worker.__main__ import main as worker_main
from services.worker.engines.base import GenerateRequest
from services.worker.engines.openai import OpenAIEngine, request_body
from services.worker.engines.registry import ENGINES, EngineConfig, build_engine
from services.worker.engines.sim.engine import SimEngine
from services.worker.engines.sim.profiles import get_profile
from services.worker.engines.vllm import VllmEngine
from services.worker.runner import engine_request
from services.worker.settings import WorkerSettings
from services.worker.slot import encode_claim, pick_holder, slot_group
from tests.builders_schemas import make_assignment

PROFILE = get_profile("llama3-8b-h100")


def test_flags_become_settings() -> None:
    overrides = _parse(["--slot", "3", "--pool", "long", "--engine", "sim", "--profile",
                        "llama3-8b-a100", "--model", "llama-3.1-8b", "--worker-id", "w-3",
                        "--time-scale", "0.5", "--chunk-tokens", "8", "--chunk-ms", "20"])
    ws = WorkerSettings(**overrides)
    assert (ws.slot, ws.pool, ws.engine, ws.profile, ws.model) == \
        (3, "long", "sim", "llama3-8b-a100", "llama-3.1-8b")
    assert (ws.resolved_worker_id(), ws.time_scale, ws.chunk_tokens, ws.chunk_ms) == \
        ("w-3", 0.5, 8, 20.0)
    assert ws.heartbeat_interval_s == 1.0 and ws.resolved_drain_quiet_s() == 2.0
    assert ws.lease_s() == 2.75  # 2.75 intervals of 1 s: under the scheduler's 3
    leased = WorkerSettings(**_parse(["--slot", "0", "--heartbeat-interval", "0.5",
                                      "--lease-beats", "2.5"]))
    assert leased.lease_s() == 1.25


def test_environment_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMQ_WORKER_SLOT", "5")
    monkeypatch.setenv("LLMQ_METRICS_PORT", "9123")
    ws = WorkerSettings()
    assert ws.slot == 5 and ws.metrics_port == 9123
    assert ws.resolved_worker_id().endswith("-slot5")
    assert (ws.chunk_tokens, ws.chunk_ms, ws.engine, ws.pool) == (16, 50.0, "sim", "any")


@pytest.mark.parametrize("bad", [{"slot": -1}, {"slot": 0, "pool": "huge"},
                                 {"slot": 0, "worker_id": "bad id"},
                                 {"slot": 0, "time_scale": -1},
                                 {"slot": 0, "lease_beats": 1.0},  # would fence between beats
                                 # would answer work the scheduler declared lost (3 beats)
                                 {"slot": 0, "lease_beats": 3.0},
                                 # under Kafka's group.min.session.timeout.ms: the join fails
                                 {"slot": 0, "session_timeout_ms": 5_999},
                                 # a 13.75 s lease outlives the 10 s session: a process
                                 # dropped from its group could still answer its work
                                 {"slot": 0, "heartbeat_interval_s": 5}])
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        WorkerSettings(**bad)  # type: ignore[arg-type]  # deliberately wrong


def test_a_lease_longer_than_the_session_says_what_to_change() -> None:
    assert WorkerSettings(slot=0, heartbeat_interval_s=2.0, session_timeout_ms=6_000)
    with pytest.raises(ValidationError) as refused:
        WorkerSettings(slot=0, heartbeat_interval_s=2.5, session_timeout_ms=6_000)
    message = str(refused.value)
    assert "lease_beats × heartbeat_interval_s = 2.75 × 2.5 s = 6.875 s" in message
    assert "session_timeout_ms = 6000 ms" in message
    assert "raise session_timeout_ms above 6875" in message


def test_build_wires_profile_model_and_engine() -> None:
    worker = build({"slot": 2, "pool": "short", "worker_id": "w2"})
    assert isinstance(worker.engine, SimEngine)
    assert worker.ws.scheduling_policy is None  # each engine's default: priority for sim
    assert worker.engine._by_priority
    assert (worker.id.model, worker.id.engine, worker.id.slot) == (PROFILE.model, "sim", 2)
    assert worker.tp.partition == 2 and worker.group.endswith("-worker-slot-2")


def test_bad_configuration_exits_2() -> None:
    for argv in (["--slot", "0", "--profile", "nope"], ["--slot", "0", "--engine", "openai"],
                 []):
        done = subprocess.run([sys.executable, "-m", "services.worker", *argv],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2, (argv, done.stderr)
        assert "invalid configuration" in done.stderr


def test_registry_names_every_engine() -> None:
    assert set(ENGINES) == {"sim", "openai", "vllm"}
    with pytest.raises(ValueError, match="unknown engine"):
        build_engine(EngineConfig(kind="tgi", model="m", profile=PROFILE))
    with pytest.raises(ValueError, match="openai-url"):
        build_engine(EngineConfig(kind="openai", model="m", profile=PROFILE))
    assert build_engine(EngineConfig(kind="vllm", model="m", profile=PROFILE)).name == "vllm"


@pytest.mark.parametrize(("priority", "aged", "lane", "engine_priority"),
                         [("high", None, "short", 0), ("normal", None, "short", 2),
                          ("low", None, "short", 4), ("low", 1, "short", 2),
                          ("low", 0, "short", 0), ("high", None, "long", 1),
                          ("low", None, "long", 5), ("low", 1, "long", 3)])
def test_the_engine_gets_the_aged_class_else_the_admitted_one_then_the_lane(
    priority: str, aged: int | None, lane: str, engine_priority: int
) -> None:
    # Class first (aged, else admitted), then short before long: 2 · class + (1 if long).
    assignment = make_assignment(engine_priority=aged)
    admitted = assignment.admitted.evolve(priority=priority, lane=lane)
    assignment = assignment.evolve(admitted=admitted)
    assert engine_request(assignment, "e1").priority == engine_priority


def test_vllm_schedules_by_priority_unless_its_args_say_otherwise() -> None:
    default = VllmEngine("m", profile=PROFILE)
    fcfs = VllmEngine("m", profile=PROFILE, scheduling_policy="fcfs")
    explicit = VllmEngine("m", profile=PROFILE, engine_args={"scheduling_policy": "fcfs"})
    assert default._engine_args["scheduling_policy"] == "priority"
    assert fcfs._engine_args["scheduling_policy"] == explicit._engine_args[
        "scheduling_policy"] == "fcfs"
    assert _parse(["--slot", "0", "--scheduling-policy", "fcfs"])["scheduling_policy"] == "fcfs"


def test_openai_sends_the_class_only_when_told_the_server_schedules_by_priority() -> None:
    url = "http://127.0.0.1:1"
    default = build_engine(EngineConfig(kind="openai", model="m", profile=PROFILE, openai_url=url))
    told = build_engine(EngineConfig(kind="openai", model="m", profile=PROFILE, openai_url=url,
                                     scheduling_policy="priority"))
    assert isinstance(default, OpenAIEngine) and isinstance(told, OpenAIEngine)
    assert (default._by_priority, told._by_priority) == (False, True)
    req = GenerateRequest(request_id="r", model="m", max_tokens=5, prompt_tokens=3,
                          prompt="hi", priority=2)
    assert "priority" not in request_body(req, "srv")[1]
    assert request_body(req, "srv", priority=True)[1]["priority"] == 2


HOLDER_CASES = {
    "earliest start keeps the slot": ({"m1": encode_claim("a", 20.0),
                                       "m2": encode_claim("b", 10.0)}, "m2"),
    "tie broken by member id": ({"m2": encode_claim("a", 10.0),
                                 "m1": encode_claim("b", 10.0)}, "m1"),
    "members without a claim sort last": ({"m0": b"junk", "m9": encode_claim("x", 99.0),
                                            "m1": None}, "m9"),
    "the current holder keeps it against an older newcomer": (
        {"m1": encode_claim("new", 5.0), "m2": encode_claim("old", 50.0, holding=True)}, "m2",
    ),
    "all without claims: smallest id": ({"m3": None, "m2": b"{}"}, "m2"),
    "two holders (a paused one came back): the later process keeps it": (
        {"m1": encode_claim("w", 5.0, holding=True), "m2": encode_claim("w", 50.0, holding=True)},
        "m2",
    ),
}


@pytest.mark.parametrize("claims, want", HOLDER_CASES.values(), ids=HOLDER_CASES.keys())
def test_pick_holder(claims: dict[str, bytes | None], want: str) -> None:
    assert pick_holder(claims) == want


def test_slot_group_name() -> None:
    assert slot_group("llmq", 7) == "llmq-worker-slot-7"


def test_a_misspelt_setting_is_named_with_the_closest_one() -> None:
    """pydantic-settings ignores an unknown LLMQ_WORKER_* in silence: the setting would
    just not apply (three test stacks set LLMQ_WORKER_HEARTBEAT_INTERVAL for months)."""
    env = {"LLMQ_WORKER_HEARTBEAT_INTERVAL": "0.5", "LLMQ_WORKER_SLOT": "1",
           "LLMQ_WORKER_METRICS_PORT": "9100", "llmq_worker_chunk_ms": "20",
           "LLMQ_SCHEDULER_SEED": "3", "PATH": "/bin"}
    assert unknown_env(WorkerSettings, env) == [
        "LLMQ_WORKER_HEARTBEAT_INTERVAL is not a setting and is ignored "
        "(did you mean LLMQ_WORKER_HEARTBEAT_INTERVAL_S?)"]


@pytest.mark.parametrize("cls", [WorkerSettings, SchedulerSettings, IngestSettings,
                                 HealthSettings])
def test_every_setting_and_alias_is_known(cls: type[BaseSettings]) -> None:
    prefix = str(cls.model_config["env_prefix"])
    environ = {f"{prefix}{name}".upper(): "x" for name in cls.model_fields}
    for field in cls.model_fields.values():
        if isinstance(field.validation_alias, AliasChoices):
            environ.update({str(choice): "x" for choice in field.validation_alias.choices})
    assert unknown_env(cls, environ) == []


class _Aliased(BaseSettings):
    """A setting whose alias carries the prefix but is not prefix + field name: llmq's own
    aliases all happen to equal that, so only this shows the aliases are read."""

    model_config = SettingsConfigDict(env_prefix="LLMQ_TEST_")
    port: int = Field(0, validation_alias=AliasChoices("LLMQ_TEST_LISTEN_PORT", "port"))


def test_an_alias_with_the_prefix_is_known() -> None:
    environ = {"LLMQ_TEST_LISTEN_PORT": "1", "LLMQ_TEST_PORT": "1", "LLMQ_TEST_PROT": "1"}
    assert unknown_env(_Aliased, environ) == [
        "LLMQ_TEST_PROT is not a setting and is ignored (did you mean LLMQ_TEST_PORT?)"]


def test_the_worker_warns_of_unknown_settings_on_stderr(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMQ_WORKER_SLOTT", "2")
    assert worker_main(["--slot", "-1"]) == 2  # invalid: stops before connecting
    err = capsys.readouterr().err
    assert "worker: warning: LLMQ_WORKER_SLOTT is not a setting and is ignored " \
           "(did you mean LLMQ_WORKER_SLOT?)" in err
