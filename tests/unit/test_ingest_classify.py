"""Lane classification and its config (services.ingest.core.classify)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from schemas.common import Lane
from services.ingest.core import ConfigError, LaneConfig, ModelRegistry, classify_lane

CONFIG = LaneConfig(2000, MappingProxyType({"qwen2.5-7b": 4000}))


@pytest.mark.parametrize(
    ("total", "model", "hint", "may_set_lane", "lane"),
    [
        (1, "llama-3.1-8b", None, False, "short"),
        (2000, "llama-3.1-8b", None, False, "short"),
        (2001, "llama-3.1-8b", None, False, "long"),
        (4000, "qwen2.5-7b", None, False, "short"),  # per-model threshold
        (4001, "qwen2.5-7b", None, False, "long"),
        (100, "llama-3.1-8b", "long", True, "long"),  # hint honoured when allowed
        (9000, "llama-3.1-8b", "short", True, "short"),
        (100, "llama-3.1-8b", "long", False, "short"),  # hint ignored otherwise
        (9000, "llama-3.1-8b", "short", False, "long"),
    ],
)
def test_classify_lane(
    total: int, model: str, hint: Lane | None, may_set_lane: bool, lane: Lane
) -> None:
    assert classify_lane(total, model, hint, may_set_lane, CONFIG) == lane


def test_default_threshold_is_2000() -> None:
    assert LaneConfig().threshold_for("anything") == 2000
    assert LaneConfig.from_mapping(None) == LaneConfig()


def test_from_mapping_resolves_aliases_to_canonical_names() -> None:
    config = LaneConfig.from_mapping(
        {"threshold": 1000, "per_model": {"Qwen/Qwen2.5-7B-Instruct": 3000}},
        registry=ModelRegistry.from_mapping(),
    )
    assert config.threshold_for("qwen2.5-7b") == 3000
    assert config.threshold_for("llama-3.1-8b") == 1000


@pytest.mark.parametrize(
    ("table", "setting"),
    [
        ({"threshold": 0}, "lanes.threshold"),
        ({"threshold": -10}, "lanes.threshold"),
        ({"threshold": 1.5}, "lanes.threshold"),
        ({"per_model": {"qwen2.5-7b": 0}}, "lanes.per_model.qwen2.5-7b"),
        ({"per_model": {"no-such-model": 100}}, "lanes.per_model.no-such-model"),
        ({"per_model": ["qwen2.5-7b"]}, "lanes.per_model"),
        ({"treshold": 100}, "lanes.treshold"),
    ],
)
def test_from_mapping_names_the_bad_setting(table: dict[str, object], setting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        LaneConfig.from_mapping(table, registry=ModelRegistry.from_mapping())
    assert caught.value.setting == setting


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"lanes\.threshold"):
        LaneConfig(threshold=0)
