"""Lane classification: short or long, from the request's estimated total tokens.

``lane = "short" if prompt_tokens + max_tokens <= threshold(model) else "long"``, with
``threshold(model)`` from ``lanes.per_model`` or ``lanes.threshold`` (default 2000).
A client's lane hint wins only when the tenant's policy has ``may_set_lane``; otherwise it
is ignored (not refused: the request is still served, in the lane its size calls for).

Config example (YAML)::

    lanes:
      threshold: 2000
      per_model: {qwen2.5-7b: 4000}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from schemas.common import Lane
from services.ingest.core import _settings as s
from services.ingest.core.errors import ConfigError
from services.ingest.core.models import ModelRegistry

DEFAULT_LANE_THRESHOLD: Final = 2000


@dataclass(frozen=True, slots=True)
class LaneConfig:
    """Short-lane thresholds in tokens (prompt + max_tokens), each > 0.

    ``per_model`` is keyed by canonical model name (:meth:`from_mapping` resolves aliases).
    """

    threshold: int = DEFAULT_LANE_THRESHOLD
    per_model: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        s.positive_int(self.threshold, "lanes.threshold")
        for model, value in self.per_model.items():
            s.positive_int(value, f"lanes.per_model.{model}")

    def threshold_for(self, model: str) -> int:
        """The model's own threshold, else the default."""
        return self.per_model.get(model, self.threshold)

    @classmethod
    def from_mapping(
        cls, mapping: object = None, *, registry: ModelRegistry | None = None
    ) -> LaneConfig:
        """Validate a ``lanes`` table. With a registry, every ``per_model`` key must name a
        known model (an alias is stored under its canonical name), else ConfigError."""
        table = s.section(mapping or {}, "lanes")
        s.known_keys(table, ("threshold", "per_model"), "lanes")
        per_model: dict[str, int] = {}
        for model, value in s.section(table.get("per_model", {}), "lanes.per_model").items():
            setting = f"lanes.per_model.{model}"
            shape = registry.get(model) if registry is not None else None
            if registry is not None and shape is None:
                raise ConfigError(setting, f"no model shape for {model!r} (add models.{model})")
            per_model[shape.name if shape is not None else model] = s.positive_int(
                value, setting
            )
        threshold = s.positive_int(
            table.get("threshold", DEFAULT_LANE_THRESHOLD), "lanes.threshold"
        )
        return cls(threshold, MappingProxyType(per_model))


def classify_lane(
    total_tokens: int, model: str, lane_hint: Lane | None, may_set_lane: bool, config: LaneConfig
) -> Lane:
    """``lane_hint`` if given and allowed, else short when ``total_tokens`` ≤ threshold."""
    if lane_hint is not None and may_set_lane:
        return lane_hint
    return "short" if total_tokens <= config.per_model.get(model, config.threshold) else "long"
