"""The engines a worker can run, by name: one explicit registry (STYLE.md §4).

``build_engine(config)`` looks the kind up in :data:`ENGINES`. Factories import their
engine module lazily, so a worker that runs ``sim`` never imports httpx or vLLM.
``check_role(role, engine)`` refuses a prefill or decode worker whose engine cannot run
prefill and decode apart (``Engine.disaggregation``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from schemas.common import Role
from services.worker.engines.base import Engine, SchedulingPolicy
from services.worker.engines.sim.model import EngineProfile


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything any engine factory may need; each reads its own fields."""

    kind: str
    model: str
    profile: EngineProfile
    time_scale: float = 1.0
    seed: int = 0
    openai_url: str | None = None
    openai_model: str | None = None
    openai_api_key: str | None = None
    metrics_interval_s: float = 1.0
    vllm_args: Mapping[str, Any] = field(default_factory=dict)
    #: None: the engine's own default — ``priority`` for sim and vllm (llmq starts them),
    #: ``fcfs`` for openai (an external server's policy is not ours to assume).
    scheduling_policy: SchedulingPolicy | None = None


Factory = Callable[[EngineConfig], Engine]


def _sim(cfg: EngineConfig) -> Engine:
    from services.worker.engines.sim.engine import SimEngine

    return SimEngine(cfg.profile, time_scale=cfg.time_scale, seed=cfg.seed,
                     scheduling_policy=cfg.scheduling_policy or "priority")


def _openai(cfg: EngineConfig) -> Engine:
    from services.worker.engines.openai import OpenAIEngine

    if not cfg.openai_url:
        raise ValueError("the openai engine needs --openai-url (LLMQ_WORKER_OPENAI_URL)")
    return OpenAIEngine(
        cfg.openai_url, cfg.openai_model or cfg.model, profile=cfg.profile,
        api_key=cfg.openai_api_key, metrics_interval_s=cfg.metrics_interval_s,
        scheduling_policy=cfg.scheduling_policy or "fcfs",
    )


def _vllm(cfg: EngineConfig) -> Engine:
    from services.worker.engines.vllm import VllmEngine

    return VllmEngine(cfg.model, profile=cfg.profile, engine_args=cfg.vllm_args,
                      scheduling_policy=cfg.scheduling_policy or "priority")


ENGINES: Final[Mapping[str, Factory]] = MappingProxyType(
    {"sim": _sim, "openai": _openai, "vllm": _vllm}
)


def build_engine(cfg: EngineConfig) -> Engine:
    """The engine ``cfg.kind`` names; ValueError for an unknown kind or missing option."""
    try:
        factory = ENGINES[cfg.kind]
    except KeyError:
        raise ValueError(f"unknown engine {cfg.kind!r}; known: {', '.join(ENGINES)}") from None
    return factory(cfg)


def check_role(role: Role, engine: Engine) -> None:
    """ValueError when a worker of ``role`` would run ``engine`` but the role needs prefill
    and decode apart and the engine cannot run them; the message names those that can."""
    if role == "mixed" or engine.disaggregation:
        return
    raise ValueError(
        f"role {role} needs an engine that runs prefill and decode apart; the {engine.name} "
        f"engine does not (engines that do: {', '.join(_disaggregating())}), so run it "
        "with role mixed or choose one of those engines")


def _disaggregating() -> list[str]:
    """The kinds whose engine runs prefill and decode apart. Imports every engine module
    (not vLLM itself): only for the error above."""
    from services.worker.engines.openai import OpenAIEngine
    from services.worker.engines.sim.engine import SimEngine
    from services.worker.engines.vllm import VllmEngine

    classes: dict[str, type[Engine]] = {
        "sim": SimEngine, "openai": OpenAIEngine, "vllm": VllmEngine}
    assert classes.keys() == ENGINES.keys(), "an engine is missing here"
    return [kind for kind, cls in classes.items() if cls.disaggregation]
